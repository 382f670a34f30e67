//! [`TelemetryStore`]: GPU telemetry windows (`gpu_samples`) and the live diagnosis's findings
//! (`live_findings`), written once for both databases.

use async_trait::async_trait;

use crate::jobs::FAILURE_COLUMNS;
use crate::rows::int;
use crate::sql::{Conn, Row};
use crate::{FailureRecord, GpuWindowRecord, JobId, LiveFinding, Result, SqlStore, TelemetryStore, corrupt};

const WINDOW_COLUMNS: &str = "id, agent_id, gpu, uuid, start_ms, end_ms, samples, sm_clock_min, sm_clock_mean, \
    sm_clock_max, sm_clock_limit, mem_clock_mean, power_mean, power_max, power_limit, gpu_temp_mean, gpu_temp_max, \
    mem_temp_max, util_mean, mem_used_max, clock_reasons, pcie_gen, pcie_gen_max, pcie_width, pcie_width_max, \
    pcie_replays, nvlinks_up, nvlinks_total, nvlink_crc_errors, nvlink_replay_errors, nvlink_recovery_errors, \
    ecc_corrected, ecc_uncorrected, remap_pending, remap_failed, xids, nvlink_detail, job_id, attempt, rank, first_step, last_step";

const FINDING_COLUMNS: &str = "id, job_id, attempt, cause, subject, nodes, ranks, summary, evidence, remedy, \
    first_step, last_step, opened_at_ms, updated_at_ms, closed_at_ms, alerted_open_ms, alerted_close_ms";

fn count(v: u64) -> Result<i64> {
    int(v)
}

async fn insert_window(c: &mut Conn<'_>, w: &GpuWindowRecord) -> Result<u64> {
    let xids = w.xids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let columns = WINDOW_COLUMNS.trim_start_matches("id, ");
    let sql = format!(
        "INSERT INTO gpu_samples ({columns}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, \
         $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, $30, $31, $32, $33, $34, $35, \
         $36, $37, $38, $39, $40, $41) ON CONFLICT (agent_id, gpu, start_ms) DO NOTHING"
    );
    let n = c
        .query(sql)
        .bind(w.agent_id.as_str())
        .bind(i64::from(w.gpu))
        .bind(w.uuid.as_str())
        .bind(w.start_ms)
        .bind(w.end_ms)
        .bind(i64::from(w.samples))
        .bind(w.sm_clock_min)
        .bind(w.sm_clock_mean)
        .bind(w.sm_clock_max)
        .bind(w.sm_clock_limit)
        .bind(w.mem_clock_mean)
        .bind(w.power_mean)
        .bind(w.power_max)
        .bind(w.power_limit)
        .bind(w.gpu_temp_mean)
        .bind(w.gpu_temp_max)
        .bind(w.mem_temp_max)
        .bind(w.util_mean)
        .bind(w.mem_used_max)
        .bind(count(w.clock_reasons)?)
        .bind(i64::from(w.pcie_gen))
        .bind(i64::from(w.pcie_gen_max))
        .bind(i64::from(w.pcie_width))
        .bind(i64::from(w.pcie_width_max))
        .bind(count(w.pcie_replays)?)
        .bind(i64::from(w.nvlinks_up))
        .bind(i64::from(w.nvlinks_total))
        .bind(count(w.nvlink_crc_errors)?)
        .bind(count(w.nvlink_replay_errors)?)
        .bind(count(w.nvlink_recovery_errors)?)
        .bind(count(w.ecc_corrected)?)
        .bind(count(w.ecc_uncorrected)?)
        .bind(w.remap_pending)
        .bind(w.remap_failed)
        .bind(xids)
        .bind(w.nvlink_detail.as_str())
        .bind(w.job_id.map(int).transpose()?)
        .bind(w.attempt.map(i64::from))
        .bind(w.rank.map(i64::from))
        .bind(w.first_step)
        .bind(w.last_step)
        .execute()
        .await?;
    Ok(n)
}

