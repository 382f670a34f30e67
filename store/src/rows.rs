//! Rows to records and back: the column lists the readers expect, the protobuf columns, the
//! integer conversions, and one reader per record type.
//!
//! Every integer is read as `i64` (SQLite's `INTEGER`, PostgreSQL's `BIGINT`) and converted with
//! a range check, so a row that does not fit its Rust type is a [`StoreError::Corrupt`] naming
//! the table and column, never a panic or a silent wrap.

use std::collections::HashMap;

use prost::Message as _;
use trainyard_analysis::diagnose::StepSample;
use trainyard_model::domain::Inventory;
use trainyard_model::spec::{Engine, JobSpec};

use crate::corrupt;
use crate::sql::Row;
use crate::{
    AgentRecord, Allocation, CheckRecord, Cordon, FailureRecord, JobEventRecord, JobId, JobOwner, JobRecord,
    PreflightRecord, RankId, RankObserved, Result, StoreError, StoredReceiptRecord, TokenRecord, UserRecord,
};

/// Selected columns of `jobs`, read by [`job`].
pub(crate) const JOB_COLUMNS: &str =
    "id, state, reason, attempt, spec_pb, created_at_ms, updated_at_ms, submitted_by, run_as";

/// Selected columns of `allocations` (aliased `a`), read by [`allocation`].
pub(crate) const ALLOCATION_COLUMNS: &str = "a.job_id, a.attempt, a.rank, a.agent_id, a.gpu_index, a.node_rank, \
     a.local_rank, a.state, a.pid, a.exit_code, a.signal, a.message, a.skipped_lines, a.updated_at_ms, \
     a.planned_cpus, a.planned_mems, a.effective_cpus, a.effective_mems";

/// The plain engine columns of `jobs`: kind, argv as JSON, working directory.
pub(crate) fn engine_columns(spec: &JobSpec) -> (Option<&'static str>, Option<String>, Option<String>) {
    match &spec.engine {
        Engine::Exec { argv, workdir, .. } => {
            (Some("exec"), serde_json::to_string(argv).ok(), Some(workdir.clone()))
        }
        Engine::Builtin { .. } => (Some("builtin"), None, None),
    }
}

/// `jobs.spec_pb`: the spec in its wire encoding, which keeps old rows readable as fields are
/// added.
pub(crate) fn encode_spec(spec: &JobSpec) -> Vec<u8> {
    trainyard_proto::v1::JobSpec::from(spec).encode_to_vec()
}

fn decode_spec(bytes: &[u8]) -> Result<JobSpec> {
    let wire = trainyard_proto::v1::JobSpec::decode(bytes)
        .map_err(|e| corrupt("jobs", format!("column spec_pb: {e}")))?;
    JobSpec::try_from(wire).map_err(|e| corrupt("jobs", format!("column spec_pb: {e}")))
}

/// `agents.inventory_pb`, likewise.
pub(crate) fn encode_inventory(inv: &Inventory) -> Vec<u8> {
    trainyard_proto::v1::HostInventory::from(inv).encode_to_vec()
}

fn decode_inventory(bytes: &[u8]) -> Result<Inventory> {
    trainyard_proto::v1::HostInventory::decode(bytes)
        .map(Inventory::from)
        .map_err(|e| corrupt("agents", format!("column inventory_pb: {e}")))
}

/// Ids and counters are `u64` in Rust and 64-bit signed in SQL; values past `i64::MAX` cannot
/// be stored and are refused as an encode error.
pub(crate) fn int(v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|e| StoreError::Database(sqlx::Error::Encode(Box::new(e))))
}

pub(crate) fn job_id_from(v: i64) -> Result<JobId> {
    u64::try_from(v).map_err(|_| corrupt("jobs", format!("negative id {v}")))
}

pub(crate) fn report_id_from(v: i64) -> Result<u64> {
    u64::try_from(v).map_err(|_| corrupt("preflight_reports", format!("negative id {v}")))
}

/// A unique-key violation of either backend as [`StoreError::Duplicate`]; other errors as they are.
pub(crate) fn duplicate_or(e: sqlx::Error) -> StoreError {
    match &e {
        sqlx::Error::Database(db) if db.kind() == sqlx::error::ErrorKind::UniqueViolation => {
            StoreError::Duplicate(db.message().to_string())
        }
        _ => StoreError::Database(e),
    }
}

