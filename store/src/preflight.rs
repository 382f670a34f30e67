//! [`PreflightStore`]: preflight reports and their checks.

use async_trait::async_trait;

use crate::rows::{self, report_id_from};
use crate::sql::{Conn, multi_row_insert};
use crate::{CheckRecord, PreflightRecord, PreflightStore, Result, SqlStore};

/// Columns bound per check row in [`insert_checks`].
const CHECK_PARAMS: usize = 7;

/// Largest multi-row insert of checks: a report has tens of checks, so one statement nearly
/// always holds them all; the bound keeps a pathological report under SQLite's parameter limit.
const MAX_CHECK_ROWS: usize = 1_024;

#[async_trait]
impl PreflightStore for SqlStore {
    async fn insert_preflight(&self, report: &PreflightRecord, now_ms: i64) -> Result<u64> {
        self.write("insert_preflight", async |c| {
            let stored = c
                .query("SELECT id FROM preflight_reports WHERE agent_id = $1 AND local_id = $2 AND local_id <> ''")
                .bind(report.agent_id.as_str())
                .bind(report.local_id.as_str())
                .optional()
                .await?;
            if let Some(row) = stored {
                return report_id_from(row.get("preflight_reports", "id")?);
            }
            let row = c
                .query(
                    "INSERT INTO preflight_reports (agent_id, local_id, level, started_at_ms, \
                     finished_at_ms, verdict, interconnect_class, driver_version, cuda_version, \
                     nccl_version, source, topology, received_at_ms, job_id, gpus) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15) RETURNING id",
                )
                .bind(report.agent_id.as_str())
                .bind(report.local_id.as_str())
                .bind(report.level.as_str())
                .bind(report.started_at_ms)
                .bind(report.finished_at_ms)
                .bind(report.verdict.as_str())
                .bind(report.interconnect_class.map_or("", |c| c.as_str()))
                .bind(report.driver_version.as_str())
                .bind(report.cuda_version.as_str())
                .bind(report.nccl_version.as_str())
                .bind(report.source.as_str())
                .bind(report.topology.as_str())
                .bind(now_ms)
                .bind(report.job_id.map(|id| id as i64))
                .bind(report.gpus.iter().map(u32::to_string).collect::<Vec<_>>().join(","))
                .one()
                .await?;
            let id: i64 = row.get("preflight_reports", "id")?;
            insert_checks(c, id, &report.checks).await?;
            report_id_from(id)
        })
        .await
    }

    async fn latest_preflight(&self, agent_id: &str) -> Result<Option<PreflightRecord>> {
        self.read("latest_preflight", async |c| {
            let newest = "(SELECT max(id) FROM preflight_reports WHERE agent_id = $1 AND job_id IS NULL)";
            let mut reports = fetch_preflights(c, newest, Some(agent_id)).await?;
            Ok(reports.pop())
        })
        .await
    }

    async fn latest_preflights(&self) -> Result<Vec<PreflightRecord>> {
        self.read("latest_preflights", async |c| {
            let newest = "(SELECT max(id) FROM preflight_reports WHERE job_id IS NULL GROUP BY agent_id)";
            fetch_preflights(c, newest, None).await
        })
        .await
    }
}

/// Writes the checks of report `report_id` in order, in as few statements as the parameter
/// limit allows.
async fn insert_checks(c: &mut Conn<'_>, report_id: i64, checks: &[CheckRecord]) -> Result<()> {
    let head = "preflight_checks (report_id, position, check_id, status, measured, expected, remedy)";
    for (chunk_no, chunk) in checks.chunks(MAX_CHECK_ROWS).enumerate() {
        let mut q = c.query(multi_row_insert(c.marks(), head, CHECK_PARAMS, chunk.len(), ""));
        for (i, check) in chunk.iter().enumerate() {
            q = q
                .bind(report_id)
                .bind((chunk_no * MAX_CHECK_ROWS + i) as i64)
                .bind(check.id.as_str())
                .bind(check.status.as_str())
                .bind(check.measured.as_str())
                .bind(check.expected.as_str())
                .bind(check.remedy.as_str());
        }
        q.execute().await?;
    }
    Ok(())
}

/// The reports whose id is in `ids` (a subquery taking `agent_id` as `$1`, or no parameter),
/// with their checks, ordered by agent id.
async fn fetch_preflights(
    c: &mut Conn<'_>,
    ids: &str,
    agent_id: Option<&str>,
) -> Result<Vec<PreflightRecord>> {
    let reports_sql = format!(
        "SELECT id, agent_id, local_id, level, started_at_ms, finished_at_ms, verdict, \
         interconnect_class, driver_version, cuda_version, nccl_version, source, topology, job_id, gpus \
         FROM preflight_reports WHERE id IN {ids} ORDER BY agent_id, id"
    );
    let checks_sql = format!(
        "SELECT report_id, check_id, status, measured, expected, remedy FROM preflight_checks \
         WHERE report_id IN {ids} ORDER BY report_id, position"
    );
    let mut reports_query = c.query(reports_sql);
    if let Some(agent_id) = agent_id {
        reports_query = reports_query.bind(agent_id);
    }
    let found = reports_query.all().await?;
    let mut reports: Vec<PreflightRecord> = found.iter().map(rows::preflight).collect::<Result<_>>()?;
    let mut checks_query = c.query(checks_sql);
    if let Some(agent_id) = agent_id {
        checks_query = checks_query.bind(agent_id);
    }
    let checks = checks_query.all().await?.iter().map(rows::check).collect::<Result<_>>()?;
    rows::attach_checks(&mut reports, checks);
    Ok(reports)
}
