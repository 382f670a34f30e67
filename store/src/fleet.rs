//! [`FleetStore`]: the agents and their GPUs, and the start-up snapshot.

use async_trait::async_trait;

use crate::rows::{self, ALLOCATION_COLUMNS, JOB_COLUMNS, encode_inventory, int};
use crate::sql::{multi_row_insert, placeholders};
use crate::{AgentRecord, AgentState, Cordon, FleetStore, Result, Snapshot, SqlStore};

/// Columns bound per row of `gpus`.
const GPU_PARAMS: usize = 7;

/// Agents whose heartbeat time one statement moves: 2 values each, far under both databases'
/// parameter limits.
const AGENTS_PER_TOUCH: usize = 1_000;

#[async_trait]
impl FleetStore for SqlStore {
    async fn upsert_agent(&self, agent: &AgentRecord) -> Result<()> {
        self.write("upsert_agent", async |c| {
            let inv = &agent.inventory;
            c.query(
                "INSERT INTO agents (agent_id, hostname, address, agent_version, state, \
                 gpu_count, inventory_pb, first_seen_ms, last_seen_ms) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8) \
                 ON CONFLICT (agent_id) DO UPDATE SET hostname = excluded.hostname, \
                 address = excluded.address, agent_version = excluded.agent_version, \
                 state = excluded.state, gpu_count = excluded.gpu_count, \
                 inventory_pb = excluded.inventory_pb, last_seen_ms = excluded.last_seen_ms",
            )
            .bind(agent.agent_id.as_str())
            .bind(inv.hostname.as_str())
            .bind(agent.address.as_str())
            .bind(agent.agent_version.as_str())
            .bind(agent.state.as_str())
            .bind(inv.gpus.len() as i64)
            .bind(encode_inventory(inv))
            .bind(agent.last_seen_ms)
            .execute()
            .await?;
            c.query("DELETE FROM gpus WHERE agent_id = $1").bind(agent.agent_id.as_str()).execute().await?;
            if inv.gpus.is_empty() {
                return Ok(());
            }
            let head = "gpus (agent_id, gpu_index, uuid, model, memory_mib, pci_bus_id, numa_node)";
            let mut q = c.query(multi_row_insert(c.marks(), head, GPU_PARAMS, inv.gpus.len(), ""));
            for gpu in &inv.gpus {
                q = q
                    .bind(agent.agent_id.as_str())
                    .bind(i64::from(gpu.index))
                    .bind(gpu.uuid.as_str())
                    .bind(gpu.model.as_str())
                    .bind(int(gpu.memory_mib)?)
                    .bind(gpu.pci_bus_id.as_str())
                    .bind(gpu.numa_node.map_or(-1, i64::from));
            }
            q.execute().await?;
            Ok(())
        })
        .await
    }

    async fn set_cordon(&self, agent_id: &str, cordon: Option<&Cordon>) -> Result<bool> {
        self.write("set_cordon", async |c| {
            let done = c
                .query(
                    "UPDATE agents SET cordon_by = $1, cordon_reason = $2, cordoned_at_ms = $3 \
                     WHERE agent_id = $4",
                )
                .bind(cordon.map(|k| k.by.as_str()))
                .bind(cordon.map(|k| k.reason.as_str()))
                .bind(cordon.map(|k| k.at_ms))
                .bind(agent_id)
                .execute()
                .await?;
            Ok(done > 0)
        })
        .await
    }

    /// An unknown agent is ignored: it has never said hello, so there is nothing to update.
    async fn set_agent_state(&self, agent_id: &str, state: AgentState, now_ms: i64) -> Result<()> {
        self.write("set_agent_state", async |c| {
            c.query("UPDATE agents SET state = $1, last_seen_ms = $2 WHERE agent_id = $3")
                .bind(state.as_str())
                .bind(now_ms)
                .bind(agent_id)
                .execute()
                .await?;
            Ok(())
        })
        .await
    }

    async fn touch_agents(&self, seen: &[(String, i64)]) -> Result<()> {
        if seen.is_empty() {
            return Ok(());
        }
        self.write("touch_agents", async |c| {
            for chunk in seen.chunks(AGENTS_PER_TOUCH) {
                // `VALUES` names its columns column1, column2 on both databases.
                let sql = format!(
                    "UPDATE agents SET last_seen_ms = CASE WHEN last_seen_ms < t.column2 THEN t.column2 \
                     ELSE last_seen_ms END FROM (VALUES {}) AS t WHERE agents.agent_id = t.column1",
                    placeholders(c.marks(), 2, chunk.len())
                );
                let mut q = c.query(sql);
                for (agent_id, at_ms) in chunk {
                    q = q.bind(agent_id.as_str()).bind(*at_ms);
                }
                q.execute().await?;
            }
            Ok(())
        })
        .await
    }

    async fn snapshot(&self) -> Result<Snapshot> {
        self.read("snapshot", async |c| {
            let active = "state NOT IN ('succeeded', 'failed', 'cancelled')";
            let jobs =
                c.query(format!("SELECT {JOB_COLUMNS} FROM jobs WHERE {active} ORDER BY id")).all().await?;
            let allocations = c
                .query(format!(
                    "SELECT {ALLOCATION_COLUMNS} FROM allocations a JOIN jobs j ON j.id = a.job_id \
                     AND j.attempt = a.attempt WHERE j.{active} ORDER BY a.job_id, a.rank"
                ))
                .all()
                .await?;
            let agents = c
                .query(
                    "SELECT agent_id, address, agent_version, inventory_pb, state, last_seen_ms, \
                     cordon_by, cordon_reason, cordoned_at_ms FROM agents \
                     ORDER BY agent_id",
                )
                .all()
                .await?;
            Ok(Snapshot {
                active_jobs: jobs.iter().map(rows::job).collect::<Result<_>>()?,
                allocations: allocations.iter().map(rows::allocation).collect::<Result<_>>()?,
                agents: agents.iter().map(rows::agent).collect::<Result<_>>()?,
            })
        })
        .await
    }
}
