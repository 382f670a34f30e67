//! What both SQL backends share: plain column values of a job, integer conversions, and the
//! readers that turn a row into a record.
//!
//! Every integer is read as `i64` (SQLite's `INTEGER`, PostgreSQL's `BIGINT`) and converted with
//! a range check, so a row that does not fit its Rust type is a [`StoreError::Corrupt`] naming
//! the table and column, never a panic or a silent wrap. The readers are generated per backend
//! by [`row_readers!`] because sqlx's row types differ while the code is the same.

use prost::Message as _;

use trainyard_model::domain::Inventory;
use trainyard_model::spec::{Engine, JobSpec};

use super::{JobId, Result, StoreError};

/// Selected columns of `jobs`, read by `job_from_row`.
macro_rules! job_columns {
    () => {
        "id, state, reason, attempt, spec_pb, created_at_ms, updated_at_ms, submitted_by, run_as"
    };
}
pub(super) use job_columns;

/// Selected columns of `allocations` (aliased `a`), read by `allocation_from_row`.
macro_rules! allocation_columns {
    () => {
        "a.job_id, a.attempt, a.rank, a.agent_id, a.gpu_index, a.node_rank, a.local_rank, \
         a.state, a.pid, a.exit_code, a.signal, a.message, a.skipped_lines, a.updated_at_ms, \
         a.planned_cpus, a.planned_mems, a.effective_cpus, a.effective_mems"
    };
}
pub(super) use allocation_columns;

/// The start-up snapshot's queries (no parameters, the same text on both backends): active
/// jobs, the allocations of their current attempts, and every agent.
pub(super) const SNAPSHOT_JOBS: &str = concat!(
    "SELECT ",
    job_columns!(),
    " FROM jobs WHERE state NOT IN ('succeeded', 'failed', 'cancelled') ORDER BY id"
);
pub(super) const SNAPSHOT_ALLOCATIONS: &str = concat!(
    "SELECT ",
    allocation_columns!(),
    " FROM allocations a JOIN jobs j ON j.id = a.job_id AND j.attempt = a.attempt \
     WHERE j.state NOT IN ('succeeded', 'failed', 'cancelled') ORDER BY a.job_id, a.rank"
);
pub(super) const SNAPSHOT_AGENTS: &str = "SELECT agent_id, address, agent_version, inventory_pb, state, last_seen_ms FROM agents ORDER BY agent_id";

/// The queries of the reports whose id is in `ids` (a subquery) and of their checks.
pub(super) fn preflight_queries(ids: &str) -> (String, String) {
    let reports = format!(
        "SELECT id, agent_id, local_id, level, started_at_ms, finished_at_ms, verdict, \
         interconnect_class, driver_version, cuda_version, nccl_version, source, topology \
         FROM preflight_reports WHERE id IN {ids} ORDER BY agent_id, id"
    );
    let checks = format!(
        "SELECT report_id, check_id, status, measured, expected, remedy FROM preflight_checks \
         WHERE report_id IN {ids} ORDER BY report_id, position"
    );
    (reports, checks)
}

/// The plain engine columns of `jobs`: kind, argv as JSON, working directory.
pub(super) fn engine_columns(spec: &JobSpec) -> (Option<&'static str>, Option<String>, Option<String>) {
    match &spec.engine {
        Engine::Exec { argv, workdir, .. } => {
            (Some("exec"), serde_json::to_string(argv).ok(), Some(workdir.clone()))
        }
        Engine::Builtin { .. } => (Some("builtin"), None, None),
    }
}

/// `jobs.spec_pb`: the spec in its wire encoding, which keeps old rows readable as fields are
/// added.
pub(super) fn encode_spec(spec: &JobSpec) -> Vec<u8> {
    trainyard_proto::v1::JobSpec::from(spec).encode_to_vec()
}

pub(super) fn decode_spec(bytes: &[u8]) -> Result<JobSpec> {
    let wire = trainyard_proto::v1::JobSpec::decode(bytes)
        .map_err(|e| corrupt("jobs", format!("column spec_pb: {e}")))?;
    JobSpec::try_from(wire).map_err(|e| corrupt("jobs", format!("column spec_pb: {e}")))
}

/// `agents.inventory_pb`, likewise.
pub(super) fn encode_inventory(inv: &Inventory) -> Vec<u8> {
    trainyard_proto::v1::HostInventory::from(inv).encode_to_vec()
}

pub(super) fn decode_inventory(bytes: &[u8]) -> Result<Inventory> {
    trainyard_proto::v1::HostInventory::decode(bytes)
        .map(Inventory::from)
        .map_err(|e| corrupt("agents", format!("column inventory_pb: {e}")))
}

/// Ids and counters are `u64` in Rust and 64-bit signed in SQL; values past `i64::MAX` cannot
/// be stored and are refused as an encode error.
pub(super) fn int(v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|e| StoreError::Database(sqlx::Error::Encode(Box::new(e))))
}

pub(super) fn job_id_from(v: i64) -> Result<JobId> {
    u64::try_from(v).map_err(|_| corrupt("jobs", format!("negative id {v}")))
}

pub(super) fn report_id_from(v: i64) -> Result<u64> {
    u64::try_from(v).map_err(|_| corrupt("preflight_reports", format!("negative id {v}")))
}