/// (id, window) of a `gpu_samples` row.
fn window(row: &Row) -> Result<(u64, GpuWindowRecord)> {
    let t = "gpu_samples";
    let xids: String = row.get(t, "xids")?;
    let xids = xids
        .split(',')
        .filter(|x| !x.is_empty())
        .map(|x| x.parse().map_err(|_| corrupt(t, format!("column xids: {x:?} is not an XID"))))
        .collect::<Result<Vec<u32>>>()?;
    let w = GpuWindowRecord {
        agent_id: row.get(t, "agent_id")?,
        gpu: row.num(t, "gpu")?,
        uuid: row.get(t, "uuid")?,
        start_ms: row.get(t, "start_ms")?,
        end_ms: row.get(t, "end_ms")?,
        samples: row.num(t, "samples")?,
        sm_clock_min: row.get(t, "sm_clock_min")?,
        sm_clock_mean: row.get(t, "sm_clock_mean")?,
        sm_clock_max: row.get(t, "sm_clock_max")?,
        sm_clock_limit: row.get(t, "sm_clock_limit")?,
        mem_clock_mean: row.get(t, "mem_clock_mean")?,
        power_mean: row.get(t, "power_mean")?,
        power_max: row.get(t, "power_max")?,
        power_limit: row.get(t, "power_limit")?,
        gpu_temp_mean: row.get(t, "gpu_temp_mean")?,
        gpu_temp_max: row.get(t, "gpu_temp_max")?,
        mem_temp_max: row.get(t, "mem_temp_max")?,
        util_mean: row.get(t, "util_mean")?,
        mem_used_max: row.get(t, "mem_used_max")?,
        clock_reasons: row.num(t, "clock_reasons")?,
        pcie_gen: row.num(t, "pcie_gen")?,
        pcie_gen_max: row.num(t, "pcie_gen_max")?,
        pcie_width: row.num(t, "pcie_width")?,
        pcie_width_max: row.num(t, "pcie_width_max")?,
        pcie_replays: row.num(t, "pcie_replays")?,
        nvlinks_up: row.num(t, "nvlinks_up")?,
        nvlinks_total: row.num(t, "nvlinks_total")?,
        nvlink_crc_errors: row.num(t, "nvlink_crc_errors")?,
        nvlink_replay_errors: row.num(t, "nvlink_replay_errors")?,
        nvlink_recovery_errors: row.num(t, "nvlink_recovery_errors")?,
        ecc_corrected: row.num(t, "ecc_corrected")?,
        ecc_uncorrected: row.num(t, "ecc_uncorrected")?,
        remap_pending: row.get(t, "remap_pending")?,
        remap_failed: row.get(t, "remap_failed")?,
        xids,
        nvlink_detail: row.get(t, "nvlink_detail")?,
        job_id: row.opt_num(t, "job_id")?,
        attempt: row.opt_num(t, "attempt")?,
        rank: row.opt_num(t, "rank")?,
        first_step: row.get(t, "first_step")?,
        last_step: row.get(t, "last_step")?,
    };
    Ok((row.num(t, "id")?, w))
}

fn finding(row: &Row) -> Result<LiveFinding> {
    let t = "live_findings";
    let nodes: String = row.get(t, "nodes")?;
    let ranks: String = row.get(t, "ranks")?;
    let ranks = ranks
        .split(',')
        .filter(|r| !r.is_empty())
        .map(|r| r.parse().map_err(|_| corrupt(t, format!("column ranks: {r:?} is not a rank"))))
        .collect::<Result<Vec<u32>>>()?;
    Ok(LiveFinding {
        id: row.num(t, "id")?,
        job_id: row.num(t, "job_id")?,
        attempt: row.num(t, "attempt")?,
        cause: row.get(t, "cause")?,
        subject: row.get(t, "subject")?,
        nodes: nodes.split(',').filter(|n| !n.is_empty()).map(str::to_string).collect(),
        ranks,
        summary: row.get(t, "summary")?,
        evidence: row.get(t, "evidence")?,
        remedy: row.get(t, "remedy")?,
        first_step: row.get(t, "first_step")?,
        last_step: row.get(t, "last_step")?,
        opened_at_ms: row.get(t, "opened_at_ms")?,
        updated_at_ms: row.get(t, "updated_at_ms")?,
        closed_at_ms: row.get(t, "closed_at_ms")?,
        alerted_open_ms: row.get(t, "alerted_open_ms")?,
        alerted_close_ms: row.get(t, "alerted_close_ms")?,
    })
}

fn joined<T: ToString>(items: &[T]) -> String {
    items.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
}