/// A row of [`JOB_COLUMNS`].
pub(crate) fn job(row: &Row) -> Result<JobRecord> {
    let t = "jobs";
    let spec_pb: Vec<u8> = row.get(t, "spec_pb")?;
    Ok(JobRecord {
        id: row.num(t, "id")?,
        spec: decode_spec(&spec_pb)?,
        owner: JobOwner { user: row.get(t, "submitted_by")?, run_as: row.get(t, "run_as")? },
        state: row.word(t, "state")?,
        reason: row.get(t, "reason")?,
        attempt: row.num(t, "attempt")?,
        created_at_ms: row.get(t, "created_at_ms")?,
        updated_at_ms: row.get(t, "updated_at_ms")?,
    })
}

pub(crate) fn event(row: &Row) -> Result<JobEventRecord> {
    let t = "job_events";
    let from: Option<String> = row.get(t, "from_state")?;
    Ok(JobEventRecord {
        job_id: row.num(t, "job_id")?,
        at_ms: row.get(t, "at_ms")?,
        from_state: match from {
            None => None,
            Some(_) => Some(row.word(t, "from_state")?),
        },
        to_state: row.word(t, "to_state")?,
        attempt: row.num(t, "attempt")?,
        reason: row.get(t, "reason")?,
    })
}

/// A row of [`ALLOCATION_COLUMNS`].
pub(crate) fn allocation(row: &Row) -> Result<Allocation> {
    let t = "allocations";
    Ok(Allocation {
        id: RankId {
            job_id: row.num(t, "job_id")?,
            attempt: row.num(t, "attempt")?,
            rank: row.num(t, "rank")?,
        },
        agent_id: row.get(t, "agent_id")?,
        gpu_index: row.num(t, "gpu_index")?,
        node_rank: row.num(t, "node_rank")?,
        local_rank: row.num(t, "local_rank")?,
        planned_cpus: row.get(t, "planned_cpus")?,
        planned_mems: row.get(t, "planned_mems")?,
        observed: RankObserved {
            state: row.word(t, "state")?,
            pid: row.opt_num(t, "pid")?,
            exit_code: row.opt_num(t, "exit_code")?,
            signal: row.opt_num(t, "signal")?,
            message: row.get(t, "message")?,
            skipped_lines: row.num(t, "skipped_lines")?,
            updated_at_ms: row.get(t, "updated_at_ms")?,
            effective_cpus: row.get(t, "effective_cpus")?,
            effective_mems: row.get(t, "effective_mems")?,
        },
    })
}

pub(crate) fn agent(row: &Row) -> Result<AgentRecord> {
    let t = "agents";
    let inventory_pb: Vec<u8> = row.get(t, "inventory_pb")?;
    Ok(AgentRecord {
        agent_id: row.get(t, "agent_id")?,
        address: row.get(t, "address")?,
        agent_version: row.get(t, "agent_version")?,
        inventory: decode_inventory(&inventory_pb)?,
        state: row.word(t, "state")?,
        last_seen_ms: row.get(t, "last_seen_ms")?,
        cordon: match row.get::<Option<String>>(t, "cordon_by")? {
            None => None,
            Some(by) => Some(Cordon {
                by,
                reason: row.get::<Option<String>>(t, "cordon_reason")?.unwrap_or_default(),
                at_ms: row.get::<Option<i64>>(t, "cordoned_at_ms")?.unwrap_or_default(),
            }),
        },
    })
}

pub(crate) fn failure(row: &Row) -> Result<FailureRecord> {
    let t = "failures";
    Ok(FailureRecord {
        job_id: row.num(t, "job_id")?,
        attempt: row.num(t, "attempt")?,
        at_ms: row.get(t, "at_ms")?,
        kind: row.word(t, "kind")?,
        agent_id: row.get(t, "agent_id")?,
        rank: row.opt_num(t, "rank")?,
        evidence: row.get(t, "evidence")?,
        blamed: row.get(t, "blamed")?,
        charged: row.get(t, "charged")?,
    })
}

