//! Every size a client, an agent or a rank controls, bounded, in one place both ends of the wire
//! share, so that what one end may send the other accepts (docs/security.md lists them with their
//! reasons). Each limit is tested at its value and one above.

/// A message on an agent's stream, either direction, enforced at both ends (tonic's decoding and
/// encoding limits). A receipt batch holds at most `max_batch_bytes` (1 MiB) of bodies, or one
/// line of up to [`MAX_RECEIPT_LINE_BYTES`]; a launch holds a spec of at most [`MAX_SPEC_BYTES`].
pub const MAX_AGENT_MESSAGE_BYTES: usize = 16 << 20;

/// A request to the `Jobs` service (`ctl`, the web view's clients): the largest, a submit, carries
/// one spec of at most [`MAX_SPEC_BYTES`].
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// A response of the `Jobs` service (the status of a job of thousands of ranks, a diagnosis);
/// `ctl` accepts as much.
pub const MAX_RESPONSE_BYTES: usize = 64 << 20;

/// A job spec as encoded on the wire: refused at submit when larger, so that every launch of it
/// fits in an agent message with room for its rank map.
pub const MAX_SPEC_BYTES: usize = 512 << 10;

/// A job spec file `ctl submit` reads.
pub const MAX_SPEC_FILE_BYTES: u64 = 1 << 20;

/// A job's name.
pub const MAX_NAME_BYTES: usize = 128;

/// Arguments of an exec engine's argv, and their total bytes (Linux's own limit on one argument
/// is 128 KiB; the whole argv and environment share a few MiB).
pub const MAX_ARGV_ITEMS: usize = 4_096;
pub const MAX_ARGV_BYTES: usize = 128 << 10;

/// Variables of a job's environment overlay, and their total bytes (names and values).
pub const MAX_ENV_VARS: usize = 1_024;
pub const MAX_ENV_BYTES: usize = 128 << 10;

/// A path in a spec (workdir, source_dir, builtin data), as Linux's `PATH_MAX`.
pub const MAX_PATH_BYTES: usize = 4_096;

/// Settings of the built-in engine, and their total bytes.
pub const MAX_SETTINGS: usize = 256;
pub const MAX_SETTINGS_BYTES: usize = 64 << 10;

/// Short strings of a spec or a request: a GPU model constraint, a cancel reason, an
/// idempotency key.
pub const MAX_SHORT_STRING_BYTES: usize = 256;

/// A line of a rank's receipts file (without its newline); longer lines are skipped and counted,
/// never buffered whole.
pub const MAX_RECEIPT_LINE_BYTES: usize = 1 << 20;

/// Receipts in one `ReceiptBatch`: a larger batch is a protocol error, and the controller ends
/// the stream (the agent sends at most 2,000).
pub const MAX_RECEIPT_BATCH: usize = 20_000;

/// A piece of a rank's stdout or stderr relayed for `ctl logs`.
pub const MAX_LOG_CHUNK_BYTES: usize = 64 << 10;

/// Log pieces an agent sends a request ahead of what its client has read: the controller grants
/// more (`LogCredit`) as the client reads, so a slow reader is paced, not buffered.
pub const LOG_CREDIT_PIECES: u32 = 8;

/// Lines `ctl logs --tail` may ask for.
pub const MAX_TAIL_LINES: u32 = 1_000_000;

/// Telemetry windows in one `TelemetryBatch` (the agent sends at most 256).
pub const MAX_TELEMETRY_WINDOWS: usize = 1_024;