/// A unique-key violation of either backend as [`StoreError::Duplicate`]; other errors as they are.
pub(super) fn duplicate_or(e: sqlx::Error) -> StoreError {
    match &e {
        sqlx::Error::Database(db) if db.kind() == sqlx::error::ErrorKind::UniqueViolation => {
            StoreError::Duplicate(db.message().to_string())
        }
        _ => StoreError::Database(e),
    }
}

pub(super) fn corrupt(table: &'static str, detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt { table, detail: detail.into() }
}

/// Converts an integer read from column `name` of `table` to the record's type.
pub(super) fn fit<T: TryFrom<i64>>(v: i64, table: &'static str, name: &str) -> Result<T> {
    T::try_from(v).map_err(|_| corrupt(table, format!("column {name}: {v} out of range")))
}

/// Generates, for one backend's row type, the functions that read records out of rows:
/// `col` (any decodable column), `num` / `opt_num` (integers with a range check), and one
/// `*_from_row` per record type.
macro_rules! row_readers {
    ($row:ty, $db:ty) => {
        use sqlx::Row as _;
        use $crate::rows::{corrupt, decode_inventory, decode_spec, fit, report_id_from};
        use $crate::{
            AgentRecord, Allocation, CheckRecord, JobEventRecord, JobRecord, JobState, PreflightRecord,
            RankId, RankObserved, StoredReceiptRecord,
        };

        /// Reads one column, naming the table when the value does not decode.
        fn col<'r, T>(row: &'r $row, table: &'static str, name: &str) -> Result<T>
        where
            T: sqlx::Decode<'r, $db> + sqlx::Type<$db>,
        {
            row.try_get(name).map_err(|e| corrupt(table, format!("column {name}: {e}")))
        }

        /// Reads an integer column into the record's integer type.
        fn num<T: TryFrom<i64>>(row: &$row, table: &'static str, name: &str) -> Result<T> {
            fit(col::<i64>(row, table, name)?, table, name)
        }

        fn opt_num<T: TryFrom<i64>>(row: &$row, table: &'static str, name: &str) -> Result<Option<T>> {
            col::<Option<i64>>(row, table, name)?.map(|v| fit(v, table, name)).transpose()
        }

        fn state_col(row: &$row, table: &'static str, name: &str) -> Result<JobState> {
            let s: String = col(row, table, name)?;
            JobState::parse(&s).ok_or_else(|| corrupt(table, format!("column {name}: unknown state {s:?}")))
        }

        fn job_from_row(row: &$row) -> Result<JobRecord> {
            let t = "jobs";
            let spec_pb: Vec<u8> = col(row, t, "spec_pb")?;
            Ok(JobRecord {
                id: num(row, t, "id")?,
                spec: decode_spec(&spec_pb)?,
                owner: $crate::JobOwner {
                    user: col(row, t, "submitted_by")?,
                    run_as: col(row, t, "run_as")?,
                },
                state: state_col(row, t, "state")?,
                reason: col(row, t, "reason")?,
                attempt: num(row, t, "attempt")?,
                created_at_ms: col(row, t, "created_at_ms")?,
                updated_at_ms: col(row, t, "updated_at_ms")?,
            })
        }

        fn event_from_row(row: &$row) -> Result<JobEventRecord> {
            let t = "job_events";
            let from: Option<String> = col(row, t, "from_state")?;
            Ok(JobEventRecord {
                job_id: num(row, t, "job_id")?,
                at_ms: col(row, t, "at_ms")?,
                from_state: match from {
                    None => None,
                    Some(_) => Some(state_col(row, t, "from_state")?),
                },
                to_state: state_col(row, t, "to_state")?,
                attempt: num(row, t, "attempt")?,
                reason: col(row, t, "reason")?,
            })
        }

        fn allocation_from_row(row: &$row) -> Result<Allocation> {
            let t = "allocations";
            let state: String = col(row, t, "state")?;
            Ok(Allocation {
                id: RankId {
                    job_id: num(row, t, "job_id")?,
                    attempt: num(row, t, "attempt")?,
                    rank: num(row, t, "rank")?,
                },
                agent_id: col(row, t, "agent_id")?,
                gpu_index: num(row, t, "gpu_index")?,
                node_rank: num(row, t, "node_rank")?,
                local_rank: num(row, t, "local_rank")?,
                planned_cpus: col(row, t, "planned_cpus")?,
                planned_mems: col(row, t, "planned_mems")?,
                observed: RankObserved {
                    state: state.parse().map_err(|e| corrupt(t, format!("column state: {e}")))?,
                    pid: opt_num(row, t, "pid")?,
                    exit_code: opt_num(row, t, "exit_code")?,
                    signal: opt_num(row, t, "signal")?,
                    message: col(row, t, "message")?,
                    skipped_lines: num(row, t, "skipped_lines")?,
                    updated_at_ms: col(row, t, "updated_at_ms")?,
                    effective_cpus: col(row, t, "effective_cpus")?,
                    effective_mems: col(row, t, "effective_mems")?,
                },
            })
        }

        fn agent_from_row(row: &$row) -> Result<AgentRecord> {
            let t = "agents";
            let inventory_pb: Vec<u8> = col(row, t, "inventory_pb")?;
            let state: String = col(row, t, "state")?;
            Ok(AgentRecord {
                agent_id: col(row, t, "agent_id")?,
                address: col(row, t, "address")?,
                agent_version: col(row, t, "agent_version")?,
                inventory: decode_inventory(&inventory_pb)?,
                state: state.parse().map_err(|e| corrupt(t, format!("column state: {e}")))?,
                last_seen_ms: col(row, t, "last_seen_ms")?,
            })
        }

        fn sample_from_row(row: &$row) -> Result<trainyard_analysis::diagnose::StepSample> {
            let t = "receipts";
            Ok(trainyard_analysis::diagnose::StepSample {
                rank: num(row, t, "rank")?,
                step: col::<Option<i64>>(row, t, "step")?.unwrap_or(-1),
                step_time_ms: col(row, t, "step_time_ms")?,
                fwd_bwd_ms: col(row, t, "fwd_bwd_ms")?,
                optimizer_ms: col(row, t, "optimizer_ms")?,
                tokens_per_s: col(row, t, "tokens_per_s")?,
                flagged: col::<Option<String>>(row, t, "problem")?.is_some(),
            })
        }

        fn receipt_from_row(row: &$row) -> Result<StoredReceiptRecord> {
            let t = "receipts";
            Ok(StoredReceiptRecord {
                position: num(row, t, "position")?,
                id: RankId {
                    job_id: num(row, t, "job_id")?,
                    attempt: num(row, t, "attempt")?,
                    rank: num(row, t, "rank")?,
                },
                seq: num(row, t, "seq")?,
                kind: col(row, t, "kind")?,
                step: col(row, t, "step")?,
                body: col(row, t, "body")?,
            })
        }

        /// A column holding one of a domain enum's words.
        fn word<T: std::str::FromStr<Err = trainyard_model::domain::UnknownWord>>(
            row: &$row,
            table: &'static str,
            name: &str,
        ) -> Result<T> {
            let s: String = col(row, table, name)?;
            s.parse().map_err(|e| corrupt(table, format!("column {name}: {e}")))
        }

        fn preflight_from_row(row: &$row) -> Result<PreflightRecord> {
            let t = "preflight_reports";
            let id: i64 = col(row, t, "id")?;
            let class: String = col(row, t, "interconnect_class")?;
            Ok(PreflightRecord {
                report_id: report_id_from(id)?,
                agent_id: col(row, t, "agent_id")?,
                local_id: col(row, t, "local_id")?,
                level: word(row, t, "level")?,
                started_at_ms: col(row, t, "started_at_ms")?,
                finished_at_ms: col(row, t, "finished_at_ms")?,
                verdict: word(row, t, "verdict")?,
                interconnect_class: match class.as_str() {
                    "" => None,
                    _ => Some(word(row, t, "interconnect_class")?),
                },
                topology: col(row, t, "topology")?,
                driver_version: col(row, t, "driver_version")?,
                cuda_version: col(row, t, "cuda_version")?,
                nccl_version: col(row, t, "nccl_version")?,
                source: col(row, t, "source")?,
                checks: Vec::new(),
            })
        }

        /// A row of `preflight_checks` with the id of its report.
        fn check_from_row(row: &$row) -> Result<(u64, CheckRecord)> {
            let t = "preflight_checks";
            let report_id: i64 = col(row, t, "report_id")?;
            Ok((
                report_id_from(report_id)?,
                CheckRecord {
                    id: col(row, t, "check_id")?,
                    status: word(row, t, "status")?,
                    measured: col(row, t, "measured")?,
                    expected: col(row, t, "expected")?,
                    remedy: col(row, t, "remedy")?,
                },
            ))
        }

        /// Attaches checks (in order) to their reports.
        fn attach_checks(reports: &mut [PreflightRecord], checks: Vec<(u64, CheckRecord)>) {
            let mut by_report: std::collections::HashMap<u64, Vec<CheckRecord>> = Default::default();
            for (id, check) in checks {
                by_report.entry(id).or_default().push(check);
            }
            for report in reports {
                report.checks = by_report.remove(&report.report_id).unwrap_or_default();
            }
        }
    };
}
pub(super) use row_readers;

