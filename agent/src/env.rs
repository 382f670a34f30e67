//! The environment of a rank: torchrun's variables, trainyard's, and the job's overlay.
//!
//! The overlay comes from the job spec, so it is the one part a user controls: it cannot
//! override the variables the agent sets (a wrong `RANK` would hang a whole job in its first
//! collective), and `CUDA_VISIBLE_DEVICES` is never set, because every rank must see every GPU
//! of its host and pick `TRAINYARD_GPU` itself.

use std::collections::BTreeMap;
use std::path::Path;

use trainyard_proto::v1::{Launch, RankAssignment};

/// Variables the agent owns; overlay entries with these names are ignored.
pub use trainyard_proto::contract::RANK_ENV as RESERVED;

/// Local id (`<agent_id>-<started_at_ms>`) of the preflight report the rank was launched under;
/// set by the launcher, absent when the agent has run no preflight yet.
pub const PREFLIGHT_REPORT: &str = "TRAINYARD_PREFLIGHT_REPORT";

/// Never set for a rank, not even from the overlay.
pub const NEVER_SET: &str = "CUDA_VISIBLE_DEVICES";

/// A rank's environment on top of the agent's own, and the overlay names that were dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    pub vars: BTreeMap<String, String>,
    pub ignored_overlay: Vec<String>,
}

/// Builds the environment of `assignment` in `launch`; `receipts` is the absolute path of
/// the rank's receipts file.
pub fn rank_env(launch: &Launch, assignment: &RankAssignment, receipts: &Path) -> RankEnv {
    let mut vars = BTreeMap::new();
    let mut ignored_overlay = Vec::new();
    let overlay = launch.spec.as_ref().map(|s| &s.env);
    for (name, value) in overlay.into_iter().flatten() {
        if RESERVED.contains(&name.as_str()) || name == NEVER_SET {
            ignored_overlay.push(name.clone());
        } else {
            vars.insert(name.clone(), value.clone());
        }
    }
    ignored_overlay.sort();
    let ours = [
        ("RANK", assignment.rank.to_string()),
        ("LOCAL_RANK", assignment.local_rank.to_string()),
        ("WORLD_SIZE", launch.world_size.to_string()),
        ("LOCAL_WORLD_SIZE", launch.local_world_size.to_string()),
        ("NODE_RANK", launch.node_rank.to_string()),
        ("MASTER_ADDR", launch.master_addr.clone()),
        ("MASTER_PORT", launch.master_port.to_string()),
        ("TRAINYARD_JOB_ID", launch.job_id.to_string()),
        ("TRAINYARD_ATTEMPT", launch.attempt.to_string()),
        ("TRAINYARD_RECEIPTS", receipts.display().to_string()),
        ("TRAINYARD_GPU", assignment.gpu_index.to_string()),
        ("TRAINYARD_RESUME", if resumes(launch) { "1" } else { "0" }.to_string()),
    ];
    for (name, value) in ours {
        vars.insert(name.to_string(), value);
    }
    RankEnv { vars, ignored_overlay }
}

/// A restarted attempt of a job whose restart policy says resume continues from the last
/// checkpoint; the rank reads that from `TRAINYARD_RESUME`.
fn resumes(launch: &Launch) -> bool {
    launch.attempt > 0 && launch.spec.as_ref().and_then(|s| s.restart.as_ref()).is_some_and(|r| r.resume)
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainyard_proto::v1::JobSpec;

    fn launch() -> Launch {
        let env = [("RANK", "99"), ("FOO", "bar"), ("CUDA_VISIBLE_DEVICES", "0"), ("TRAINYARD_GPU", "5")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Launch {
            job_id: 12,
            attempt: 2,
            world_size: 16,
            node_rank: 1,
            local_world_size: 8,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            ranks: vec![],
            spec: Some(JobSpec { env, ..Default::default() }),
        }
    }

    #[test]
    fn sets_torchrun_and_trainyard_variables() {
        let a = RankAssignment { rank: 11, local_rank: 3, gpu_index: 6, ..Default::default() };
        let env = rank_env(&launch(), &a, Path::new("/d/receipts.jsonl"));
        let get = |k: &str| env.vars.get(k).map(String::as_str);
        assert_eq!(get("RANK"), Some("11"));
        assert_eq!(get("LOCAL_RANK"), Some("3"));
        assert_eq!(get("WORLD_SIZE"), Some("16"));
        assert_eq!(get("LOCAL_WORLD_SIZE"), Some("8"));
        assert_eq!(get("NODE_RANK"), Some("1"));
        assert_eq!(get("MASTER_ADDR"), Some("10.0.0.1"));
        assert_eq!(get("MASTER_PORT"), Some("29500"));
        assert_eq!(get("TRAINYARD_JOB_ID"), Some("12"));
        assert_eq!(get("TRAINYARD_ATTEMPT"), Some("2"));
        assert_eq!(get("TRAINYARD_RECEIPTS"), Some("/d/receipts.jsonl"));
        assert_eq!(get("TRAINYARD_GPU"), Some("6"));
        assert_eq!(get("TRAINYARD_RESUME"), Some("0"), "no restart policy: nothing to resume");
    }

    #[test]
    fn restarted_attempts_resume_when_the_policy_says_so() {
        let a = RankAssignment::default();
        let mut l = launch();
        let resume = |l: &Launch| rank_env(l, &a, Path::new("/r")).vars["TRAINYARD_RESUME"].clone();
        l.spec.as_mut().unwrap().restart =
            Some(trainyard_proto::v1::RestartPolicy { max_restarts: 3, resume: true });
        assert_eq!(resume(&l), "1");
        l.attempt = 0;
        assert_eq!(resume(&l), "0", "a first attempt has nothing to resume from");
        l.attempt = 1;
        l.spec.as_mut().unwrap().restart.as_mut().unwrap().resume = false;
        assert_eq!(resume(&l), "0");
    }

    #[test]
    fn overlay_cannot_override_ours_nor_set_cuda_visible_devices() {
        let a = RankAssignment { rank: 0, local_rank: 0, gpu_index: 0, ..Default::default() };
        let env = rank_env(&launch(), &a, Path::new("/r"));
        assert_eq!(env.vars.get("FOO").map(String::as_str), Some("bar"));
        assert_eq!(env.vars.get("RANK").map(String::as_str), Some("0"));
        assert_eq!(env.vars.get("TRAINYARD_GPU").map(String::as_str), Some("0"));
        assert!(!env.vars.contains_key(NEVER_SET));
        assert_eq!(env.ignored_overlay, vec!["CUDA_VISIBLE_DEVICES", "RANK", "TRAINYARD_GPU"]);
    }
}
