//! [`HostProbe`], the seam around the hardware: the host's inventory and the preflight's
//! hardware calls (NVML health, CUDA, NCCL). [`super::nvml::NvmlProbe`] implements it from the
//! driver, [`super::host::HostFile`] from a JSON file on machines without GPUs. The CUDA and
//! NCCL calls' default implementations use the real libraries and say `skipped: ... not found`
//! without them.

use trainyard_proto::v1::HostInventory;

use super::facts::HostFacts;
use super::{cuda, nccl};

/// Source of the host's inventory, and the hardware calls of the preflight.
pub trait HostProbe: Send + Sync {
    /// The host as it is now.
    fn inventory(&self) -> anyhow::Result<HostInventory>;

    /// Where the inventory comes from: `nvml` or `host-file`.
    fn source(&self) -> &'static str {
        "host-file"
    }

    /// NVML's view of the GPUs' health; `Err` is the reason the check is skipped.
    fn gpu_health(&self) -> Result<Health, String>;

    /// The CUDA check on the GPUs `gpus` (NVML indices; blocking).
    fn cuda_check(&self, gpus: &[u32]) -> cuda::Outcome {
        cuda::check(gpus)
    }

    /// The NCCL all_reduce sweep over the GPUs `gpus` (NVML indices; blocking, seconds to
    /// minutes).
    fn nccl_sweep(&self, gpus: &[u32], sizes: &[u64]) -> nccl::Outcome {
        nccl::sweep_with_agent_binary(gpus, sizes)
    }

    /// Host facts this probe stands in for (a fixture's), or `None` to read the real machine.
    fn host_facts(&self) -> Option<HostFacts> {
        None
    }
}

/// Health of the node's GPUs as NVML reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Health {
    pub driver_version: String,
    /// CUDA version the driver supports, e.g. "12.8".
    pub cuda_version: String,
    pub gpus: Vec<GpuHealth>,
}

/// One GPU's health; `None` where NVML does not support the query on this GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct GpuHealth {
    pub index: u32,
    pub name: String,
    pub ecc_enabled: Option<bool>,
    /// Uncorrected ECC errors since the driver loaded (volatile).
    pub ecc_uncorrected: Option<u64>,
    /// Row remapping waiting for a GPU reset.
    pub remap_pending: Option<bool>,
    /// A row remapping failed: the GPU needs service.
    pub remap_failed: Option<bool>,
    pub power_limit_w: Option<u32>,
    pub pcie_gen: (Option<u32>, Option<u32>),
    pub pcie_width: (Option<u32>, Option<u32>),
    /// Active throttle reasons that matter (idle and application clocks left out).
    pub throttle: Vec<String>,
}