#[async_trait]
impl TelemetryStore for SqlStore {
    async fn insert_gpu_windows(&self, windows: &[GpuWindowRecord]) -> Result<u64> {
        if windows.is_empty() {
            return Ok(0);
        }
        self.write("insert_gpu_windows", async |c| {
            let mut stored = 0;
            for w in windows {
                stored += insert_window(c, w).await?;
            }
            Ok(stored)
        })
        .await
    }

    async fn job_gpu_windows_after(
        &self,
        job: JobId,
        after_id: u64,
        limit: u32,
    ) -> Result<Vec<(u64, GpuWindowRecord)>> {
        self.read("job_gpu_windows_after", async |c| {
            let sql = format!(
                "SELECT {WINDOW_COLUMNS} FROM gpu_samples WHERE job_id = $1 AND id > $2 ORDER BY id LIMIT $3"
            );
            let found =
                c.query(sql).bind(int(job)?).bind(int(after_id)?).bind(i64::from(limit)).all().await?;
            found.iter().map(window).collect()
        })
        .await
    }

    async fn attempt_gpu_windows(
        &self,
        job: JobId,
        attempt: u32,
        limit: u32,
    ) -> Result<Vec<GpuWindowRecord>> {
        self.read("attempt_gpu_windows", async |c| {
            let sql = format!(
                "SELECT {WINDOW_COLUMNS} FROM gpu_samples WHERE job_id = $1 AND attempt = $2 \
                 ORDER BY start_ms, agent_id, gpu LIMIT $3"
            );
            let found =
                c.query(sql).bind(int(job)?).bind(i64::from(attempt)).bind(i64::from(limit)).all().await?;
            found.iter().map(|r| window(r).map(|(_, w)| w)).collect()
        })
        .await
    }

    async fn node_gpu_windows(&self, agent: &str, since_ms: i64, limit: u32) -> Result<Vec<GpuWindowRecord>> {
        self.read("node_gpu_windows", async |c| {
            let sql = format!(
                "SELECT {WINDOW_COLUMNS} FROM gpu_samples WHERE agent_id = $1 AND start_ms >= $2 \
                 ORDER BY start_ms, gpu LIMIT $3"
            );
            let found = c.query(sql).bind(agent).bind(since_ms).bind(i64::from(limit)).all().await?;
            found.iter().map(|r| window(r).map(|(_, w)| w)).collect()
        })
        .await
    }

    async fn prune_gpu_windows(&self, before_ms: i64) -> Result<u64> {
        self.write("prune_gpu_windows", async |c| {
            Ok(c.query("DELETE FROM gpu_samples WHERE end_ms < $1").bind(before_ms).execute().await?)
        })
        .await
    }

    async fn upsert_live_finding(&self, f: &LiveFinding) -> Result<LiveFinding> {
        self.write("upsert_live_finding", async |c| {
            let open = c
                .query(
                    "SELECT id FROM live_findings WHERE job_id = $1 AND cause = $2 AND subject = $3 \
                     AND closed_at_ms IS NULL",
                )
                .bind(int(f.job_id)?)
                .bind(f.cause.as_str())
                .bind(f.subject.as_str())
                .optional()
                .await?;
            let id: i64 = match open {
                Some(row) => {
                    let id: i64 = row.get("live_findings", "id")?;
                    c.query(
                        "UPDATE live_findings SET nodes = $1, ranks = $2, summary = $3, evidence = $4, \
                         remedy = $5, updated_at_ms = $6, last_step = COALESCE($7, last_step) WHERE id = $8",
                    )
                    .bind(joined(&f.nodes))
                    .bind(joined(&f.ranks))
                    .bind(f.summary.as_str())
                    .bind(f.evidence.as_str())
                    .bind(f.remedy.as_str())
                    .bind(f.updated_at_ms)
                    .bind(f.last_step)
                    .bind(id)
                    .execute()
                    .await?;
                    id
                }
                None => {
                    let row = c
                        .query(
                            "INSERT INTO live_findings (job_id, attempt, cause, subject, nodes, ranks, summary, \
                             evidence, remedy, opened_at_ms, updated_at_ms, first_step, last_step) \
                             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) RETURNING id",
                        )
                        .bind(int(f.job_id)?)
                        .bind(i64::from(f.attempt))
                        .bind(f.cause.as_str())
                        .bind(f.subject.as_str())
                        .bind(joined(&f.nodes))
                        .bind(joined(&f.ranks))
                        .bind(f.summary.as_str())
                        .bind(f.evidence.as_str())
                        .bind(f.remedy.as_str())
                        .bind(f.opened_at_ms)
                        .bind(f.updated_at_ms)
                        .bind(f.first_step)
                        .bind(f.last_step)
                        .one()
                        .await?;
                    row.get("live_findings", "id")?
                }
            };
            let sql = format!("SELECT {FINDING_COLUMNS} FROM live_findings WHERE id = $1");
            finding(&c.query(sql).bind(id).one().await?)
        })
        .await
    }

