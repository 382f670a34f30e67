//! The store's own metrics: how long every operation took (its one transaction, retries
//! included) and which failed. The controller registers them into the registry it serves on
//! `/metrics`, so they appear beside its own under the same prefix.
//!
//! | metric | type | what |
//! |---|---|---|
//! | `trainyard_store_operation_seconds{op}` | histogram | every store transaction, retries included |
//! | `trainyard_store_errors_total{op}` | counter | store operations that failed |

use std::sync::OnceLock;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabel {
    pub op: &'static str,
}

/// 0.25 ms to ~8 s, doubling.
fn latency() -> Histogram {
    Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
}

pub struct StoreMetrics {
    pub operation: Family<OpLabel, Histogram, fn() -> Histogram>,
    pub errors: Family<OpLabel, Counter>,
}

/// The process's store metrics, created on first use (families are shared handles: the ones
/// registered and the ones recorded into are the same).
pub fn metrics() -> &'static StoreMetrics {
    static METRICS: OnceLock<StoreMetrics> = OnceLock::new();
    METRICS.get_or_init(|| StoreMetrics {
        operation: Family::new_with_constructor(latency),
        errors: Family::default(),
    })
}

impl StoreMetrics {
    /// Records one store operation's duration and outcome.
    pub fn store_op(&self, op: &'static str, took: Duration, ok: bool) {
        self.operation.get_or_create(&OpLabel { op }).observe(took.as_secs_f64());
        if !ok {
            self.errors.get_or_create(&OpLabel { op }).inc();
        }
    }

    /// Adds the store's metrics to `registry` (the controller's, prefixed `trainyard`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "store_operation_seconds",
            "Store transactions, retries included",
            self.operation.clone(),
        );
        registry.register("store_errors", "Store operations that failed", self.errors.clone());
    }
}