pub(crate) fn step_sample(row: &Row) -> Result<StepSample> {
    let t = "receipts";
    Ok(StepSample {
        rank: row.num(t, "rank")?,
        step: row.get::<Option<i64>>(t, "step")?.unwrap_or(-1),
        step_time_ms: row.get(t, "step_time_ms")?,
        fwd_bwd_ms: row.get(t, "fwd_bwd_ms")?,
        optimizer_ms: row.get(t, "optimizer_ms")?,
        tokens_per_s: row.get(t, "tokens_per_s")?,
        flagged: row.get::<Option<String>>(t, "problem")?.is_some(),
    })
}

pub(crate) fn receipt(row: &Row) -> Result<StoredReceiptRecord> {
    let t = "receipts";
    Ok(StoredReceiptRecord {
        position: row.num(t, "position")?,
        id: RankId {
            job_id: row.num(t, "job_id")?,
            attempt: row.num(t, "attempt")?,
            rank: row.num(t, "rank")?,
        },
        seq: row.num(t, "seq")?,
        kind: row.get(t, "kind")?,
        step: row.get(t, "step")?,
        body: row.get(t, "body")?,
    })
}

/// A row of `preflight_reports`, without its checks.
pub(crate) fn preflight(row: &Row) -> Result<PreflightRecord> {
    let t = "preflight_reports";
    let class: String = row.get(t, "interconnect_class")?;
    Ok(PreflightRecord {
        report_id: report_id_from(row.get(t, "id")?)?,
        agent_id: row.get(t, "agent_id")?,
        local_id: row.get(t, "local_id")?,
        level: row.word(t, "level")?,
        started_at_ms: row.get(t, "started_at_ms")?,
        finished_at_ms: row.get(t, "finished_at_ms")?,
        verdict: row.word(t, "verdict")?,
        interconnect_class: match class.as_str() {
            "" => None,
            _ => Some(row.word(t, "interconnect_class")?),
        },
        topology: row.get(t, "topology")?,
        driver_version: row.get(t, "driver_version")?,
        cuda_version: row.get(t, "cuda_version")?,
        nccl_version: row.get(t, "nccl_version")?,
        source: row.get(t, "source")?,
        checks: Vec::new(),
        job_id: row.get::<Option<i64>>(t, "job_id")?.map(report_id_from).transpose()?,
        gpus: gpu_list(t, &row.get::<String>(t, "gpus")?)?,
    })
}

/// A comma-separated list of GPU indices ('' for none).
fn gpu_list(table: &'static str, text: &str) -> Result<Vec<u32>> {
    text.split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| corrupt(table, format!("GPU index {s:?} in {text:?}"))))
        .collect()
}

/// A row of `preflight_checks` with the id of its report.
pub(crate) fn check(row: &Row) -> Result<(u64, CheckRecord)> {
    let t = "preflight_checks";
    Ok((
        report_id_from(row.get(t, "report_id")?)?,
        CheckRecord {
            id: row.get(t, "check_id")?,
            status: row.word(t, "status")?,
            measured: row.get(t, "measured")?,
            expected: row.get(t, "expected")?,
            remedy: row.get(t, "remedy")?,
        },
    ))
}

/// Attaches checks (in order) to their reports.
pub(crate) fn attach_checks(reports: &mut [PreflightRecord], checks: Vec<(u64, CheckRecord)>) {
    let mut by_report: HashMap<u64, Vec<CheckRecord>> = HashMap::new();
    for (id, check) in checks {
        by_report.entry(id).or_default().push(check);
    }
    for report in reports {
        report.checks = by_report.remove(&report.report_id).unwrap_or_default();
    }
}

/// A row of `users`; `created` names its creation column (aliased where `users` is joined).
pub(crate) fn user(row: &Row, created: &str) -> Result<UserRecord> {
    let t = "users";
    Ok(UserRecord {
        name: row.get(t, "name")?,
        admin: row.get(t, "admin")?,
        unix_user: row.get(t, "unix_user")?,
        created_at_ms: row.get(t, created)?,
        disabled_at_ms: row.get(t, "disabled_at_ms")?,
    })
}

pub(crate) fn token(row: &Row) -> Result<TokenRecord> {
    let t = "api_tokens";
    Ok(TokenRecord {
        id: row.get(t, "id")?,
        user_name: row.get(t, "user_name")?,
        prefix: row.get(t, "prefix")?,
        created_at_ms: row.get(t, "created_at_ms")?,
        expires_at_ms: row.get(t, "expires_at_ms")?,
        revoked_at_ms: row.get(t, "revoked_at_ms")?,
    })
}
