//! What a controller group keeps for the life of its database (`controller_secrets`), read or
//! created by the leader when it starts:
//!
//! - the cluster id, in every run directory's name (`job-<id>-<cluster>-<submitted ms>`), so
//!   that a job id a restored database or another controller repeats never meets an old job's
//!   files on a node;
//! - the key of the keyed hash that launch receipts carry instead of `[env]` values, so two runs
//!   still compare equal or not while nobody who reads receipts learns a value (a plain hash of
//!   `1` is `1` to anyone who tries);
//! - the key of the join tokens of `[slurm]` jobs: `tyj_<job>_<MAC>`, a keyed hash of the job id,
//!   which the agents of that job's allocation join with (docs/slurm.md). A token names one job
//!   and is good while that job has not ended; nothing is stored per token.

use hmac::{Hmac, Mac as _};
use sha2::Sha256;
use trainyard_store::{JobRecord, Store};

use super::Result;

/// The prefix of a hashed value in a stored launch receipt.
pub const ENV_HASH_PREFIX: &str = "hmac-sha256:";

/// The prefix of a `[slurm]` job's join token.
pub const JOIN_TOKEN_PREFIX: &str = "tyj_";

#[derive(Clone, Default)]
pub(super) struct Keys {
    cluster_id: String,
    env_hash_key: Vec<u8>,
    join_key: Vec<u8>,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keys").field("cluster_id", &self.cluster_id).finish_non_exhaustive()
    }
}

impl Keys {
    /// The group's keys, created on the first start of a database.
    pub(super) async fn load(store: &dyn Store, now_ms: i64) -> Result<Keys> {
        let cluster_id = store.secret("cluster_id", &random_hex(4)?, now_ms).await?;
        let key = store.secret("env_hash_key", &random_hex(32)?, now_ms).await?;
        let join = store.secret("join_key", &random_hex(32)?, now_ms).await?;
        Ok(Keys { cluster_id, env_hash_key: key.into_bytes(), join_key: join.into_bytes() })
    }

    pub(super) fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// The name of `job`'s run directory on its nodes ([`run_name`]).
    pub(super) fn run_name(&self, job: &JobRecord) -> String {
        run_name(&self.cluster_id, job)
    }

    /// The token the agents of `[slurm]` job `job` join with: `tyj_<job>_<64 hex digits>`.
    pub(super) fn join_token(&self, job: u64) -> String {
        format!("{JOIN_TOKEN_PREFIX}{job}_{}", self.join_mac(job))
    }

    /// The job a join token was made for; `None` for anything this group did not make.
    pub(super) fn join_job(&self, token: &str) -> Option<u64> {
        if self.join_key.is_empty() {
            return None; // a follower's, or keys not loaded: nothing is made or taken here
        }
        let (job, mac) = token.strip_prefix(JOIN_TOKEN_PREFIX)?.split_once('_')?;
        let job: u64 = job.parse().ok()?;
        let want = self.join_mac(job);
        // Compared in constant time: the MAC is the secret part.
        let same =
            want.len() == mac.len() && want.bytes().zip(mac.bytes()).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0;
        same.then_some(job)
    }

    fn join_mac(&self, job: u64) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.join_key).expect("HMAC takes a key of any size");
        mac.update(format!("trainyard join {} {job}", self.cluster_id).as_bytes());
        mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// `value` as launch receipts keep it: `hmac-sha256:` and 32 hex digits.
    pub(super) fn env_hash(&self, value: &str) -> String {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.env_hash_key).expect("HMAC takes a key of any size");
        mac.update(value.as_bytes());
        let digest = mac.finalize().into_bytes();
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        format!("{ENV_HASH_PREFIX}{hex}")
    }

    /// A launch receipt's body with the `env` value of each variable of the job's overlay
    /// (`overlay`, the names of its `[env]`; `None` when the job's spec is not at hand: every
    /// variable) replaced by its keyed hash (names kept, `null` for a variable the rank unset
    /// kept; trainyard's own variables, which a rank may record too, as they are); `None` when
    /// there is nothing to hash.
    pub(super) fn hash_launch_env<S: AsRef<str>>(&self, body: &str, overlay: Option<&[S]>) -> Option<String> {
        if overlay.is_some_and(<[S]>::is_empty) {
            return None;
        }
        let mut doc: serde_json::Value = serde_json::from_str(body).ok()?;
        let env = doc.get_mut("env")?.as_object_mut()?;
        let mut changed = false;
        for (name, value) in env.iter_mut() {
            if overlay.is_some_and(|o| !o.iter().any(|n| n.as_ref() == name)) {
                continue;
            }
            if let serde_json::Value::String(s) = value
                && !s.starts_with(ENV_HASH_PREFIX)
            {
                *value = serde_json::Value::String(self.env_hash(s));
                changed = true;
            }
        }
        changed.then(|| doc.to_string())
    }
}

