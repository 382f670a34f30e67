//! Receipt quotas: how much one job, and one user's unfinished jobs together, may store. A rank
//! that writes receipts without end (one did at ~20 MB/s) fills the database every other job and
//! user shares; past its quota its receipts are dropped (acknowledged, so its agent does not
//! send them again), counted, logged once, and shown on the job (`ctl status`'s warnings).
//! Step receipts, which every analysis reads, get the larger budget; other kinds a smaller one.
//!
//! Sizes are the characters of the receipts' bodies, as stored. A job's use is read from the
//! store the first time it sends receipts after a controller start (one read a job, however
//! many of its agents send at once), then kept here (a few numbers a job, for the controller's
//! life); a finished job's use no longer counts against its user's. The first receipt a job
//! drops is an event of the job (`job_events`).

use std::collections::HashMap;
use std::sync::Mutex;

use trainyard_store::JobId;

pub use crate::config::QuotaConfig;

/// One job's use of its quota.
#[derive(Debug, Clone, Default)]
struct Usage {
    user: String,
    step: u64,
    other: u64,
    dropped: u64,
    dropped_bytes: u64,
    /// Why the first receipt was dropped (for the log line and the job's warning).
    why: Option<String>,
}

/// What a job's quota says of one receipt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Admit {
    Store,
    /// Dropped; `first` when it is the job's first receipt dropped (log it once).
    Drop {
        first: bool,
        why: String,
    },
}

/// The quotas of the jobs that sent receipts since this controller started.
#[derive(Debug, Default)]
pub(super) struct Quotas {
    jobs: Mutex<HashMap<JobId, Usage>>,
    /// Held while jobs' use is read from the store ([`Quotas::seed_each`]).
    seeding: tokio::sync::Mutex<()>,
}

impl Quotas {
    fn jobs(&self) -> std::sync::MutexGuard<'_, HashMap<JobId, Usage>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether job `job`'s use is known here (else the caller reads it from the store).
    pub(super) fn knows(&self, job: JobId) -> bool {
        self.jobs().contains_key(&job)
    }

    /// Job `job` of `user` has stored `step` and `other` bytes of receipts (read from the store).
    pub(super) fn seed(&self, job: JobId, user: &str, step: u64, other: u64) {
        self.jobs().entry(job).or_insert(Usage { user: user.to_string(), step, other, ..Default::default() });
    }

    /// Seeds every job of `jobs` (with its user) not known yet with its stored use, `read` from
    /// the store, one read at a time: after a controller starts (a failover), every agent of a
    /// job sends its first batch at once, and each reading the same sum over the job's receipts
    /// (millions of rows) held the store's connections the batches waited for.
    pub(super) async fn seed_each<E, F>(
        &self,
        jobs: Vec<(JobId, String)>,
        read: impl Fn(JobId) -> F,
    ) -> Result<(), E>
    where
        F: std::future::Future<Output = Result<(u64, u64), E>>,
    {
        if jobs.is_empty() {
            return Ok(());
        }
        let _one_at_a_time = self.seeding.lock().await;
        for (job, user) in jobs {
            // Another batch's read may have seeded it while this one waited.
            if !self.knows(job) {
                let (step, other) = read(job).await?;
                self.seed(job, &user, step, other);
            }
        }
        Ok(())
    }

    /// What each user's unfinished jobs (`active`) have stored: once per batch, for
    /// [`Quotas::admit`], which keeps it up to date as it admits.
    pub(super) fn users(&self, active: &dyn Fn(JobId) -> bool) -> HashMap<String, u64> {
        let mut users: HashMap<String, u64> = HashMap::new();
        for (_, u) in self.jobs().iter().filter(|(id, u)| !u.user.is_empty() && active(**id)) {
            *users.entry(u.user.clone()).or_default() += u.step + u.other;
        }
        users
    }

