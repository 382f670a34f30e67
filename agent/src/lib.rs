//! trainyard's host agent: describes the host, runs ranks, and relays their receipts.
//!
//! # Layout
//!
//! - [`address`]: the address this host advertises for `MASTER_ADDR`, detected from its
//!   connection to the controller.
//! - [`config`]: [`AgentConfig`], the plain settings struct the binary builds from its flags.
//! - [`layout`]: where things live under the data directory (run directories, state files).
//! - [`pinning`]: binds a rank to its planned CPUs and NUMA memory node, reads back the binding.
//! - [`procfs`]: the few `/proc` and signal helpers the launcher needs (liveness, start times).
//! - [`cgroup`]: every process of a rank held in its cgroups (v2, v1), or by its shim as a
//!   child subreaper; killed together, counted, limited.
//! - [`env`]: the rank environment (torchrun variables, `TRAINYARD_*`, the job's overlay).
//! - [`bootstrap`]: the Python bootstrap an `exec` rank gets on its path (receipts of a script
//!   nobody changed), written under the data directory at start.
//! - [`state`]: the durable per-rank record in `DATA/state/ranks/`, written before reporting.
//! - [`supervise`]: the per-rank shim (`trainyard-agent supervise`) that outlives the agent.
//! - [`launcher`]: turns a `Launch` into shims and ranks, cancels, detects exits, adopts.
//! - [`tail`]: the receipts tailer: lines to receipts, acknowledged positions, rewinds.
//! - [`connection`]: one stream to the controller: hello, then the select loop.
//! - [`logs`]: a rank's stdout/stderr for `ctl logs`, read from its run directory in chunks.
//! - [`printed`]: the step lines a rank prints (nanochat, modded-nanogpt, torchtitan,
//!   Megatron-LM, Hugging Face, a job's own pattern), merged into its step receipts.
//! - [`preflight`]: the node checks (topology, NUMA, host, NVML, CUDA, NCCL) and their report,
//!   with [`preflight::probe::HostProbe`], the seam around the hardware, and the JSON
//!   host-description file behind it.
//! - [`topology`]: the node's GPU/NUMA/NIC model, its interconnect class, `nvidia-smi topo -m`
//!   rendering and parsing.
//! - [`gpu_sample`]: one reading of one GPU (plain data the telemetry and the metrics share).
//! - [`telemetry`]: GPU telemetry: a sampler thread (NVML, or a script on hosts without a GPU)
//!   summarising each running rank's GPU per window, queued for the stream.
//! - [`account`]: the Unix account a job's ranks run as, looked up on this node (never root).
//! - [`output`]: a rank's stdout and stderr, piped through its shim into capped logs that a
//!   full disk never blocks.
//! - [`notice`]: preemption notices from a source the operator names (a file, a command, a
//!   cloud's metadata endpoint), told to the controller.
//! - [`metrics`]: the agent's Prometheus metrics and `/healthz`.
//! - [`slurm`]: an agent started inside a Slurm allocation for one job (docs/slurm.md).
//! - [`relay`]: [`run`], the daemon's entry point: dial, reconnect with backoff, shut down.

pub mod account;
pub mod address;
pub mod bootstrap;
pub mod cgroup;
pub mod config;
pub mod connection;
pub mod env;
pub mod gpu_holders;
pub mod gpu_sample;
pub mod launcher;
pub mod layout;
pub mod logs;
pub mod metrics;
pub mod notice;
pub mod output;
pub mod pinning;
pub mod preflight;
pub mod printed;
pub mod procfs;
pub mod relay;
pub mod resume;
pub mod slurm;
pub mod state;
pub mod supervise;
pub mod tail;
pub mod telemetry;
pub mod topology;

pub use config::AgentConfig;
pub use relay::run;