/// A diagnosis finding as the columns of `job_findings` (lists and evidence as JSON).
pub(super) struct FindingRow<'a> {
    pub cause: &'static str,
    pub summary: &'a str,
    pub nodes: String,
    pub ranks: String,
    pub evidence: String,
    pub remedy: &'a str,
}

pub(super) fn finding_rows(findings: &[trainyard_analysis::diagnose::Finding]) -> Vec<FindingRow<'_>> {
    findings
        .iter()
        .map(|f| FindingRow {
            cause: f.cause.as_str(),
            summary: &f.summary,
            nodes: serde_json::to_string(&f.nodes).unwrap_or_default(),
            ranks: serde_json::to_string(&f.ranks).unwrap_or_default(),
            evidence: serde_json::Value::Array(
                f.evidence
                    .iter()
                    .map(|m| serde_json::json!({"name": m.name, "value": m.value, "unit": m.unit}))
                    .collect(),
            )
            .to_string(),
            remedy: &f.remedy,
        })
        .collect()
}

/// The store methods of the diagnosis (step samples, stall progress, provenance, goodput facts,
/// recorded outcomes), written once for both backends: their SQL is the same on both (sqlx
/// binds `$N` placeholders on SQLite too), only the transaction mode differs. Expands inside
/// `impl ReceiptStore`, after `row_readers!`; `read` and `write` are the extra arguments each
/// backend's `run` takes (SQLite's `Mode`, nothing on PostgreSQL).
macro_rules! diagnosis_queries {
    ($store:ty, read: [$($read:tt)*], write: [$($write:tt)*]) => {
        impl $store {
    async fn q_step_samples(&self, job: JobId, attempt: u32) -> Result<Vec<trainyard_analysis::diagnose::StepSample>> {
        self.run("step_samples", $($read)* async |c| {
            let rows = sqlx::query(
                "SELECT rank, step, step_time_ms, fwd_bwd_ms, optimizer_ms, tokens_per_s, problem \
                 FROM receipts WHERE job_id = $1 AND attempt = $2 AND kind = 'step' ORDER BY rank, seq",
            )
            .bind(int(job)?)
            .bind(i64::from(attempt))
            .fetch_all(&mut *c)
            .await?;
            rows.iter().map(sample_from_row).collect()
        })
        .await
    }

    async fn q_step_progress(&self, job: JobId, attempt: u32) -> Result<trainyard_analysis::diagnose::stall::StepProgress> {
        self.run("step_progress", $($read)* async |c| {
            let rows = sqlx::query(
                "SELECT rank, max(step) AS step, max(stored_at_ms) AS at_ms FROM receipts \
                 WHERE job_id = $1 AND attempt = $2 AND kind = 'step' AND step IS NOT NULL GROUP BY rank",
            )
            .bind(int(job)?)
            .bind(i64::from(attempt))
            .fetch_all(&mut *c)
            .await?;
            let ranks = rows
                .iter()
                .map(|r| {
                    Ok((
                        num(r, "receipts", "rank")?,
                        col(r, "receipts", "step")?,
                        col(r, "receipts", "at_ms")?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            let recent_step_ms: Vec<Option<f64>> = sqlx::query_scalar(
                "SELECT step_time_ms FROM receipts WHERE job_id = $1 AND attempt = $2 AND kind = 'step' \
                 ORDER BY position DESC LIMIT 200",
            )
            .bind(int(job)?)
            .bind(i64::from(attempt))
            .fetch_all(&mut *c)
            .await?;
            Ok(trainyard_analysis::diagnose::stall::StepProgress {
                ranks,
                recent_step_ms: recent_step_ms.into_iter().flatten().collect(),
            })
        })
        .await
    }

    async fn q_first_receipt(&self, job: JobId, attempt: u32, kind: &str) -> Result<Option<String>> {
        self.run("first_receipt", $($read)* async |c| {
            Ok(sqlx::query_scalar(
                "SELECT body FROM receipts WHERE job_id = $1 AND attempt = $2 AND kind = $3 \
                 ORDER BY rank, seq LIMIT 1",
            )
            .bind(int(job)?)
            .bind(i64::from(attempt))
            .bind(kind.to_owned())
            .fetch_optional(&mut *c)
            .await?)
        })
        .await
    }

    async fn q_attempt_facts(
        &self,
        job: JobId,
        attempt: u32,
    ) -> Result<trainyard_analysis::diagnose::goodput::AttemptFacts> {
        self.run("attempt_facts", $($read)* async |c| {
            let t = "receipts";
            let mut facts = trainyard_analysis::diagnose::goodput::AttemptFacts { attempt, ..Default::default() };
            // The steps are summed where they lie: a long run has one row per step.
            let totals = sqlx::query(
                "SELECT count(*) AS steps, max(step) AS last_step, coalesce(sum(step_time_ms), 0.0) AS train_ms \
                 FROM receipts WHERE job_id = $1 AND attempt = $2 AND rank = 0 AND kind = 'step'",
            )
            .bind(int(job)?)
            .bind(i64::from(attempt))
            .fetch_one(&mut *c)
            .await?;
            facts.steps = num(&totals, t, "steps")?;
            facts.last_step = col(&totals, t, "last_step")?;
            facts.train_ms = col(&totals, t, "train_ms")?;
            let first = sqlx::query(
                "SELECT step, step_time_ms, stored_at_ms FROM receipts \
                 WHERE job_id = $1 AND attempt = $2 AND rank = 0 AND kind = 'step' ORDER BY seq LIMIT 1",
            )
            .bind(int(job)?)
            .bind(i64::from(attempt))
            .fetch_optional(&mut *c)
            .await?;
            if let Some(row) = first {
                facts.first_step = col(&row, t, "step")?;
                facts.first_step_ms = col::<Option<f64>>(&row, t, "step_time_ms")?.unwrap_or(0.0);
                facts.first_step_at_ms = Some(col(&row, t, "stored_at_ms")?);
            }
            let timed = sqlx::query(
                "SELECT kind, body FROM receipts WHERE job_id = $1 AND attempt = $2 AND rank = 0 \
                 AND kind IN ('eval', 'checkpoint') ORDER BY seq",
            )
            .bind(int(job)?)
            .bind(i64::from(attempt))
            .fetch_all(&mut *c)
            .await?;
            for row in &timed {
                facts.add_duration(&col::<String>(row, t, "kind")?, &col::<String>(row, t, "body")?);
            }
            Ok(facts)
        })
        .await
    }

    async fn q_record_outcome(
        &self,
        job: JobId,
        goodput: &trainyard_analysis::diagnose::goodput::Goodput,
        attempt: u32,
        findings: &[trainyard_analysis::diagnose::Finding],
        now_ms: i64,
    ) -> Result<()> {
        let findings = $crate::rows::finding_rows(findings);
        self.run("record_outcome", $($write)* async |c| {
            let id = int(job)?;
            sqlx::query("DELETE FROM attempt_goodput WHERE job_id = $1").bind(id).execute(&mut *c).await?;
            sqlx::query("DELETE FROM job_findings WHERE job_id = $1").bind(id).execute(&mut *c).await?;
            for a in &goodput.attempts {
                sqlx::query("INSERT INTO attempt_goodput (job_id, attempt, wall_ms, startup_ms, train_ms, eval_ms, checkpoint_ms, restart_ms, lost_ms, steps_redone, other_ms, recorded_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)")
                    .bind(id)
                    .bind(i64::from(a.attempt))
                    .bind(a.wall_ms)
                    .bind(a.startup_ms)
                    .bind(a.train_ms)
                    .bind(a.eval_ms)
                    .bind(a.checkpoint_ms)
                    .bind(a.restart_ms)
                    .bind(a.lost_ms)
                    .bind(int(a.steps_redone)?)
                    .bind(a.other_ms)
                    .bind(now_ms)
                    .execute(&mut *c)
                    .await?;
            }
            for (position, f) in findings.iter().enumerate() {
                sqlx::query("INSERT INTO job_findings (job_id, attempt, position, cause, summary, nodes, ranks, evidence, remedy, recorded_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)")
                    .bind(id)
                    .bind(i64::from(attempt))
                    .bind(position as i64)
                    .bind(f.cause)
                    .bind(f.summary)
                    .bind(&f.nodes)
                    .bind(&f.ranks)
                    .bind(&f.evidence)
                    .bind(f.remedy)
                    .bind(now_ms)
                    .execute(&mut *c)
                    .await?;
            }
            Ok(())
        })
        .await
    }

        }
    };
}
pub(super) use diagnosis_queries;

/// [`super::AuthStore`] for one backend: users, tokens and the audit log, in the same SQL on
/// both (`$N` placeholders). `read` and `write` as in [`diagnosis_queries!`].
macro_rules! auth_queries {
    ($store:ty, $row:ty, read: [$($read:tt)*], write: [$($write:tt)*]) => {

        fn user_from_row(row: &$row) -> Result<$crate::UserRecord> {
            let t = "users";
            Ok($crate::UserRecord {
                name: col(row, t, "name")?,
                admin: col(row, t, "admin")?,
                unix_user: col(row, t, "unix_user")?,
                created_at_ms: col(row, t, "created_at_ms")?,
                disabled_at_ms: col(row, t, "disabled_at_ms")?,
            })
        }

        fn token_from_row(row: &$row) -> Result<$crate::TokenRecord> {
            let t = "api_tokens";
            Ok($crate::TokenRecord {
                id: col(row, t, "id")?,
                user_name: col(row, t, "user_name")?,
                prefix: col(row, t, "prefix")?,
                created_at_ms: col(row, t, "created_at_ms")?,
                expires_at_ms: col(row, t, "expires_at_ms")?,
                revoked_at_ms: col(row, t, "revoked_at_ms")?,
            })
        }

        #[async_trait::async_trait]
        impl $crate::AuthStore for $store {
            async fn add_user(&self, user: &$crate::UserRecord) -> Result<()> {
                self.run("add_user", $($write)* async |c| {
                    sqlx::query("INSERT INTO users (name, admin, unix_user, created_at_ms, disabled_at_ms) VALUES ($1, $2, $3, $4, $5)")
                        .bind(&user.name)
                        .bind(user.admin)
                        .bind(&user.unix_user)
                        .bind(user.created_at_ms)
                        .bind(user.disabled_at_ms)
                        .execute(&mut *c)
                        .await
                        .map_err($crate::rows::duplicate_or)?;
                    Ok(())
                })
                .await
            }

            async fn update_user(&self, user: &$crate::UserRecord) -> Result<bool> {
                self.run("update_user", $($write)* async |c| {
                    let done = sqlx::query("UPDATE users SET admin = $2, unix_user = $3, disabled_at_ms = $4 WHERE name = $1")
                        .bind(&user.name)
                        .bind(user.admin)
                        .bind(&user.unix_user)
                        .bind(user.disabled_at_ms)
                        .execute(&mut *c)
                        .await?;
                    Ok(done.rows_affected() > 0)
                })
                .await
            }

            async fn get_user(&self, name: &str) -> Result<Option<$crate::UserRecord>> {
                self.run("get_user", $($read)* async |c| {
                    let row = sqlx::query("SELECT name, admin, unix_user, created_at_ms, disabled_at_ms FROM users WHERE name = $1")
                        .bind(name.to_owned())
                        .fetch_optional(&mut *c)
                        .await?;
                    row.as_ref().map(user_from_row).transpose()
                })
                .await
            }

            async fn list_users(&self) -> Result<Vec<$crate::UserRecord>> {
                self.run("list_users", $($read)* async |c| {
                    let rows = sqlx::query("SELECT name, admin, unix_user, created_at_ms, disabled_at_ms FROM users ORDER BY name")
                        .fetch_all(&mut *c)
                        .await?;
                    rows.iter().map(user_from_row).collect()
                })
                .await
            }

            async fn add_token(
                &self,
                user: &str,
                sha256_hex: &str,
                prefix: &str,
                now_ms: i64,
                expires_at_ms: Option<i64>,
            ) -> Result<i64> {
                self.run("add_token", $($write)* async |c| {
                    sqlx::query_scalar("INSERT INTO api_tokens (user_name, token_sha256, prefix, created_at_ms, expires_at_ms) VALUES ($1, $2, $3, $4, $5) RETURNING id")
                        .bind(user.to_owned())
                        .bind(sha256_hex.to_owned())
                        .bind(prefix.to_owned())
                        .bind(now_ms)
                        .bind(expires_at_ms)
                        .fetch_one(&mut *c)
                        .await
                        .map_err($crate::rows::duplicate_or)
                })
                .await
            }

            async fn revoke_tokens(&self, user: &str, prefix: Option<&str>, now_ms: i64) -> Result<u64> {
                self.run("revoke_tokens", $($write)* async |c| {
                    let done = sqlx::query("UPDATE api_tokens SET revoked_at_ms = $3 WHERE user_name = $1 AND revoked_at_ms IS NULL AND ($2 IS NULL OR prefix = $2)")
                        .bind(user.to_owned())
                        .bind(prefix.map(str::to_owned))
                        .bind(now_ms)
                        .execute(&mut *c)
                        .await?;
                    Ok(done.rows_affected())
                })
                .await
            }

            async fn tokens_of(&self, user: &str) -> Result<Vec<$crate::TokenRecord>> {
                self.run("tokens_of", $($read)* async |c| {
                    let rows = sqlx::query("SELECT id, user_name, prefix, created_at_ms, expires_at_ms, revoked_at_ms FROM api_tokens WHERE user_name = $1 ORDER BY id DESC")
                        .bind(user.to_owned())
                        .fetch_all(&mut *c)
                        .await?;
                    rows.iter().map(token_from_row).collect()
                })
                .await
            }

            async fn token_owner(
                &self,
                sha256_hex: &str,
            ) -> Result<Option<($crate::TokenRecord, $crate::UserRecord)>> {
                self.run("token_owner", $($read)* async |c| {
                    let row = sqlx::query(
                        "SELECT t.id, t.user_name, t.prefix, t.created_at_ms, t.expires_at_ms, t.revoked_at_ms, \
                         u.name, u.admin, u.unix_user, u.created_at_ms AS user_created_at_ms, u.disabled_at_ms \
                         FROM api_tokens t JOIN users u ON u.name = t.user_name WHERE t.token_sha256 = $1",
                    )
                    .bind(sha256_hex.to_owned())
                    .fetch_optional(&mut *c)
                    .await?;
                    let Some(row) = row else { return Ok(None) };
                    let user = $crate::UserRecord {
                        name: col(&row, "users", "name")?,
                        admin: col(&row, "users", "admin")?,
                        unix_user: col(&row, "users", "unix_user")?,
                        created_at_ms: col(&row, "users", "user_created_at_ms")?,
                        disabled_at_ms: col(&row, "users", "disabled_at_ms")?,
                    };
                    Ok(Some((token_from_row(&row)?, user)))
                })
                .await
            }

            async fn token_hashes(&self) -> Result<Vec<String>> {
                self.run("token_hashes", $($read)* async |c| {
                    let rows = sqlx::query("SELECT token_sha256 FROM api_tokens").fetch_all(&mut *c).await?;
                    rows.iter().map(|row| col(row, "api_tokens", "token_sha256")).collect()
                })
                .await
            }

            async fn audit(&self, entry: &$crate::AuditEntry) -> Result<()> {
                self.run("audit", $($write)* async |c| {
                    sqlx::query("INSERT INTO audit_log (at_ms, actor, action, target, outcome, detail) VALUES ($1, $2, $3, $4, $5, $6)")
                        .bind(entry.at_ms)
                        .bind(&entry.actor)
                        .bind(&entry.action)
                        .bind(&entry.target)
                        .bind(if entry.accepted { "accepted" } else { "refused" })
                        .bind(&entry.detail)
                        .execute(&mut *c)
                        .await?;
                    Ok(())
                })
                .await
            }

            async fn audit_log(&self, limit: u32) -> Result<Vec<$crate::AuditEntry>> {
                self.run("audit_log", $($read)* async |c| {
                    let rows = sqlx::query("SELECT at_ms, actor, action, target, outcome, detail FROM audit_log ORDER BY id DESC LIMIT $1")
                        .bind(i64::from(limit))
                        .fetch_all(&mut *c)
                        .await?;
                    rows.iter()
                        .map(|r| {
                            let t = "audit_log";
                            Ok($crate::AuditEntry {
                                at_ms: col(r, t, "at_ms")?,
                                actor: col(r, t, "actor")?,
                                action: col(r, t, "action")?,
                                target: col(r, t, "target")?,
                                accepted: col::<String>(r, t, "outcome")? == "accepted",
                                detail: col(r, t, "detail")?,
                            })
                        })
                        .collect()
                })
                .await
            }
        }
    };
}
pub(super) use auth_queries;

/// [`super::SeriesStore`] for one backend: the step rollups the web view's plots read
/// ([`crate::series`]), in the same SQL on both. `read` and `write` as in [`diagnosis_queries!`].
macro_rules! series_queries {
    ($store:ty, $row:ty, read: [$($read:tt)*], write: [$($write:tt)*]) => {
        fn rollup_from_row(row: &$row, level: i64) -> Result<trainyard_analysis::series::RollupRow> {
            let t = "step_rollups";
            let agg = |p: &str| -> Result<trainyard_analysis::series::Agg> {
                Ok(trainyard_analysis::series::Agg {
                    n: col(row, t, &format!("{p}_n"))?,
                    min: col::<Option<f64>>(row, t, &format!("{p}_min"))?.unwrap_or(0.0),
                    max: col::<Option<f64>>(row, t, &format!("{p}_max"))?.unwrap_or(0.0),
                    sum: col::<Option<f64>>(row, t, &format!("{p}_sum"))?.unwrap_or(0.0),
                })
            };
            Ok(trainyard_analysis::series::RollupRow {
                attempt: num(row, t, "attempt")?,
                level,
                rank: num(row, t, "rank")?,
                bucket: col(row, t, "bucket")?,
                aggs: [agg("step_ms")?, agg("loss")?, agg("tps")?, agg("mfu")?],
            })
        }

        #[async_trait::async_trait]
        impl $crate::SeriesStore for $store {
            async fn roll_up_steps(&self, job: JobId, settled_before_ms: i64, max_rows: u32) -> Result<u64> {
                use trainyard_analysis::series::{StepPoint, fold};
                let id = int(job)?;
                // Read outside the write lock (receipts keep arriving meanwhile), fold, then
                // merge and write in one short transaction that first moves the watermark from
                // where this fold read it. Folds may run at once (the page asks for four series,
                // the job's end folds, a controller group has several processes): the one that
                // finds the watermark moved wrote nothing and reads again from there, so every
                // receipt is counted once without a lock.
                loop {
                let (from, to, points, read) = self.run("roll_up_read", $($read)* async |c| {
                    let t = "receipts";
                    let wm: i64 = sqlx::query_scalar("SELECT position FROM step_rollup_progress WHERE job_id = $1")
                        .bind(id)
                        .fetch_optional(&mut *c)
                        .await?
                        .unwrap_or(0);
                    let rows = sqlx::query(
                        "SELECT position, kind, stored_at_ms, attempt, rank, step, step_time_ms, loss, tokens_per_s, mfu \
                         FROM receipts WHERE job_id = $1 AND position > $2 ORDER BY position LIMIT $3",
                    )
                    .bind(id)
                    .bind(wm)
                    .bind(i64::from(max_rows))
                    .fetch_all(&mut *c)
                    .await?;
                    let (mut last, mut read, mut points) = (wm, 0u64, Vec::new());
                    for r in &rows {
                        if col::<i64>(r, t, "stored_at_ms")? > settled_before_ms {
                            break;
                        }
                        last = col(r, t, "position")?;
                        read += 1;
                        let step: Option<i64> = col(r, t, "step")?;
                        if let (Some(step), "step") = (step, col::<String>(r, t, "kind")?.as_str()) {
                            points.push(StepPoint {
                                attempt: num(r, t, "attempt")?,
                                rank: num(r, t, "rank")?,
                                step,
                                values: [col(r, t, "step_time_ms")?, col(r, t, "loss")?, col(r, t, "tokens_per_s")?, col(r, t, "mfu")?],
                            });
                        }
                    }
                    Ok((wm, last, points, read))
                })
                .await?;
                if to == from {
                    return Ok(0);
                }
                let folded = fold(&points);
                let claimed = self.run("roll_up_write", $($write)* async |c| {
                    let moved = if from == 0 {
                        sqlx::query(
                            "INSERT INTO step_rollup_progress (job_id, position) VALUES ($1, $2) \
                             ON CONFLICT (job_id) DO NOTHING",
                        )
                        .bind(id)
                        .bind(to)
                        .execute(&mut *c)
                        .await?
                    } else {
                        sqlx::query("UPDATE step_rollup_progress SET position = $2 WHERE job_id = $1 AND position = $3")
                            .bind(id)
                            .bind(to)
                            .bind(from)
                            .execute(&mut *c)
                            .await?
                    };
                    if moved.rows_affected() == 0 {
                        return Ok(false);
                    }
                    // A retried transaction starts again from the fold.
                    let mut folded = folded.clone();
                    let mut groups: std::collections::BTreeMap<(u32, i64, u32), (i64, i64)> = Default::default();
                    for &(attempt, level, rank, bucket) in folded.keys() {
                        let g = groups.entry((attempt, level, rank)).or_insert((bucket, bucket));
                        (g.0, g.1) = (g.0.min(bucket), g.1.max(bucket));
                    }
                    for ((attempt, level, rank), (lo, hi)) in groups {
                        let rows = sqlx::query(
                            "SELECT attempt, rank, bucket, step_ms_n, step_ms_min, step_ms_max, step_ms_sum, loss_n, loss_min, loss_max, loss_sum, \
                             tps_n, tps_min, tps_max, tps_sum, mfu_n, mfu_min, mfu_max, mfu_sum FROM step_rollups \
                             WHERE job_id = $1 AND attempt = $2 AND level = $3 AND rank = $4 AND bucket BETWEEN $5 AND $6",
                        )
                        .bind(id)
                        .bind(i64::from(attempt))
                        .bind(level)
                        .bind(i64::from(rank))
                        .bind(lo)
                        .bind(hi)
                        .fetch_all(&mut *c)
                        .await?;
                        for row in &rows {
                            let old = rollup_from_row(row, level)?;
                            if let Some(new) = folded.get_mut(&(attempt, level, rank, old.bucket)) {
                                for (n, o) in new.iter_mut().zip(old.aggs.iter()) {
                                    n.merge(o);
                                }
                            }
                        }
                    }
                    for (&(attempt, level, rank, bucket), aggs) in &folded {
                        let mut q = sqlx::query(
                            "INSERT INTO step_rollups (job_id, attempt, level, rank, bucket, step_ms_n, step_ms_min, step_ms_max, step_ms_sum, \
                             loss_n, loss_min, loss_max, loss_sum, tps_n, tps_min, tps_max, tps_sum, mfu_n, mfu_min, mfu_max, mfu_sum) \
                             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21) \
                             ON CONFLICT (job_id, attempt, level, rank, bucket) DO UPDATE SET \
                             step_ms_n = excluded.step_ms_n, step_ms_min = excluded.step_ms_min, step_ms_max = excluded.step_ms_max, step_ms_sum = excluded.step_ms_sum, \
                             loss_n = excluded.loss_n, loss_min = excluded.loss_min, loss_max = excluded.loss_max, loss_sum = excluded.loss_sum, \
                             tps_n = excluded.tps_n, tps_min = excluded.tps_min, tps_max = excluded.tps_max, tps_sum = excluded.tps_sum, \
                             mfu_n = excluded.mfu_n, mfu_min = excluded.mfu_min, mfu_max = excluded.mfu_max, mfu_sum = excluded.mfu_sum",
                        )
                        .bind(id)
                        .bind(i64::from(attempt))
                        .bind(level)
                        .bind(i64::from(rank))
                        .bind(bucket);
                        for a in aggs {
                            let present = (a.n > 0).then_some(());
                            q = q.bind(a.n).bind(present.map(|_| a.min)).bind(present.map(|_| a.max)).bind(present.map(|_| a.sum));
                        }
                        q.execute(&mut *c).await?;
                    }
                    Ok(true)
                })
                .await?;
                if claimed {
                    return Ok(read);
                }
                }
            }

            async fn rollup_extent(&self, job: JobId, attempt: u32) -> Result<Option<(i64, i64, u32)>> {
                self.run("rollup_extent", $($read)* async |c| {
                    // The middle level: few rows, and its buckets bound the steps within 128.
                    let level = trainyard_analysis::series::LEVELS[1];
                    let row = sqlx::query(
                        "SELECT min(bucket) AS lo, max(bucket) AS hi, count(DISTINCT rank) AS ranks FROM step_rollups \
                         WHERE job_id = $1 AND attempt = $2 AND level = $3",
                    )
                    .bind(int(job)?)
                    .bind(i64::from(attempt))
                    .bind(level)
                    .fetch_one(&mut *c)
                    .await?;
                    let t = "step_rollups";
                    let (lo, hi): (Option<i64>, Option<i64>) = (col(&row, t, "lo")?, col(&row, t, "hi")?);
                    Ok(match (lo, hi) {
                        (Some(lo), Some(hi)) => Some((lo * level, hi * level + level - 1, num(&row, t, "ranks")?)),
                        _ => None,
                    })
                })
                .await
            }

            async fn rollup_rows(
                &self,
                job: JobId,
                attempt: u32,
                metric: trainyard_analysis::series::Metric,
                level: i64,
                from_bucket: i64,
                to_bucket: i64,
            ) -> Result<Vec<trainyard_analysis::series::RollupRow>> {
                use trainyard_analysis::series::Metric;
                // One metric's four columns, read by position: a plot of 64 ranks reads 50,000 rows.
                let sql = match metric {
                    Metric::StepMs => "SELECT attempt, rank, bucket, step_ms_n, step_ms_min, step_ms_max, step_ms_sum FROM step_rollups \
                        WHERE job_id = $1 AND attempt = $2 AND level = $3 AND bucket BETWEEN $4 AND $5",
                    Metric::Loss => "SELECT attempt, rank, bucket, loss_n, loss_min, loss_max, loss_sum FROM step_rollups \
                        WHERE job_id = $1 AND attempt = $2 AND level = $3 AND bucket BETWEEN $4 AND $5",
                    Metric::TokensPerS => "SELECT attempt, rank, bucket, tps_n, tps_min, tps_max, tps_sum FROM step_rollups \
                        WHERE job_id = $1 AND attempt = $2 AND level = $3 AND bucket BETWEEN $4 AND $5",
                    Metric::Mfu => "SELECT attempt, rank, bucket, mfu_n, mfu_min, mfu_max, mfu_sum FROM step_rollups \
                        WHERE job_id = $1 AND attempt = $2 AND level = $3 AND bucket BETWEEN $4 AND $5",
                };
                self.run("rollup_rows", $($read)* async |c| {
                    let rows = sqlx::query(sql)
                        .bind(int(job)?)
                        .bind(i64::from(attempt))
                        .bind(level)
                        .bind(from_bucket)
                        .bind(to_bucket)
                        .fetch_all(&mut *c)
                        .await?;
                    let t = "step_rollups";
                    rows.iter()
                        .map(|r| {
                            let at = |i: usize| -> Result<f64> {
                                let v: Option<f64> = r.try_get(i).map_err(|e| corrupt(t, format!("column {i}: {e}")))?;
                                Ok(v.unwrap_or(0.0))
                            };
                            let n: i64 = r.try_get(3).map_err(|e| corrupt(t, format!("column n: {e}")))?;
                            let mut aggs = [trainyard_analysis::series::Agg::default(); 4];
                            aggs[metric as usize] = trainyard_analysis::series::Agg { n, min: at(4)?, max: at(5)?, sum: at(6)? };
                            Ok(trainyard_analysis::series::RollupRow {
                                attempt: fit(r.try_get::<i64, _>(0).map_err(|e| corrupt(t, format!("attempt: {e}")))?, t, "attempt")?,
                                level,
                                rank: fit(r.try_get::<i64, _>(1).map_err(|e| corrupt(t, format!("rank: {e}")))?, t, "rank")?,
                                bucket: r.try_get(2).map_err(|e| corrupt(t, format!("bucket: {e}")))?,
                                aggs,
                            })
                        })
                        .collect()
                })
                .await
            }
        }
    };
}
pub(super) use series_queries;