/// The name of `job`'s run directory on its nodes, `job-<id>-<cluster id>-<submitted ms>`:
/// unique to this database's job, so a repeated job id never meets an old job's files.
pub(super) fn run_name(cluster_id: &str, job: &JobRecord) -> String {
    format!("job-{}-{cluster_id}-{}", job.id, job.created_at_ms)
}

fn random_hex(bytes: usize) -> Result<String> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf)
        .map_err(|e| super::ControllerError::Internal(format!("read random bytes: {e}")))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(key: &str) -> Keys {
        Keys {
            cluster_id: "c0ffee00".into(),
            env_hash_key: key.as_bytes().to_vec(),
            join_key: key.as_bytes().to_vec(),
        }
    }

    #[test]
    fn a_join_token_names_its_job_and_nothing_else_passes() {
        let k = keys("one key");
        let token = k.join_token(42);
        assert!(token.starts_with("tyj_42_") && token.len() == "tyj_42_".len() + 64, "{token}");
        assert_eq!(k.join_job(&token), Some(42));
        // Another job's number with this MAC, another group's key, a cut or altered MAC: refused.
        assert_eq!(k.join_job(&token.replacen("tyj_42_", "tyj_43_", 1)), None);
        assert_eq!(keys("another key").join_job(&token), None);
        assert_eq!(k.join_job(&token[..token.len() - 1]), None);
        let mut altered = token.clone().into_bytes();
        let last = altered.len() - 1;
        altered[last] = if altered[last] == b'0' { b'1' } else { b'0' };
        assert_eq!(k.join_job(&String::from_utf8(altered).unwrap()), None);
        for junk in ["", "tyj_", "tyj_x_00", "tyt_42_00", "tyj_42"] {
            assert_eq!(k.join_job(junk), None, "{junk:?}");
        }
    }

    #[test]
    fn env_values_become_keyed_hashes_that_compare() {
        let k = keys("one key");
        let overlay = ["HF_TOKEN", "N", "GONE"];
        let body = r#"{"kind":"launch","env":{"HF_TOKEN":"hf_secret","N":"1","GONE":null,"WORLD_SIZE":"8"}}"#;
        let hashed = k.hash_launch_env(body, Some(&overlay[..])).expect("hashed");
        assert!(!hashed.contains("hf_secret"), "{hashed}");
        let doc: serde_json::Value = serde_json::from_str(&hashed).unwrap();
        assert_eq!(doc["env"]["GONE"], serde_json::Value::Null);
        assert_eq!(doc["env"]["WORLD_SIZE"], "8", "trainyard's own variables stay readable");
        let one = doc["env"]["N"].as_str().unwrap();
        assert!(one.starts_with(ENV_HASH_PREFIX) && one.len() == ENV_HASH_PREFIX.len() + 32, "{one}");
        // Keyed: not the plain SHA-256 of "1", and another controller's key gives another hash.
        assert_ne!(one, keys("another key").env_hash("1"));
        assert_eq!(one, k.env_hash("1"), "the same value under one key compares equal");
        // Hashing again changes nothing; a receipt without env is left alone.
        assert_eq!(k.hash_launch_env(&hashed, Some(&overlay[..])), None);
        assert_eq!(k.hash_launch_env(r#"{"kind":"launch"}"#, Some(&overlay[..])), None);
        assert_eq!(
            k.hash_launch_env(body, Some(&[] as &[&str])),
            None,
            "a job without [env] has nothing to hide"
        );
        // A job whose spec is not at hand: every value is hashed.
        let all = k.hash_launch_env(body, None::<&[&str]>).expect("hashed");
        assert!(!all.contains("\"8\""), "{all}");
    }
}