    async fn close_live_finding(&self, id: u64, at_ms: i64) -> Result<()> {
        self.write("close_live_finding", async |c| {
            c.query("UPDATE live_findings SET closed_at_ms = $1 WHERE id = $2 AND closed_at_ms IS NULL")
                .bind(at_ms)
                .bind(int(id)?)
                .execute()
                .await?;
            Ok(())
        })
        .await
    }

    async fn live_findings(&self, job: JobId, after_id: u64) -> Result<Vec<LiveFinding>> {
        self.read("live_findings", async |c| {
            let sql = format!(
                "SELECT {FINDING_COLUMNS} FROM live_findings WHERE job_id = $1 AND id > $2 ORDER BY id"
            );
            let found = c.query(sql).bind(int(job)?).bind(int(after_id)?).all().await?;
            found.iter().map(finding).collect()
        })
        .await
    }

    async fn open_live_findings(&self) -> Result<Vec<LiveFinding>> {
        self.read("open_live_findings", async |c| {
            let sql =
                format!("SELECT {FINDING_COLUMNS} FROM live_findings WHERE closed_at_ms IS NULL ORDER BY id");
            let found = c.query(sql).all().await?;
            found.iter().map(finding).collect()
        })
        .await
    }

    async fn unalerted_findings(&self, limit: u32) -> Result<Vec<LiveFinding>> {
        self.read("unalerted_findings", async |c| {
            let sql = format!(
                "SELECT {FINDING_COLUMNS} FROM live_findings WHERE alerted_open_ms IS NULL \
                 OR (closed_at_ms IS NOT NULL AND alerted_close_ms IS NULL) ORDER BY id LIMIT $1"
            );
            let found = c.query(sql).bind(i64::from(limit)).all().await?;
            found.iter().map(finding).collect()
        })
        .await
    }

    async fn mark_alerted(&self, id: u64, opening: bool, at_ms: i64) -> Result<()> {
        self.write("mark_alerted", async |c| {
            let sql = if opening {
                "UPDATE live_findings SET alerted_open_ms = $1 WHERE id = $2"
            } else {
                "UPDATE live_findings SET alerted_close_ms = $1 WHERE id = $2"
            };
            c.query(sql).bind(at_ms).bind(int(id)?).execute().await?;
            Ok(())
        })
        .await
    }

    async fn blame_failure_on_xid(
        &self,
        job: JobId,
        attempt: u32,
        agent: &str,
        since_ms: i64,
        evidence: &str,
    ) -> Result<Option<FailureRecord>> {
        self.write("blame_failure_on_xid", async |c| {
            let found = c
                .query(
                    "SELECT id FROM failures WHERE job_id = $1 AND attempt = $2 AND agent_id = $3 \
                     AND kind = 'rank_exit' AND at_ms >= $4 ORDER BY id DESC LIMIT 1",
                )
                .bind(int(job)?)
                .bind(i64::from(attempt))
                .bind(agent)
                .bind(since_ms)
                .optional()
                .await?;
            let Some(row) = found else { return Ok(None) };
            let id: i64 = row.get("failures", "id")?;
            c.query(
                "UPDATE failures SET kind = 'gpu_xid', blamed = $1, charged = $2, \
                 evidence = evidence || '; ' || $3 WHERE id = $4",
            )
            .bind(true)
            .bind(false)
            .bind(evidence)
            .bind(id)
            .execute()
            .await?;
            let sql = format!("SELECT {FAILURE_COLUMNS} FROM failures WHERE id = $1");
            Ok(Some(crate::rows::failure(&c.query(sql).bind(id).one().await?)?))
        })
        .await
    }
}