    /// Admits (and charges) or drops (and counts) one receipt of job `job` of `bytes`; `users`
    /// holds what each user's unfinished jobs have stored ([`Quotas::users`]).
    pub(super) fn admit(
        &self,
        config: &QuotaConfig,
        job: JobId,
        step_kind: bool,
        bytes: u64,
        users: &mut HashMap<String, u64>,
    ) -> Admit {
        let mut jobs = self.jobs();
        let usage = jobs.entry(job).or_default();
        let user = usage.user.clone();
        let user_used = users.get(&user).copied().unwrap_or(0);
        let (used, budget, what) = if step_kind {
            (usage.step, config.job_step_bytes, "step receipts")
        } else {
            (usage.other, config.job_other_bytes, "receipts other than steps")
        };
        let why = if used + bytes > budget {
            Some(format!("the job's {what} reached its quota of {}", human(budget)))
        } else if !user.is_empty() && user_used + bytes > config.user_bytes {
            Some(format!(
                "user {user}'s unfinished jobs reached their quota of {} of receipts",
                human(config.user_bytes)
            ))
        } else {
            None
        };
        match why {
            None => {
                if step_kind {
                    usage.step += bytes;
                } else {
                    usage.other += bytes;
                }
                if !user.is_empty() {
                    *users.entry(user).or_default() += bytes;
                }
                Admit::Store
            }
            Some(why) => {
                usage.dropped += 1;
                usage.dropped_bytes += bytes;
                let first = usage.why.is_none();
                usage.why.get_or_insert_with(|| why.clone());
                Admit::Drop { first, why }
            }
        }
    }

    /// What the job's quota dropped so far, as its warning says it; `None` when nothing.
    pub(super) fn warning(&self, job: JobId) -> Option<String> {
        let jobs = self.jobs();
        let u = jobs.get(&job).filter(|u| u.dropped > 0)?;
        Some(format!(
            "{} receipt(s) ({}) were dropped, not stored: {} (the controller's --receipt-quota-* flags)",
            u.dropped,
            human(u.dropped_bytes),
            u.why.as_deref().unwrap_or("over quota")
        ))
    }
}

fn human(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b => format!("{b} bytes"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_jobs_use_is_read_once_when_its_agents_send_at_once() {
        let q = Quotas::default();
        let reads = std::sync::atomic::AtomicUsize::new(0);
        let read = |_job: JobId| {
            reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                Ok::<_, ()>((700, 30))
            }
        };
        let batch = || q.seed_each(vec![(1, "alice".to_string())], read);
        let seeded = tokio::join!(batch(), batch(), batch(), batch());
        assert_eq!(seeded, (Ok(()), Ok(()), Ok(()), Ok(())));
        assert_eq!(reads.load(std::sync::atomic::Ordering::SeqCst), 1, "four batches at once, one read");
        assert_eq!(q.users(&|_| true)["alice"], 730);
        // A failed read seeds nothing: the next batch reads again.
        let failed = q.seed_each(vec![(2, "bob".to_string())], |_| async { Err::<(u64, u64), _>("down") });
        assert_eq!(failed.await, Err("down"));
        assert!(!q.knows(2));
    }

    #[test]
    fn a_job_and_a_user_stop_at_their_quotas_and_a_finished_job_stops_counting() {
        let q = Quotas::default();
        let config = QuotaConfig { job_step_bytes: 1_000, job_other_bytes: 100, user_bytes: 1_500 };
        let all = |_: JobId| true;
        q.seed(1, "alice", 900, 0);
        let mut users = q.users(&all);
        assert_eq!(q.admit(&config, 1, true, 100, &mut users), Admit::Store, "at the job's step quota");
        let Admit::Drop { first, why } = q.admit(&config, 1, true, 1, &mut users) else {
            panic!("one byte past")
        };
        assert!(first && why.contains("step receipts reached its quota of 1000 bytes"), "{why}");
        assert!(matches!(q.admit(&config, 1, true, 1, &mut users), Admit::Drop { first: false, .. }));
        assert_eq!(
            q.admit(&config, 1, false, 100, &mut users),
            Admit::Store,
            "other kinds have their own budget"
        );
        assert!(matches!(q.admit(&config, 1, false, 1, &mut users), Admit::Drop { .. }));
        // Alice's second job: her jobs together hold 1,100; 400 more is her quota.
        q.seed(2, "alice", 0, 0);
        let mut users = q.users(&all);
        assert_eq!(users["alice"], 1_100);
        assert_eq!(q.admit(&config, 2, true, 400, &mut users), Admit::Store);
        let Admit::Drop { why, .. } = q.admit(&config, 2, true, 1, &mut users) else {
            panic!("past alice's quota")
        };
        assert!(why.contains("user alice's unfinished jobs"), "{why}");
        // Once job 1 is finished its use no longer counts against her.
        let mut users = q.users(&|id| id != 1);
        assert_eq!(q.admit(&config, 2, true, 1, &mut users), Admit::Store);
        // Bob is not held back by alice.
        q.seed(3, "bob", 0, 0);
        let mut users = q.users(&all);
        assert_eq!(q.admit(&config, 3, true, 900, &mut users), Admit::Store);
        let w = q.warning(1).expect("job 1 dropped some");
        assert!(w.starts_with("3 receipt(s) (3 bytes) were dropped"), "{w}");
        assert_eq!(q.warning(3), None);
    }
}
