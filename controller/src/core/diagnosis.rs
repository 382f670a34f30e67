//! `Diagnose`: gathers what [`crate::diagnose::diagnose`] reads (the attempt's step receipts
//! and allocations from the store, the nodes' inventories and newest preflight reports from
//! memory, the cost model's prediction for the placement) and runs it.

use std::collections::BTreeMap;

use super::{Controller, ControllerError, Result};
use crate::diagnose::{self, Diagnosis, Input, NodeFacts};
use crate::store::JobId;

impl Controller {
    /// Diagnoses `attempt` of a job (default: its current attempt).
    pub async fn diagnose(&self, job_id: JobId, attempt: Option<u32>) -> Result<Diagnosis> {
        let record = self.store.get_job(job_id).await?.ok_or(ControllerError::JobNotFound(job_id))?;
        let attempt = attempt.unwrap_or(record.attempt);
        if attempt > record.attempt {
            return Err(ControllerError::BadRequest(format!(
                "job {job_id} has no attempt {attempt}; its attempts are 0 to {}",
                record.attempt
            )));
        }
        let allocations = self.store.allocations(job_id, attempt).await?;
        let samples = self.store.step_samples(job_id, attempt).await?;
        let (nodes, predicted_comm_ms) = {
            let core = self.lock();
            let nodes: BTreeMap<String, NodeFacts> = allocations
                .iter()
                .filter_map(|a| core.agents.get(&a.agent_id))
                .map(|e| {
                    let facts =
                        NodeFacts { inventory: e.record.inventory.clone(), preflight: e.preflight.clone() };
                    (e.record.agent_id.clone(), facts)
                })
                .collect();
            (nodes, super::view::predicted_comm_ms(&core, &allocations, &record.spec))
        };
        Ok(diagnose::diagnose(&Input {
            spec: &record.spec,
            attempt,
            allocations: &allocations,
            samples: &samples,
            nodes: &nodes,
            predicted_comm_ms,
        }))
    }
}
