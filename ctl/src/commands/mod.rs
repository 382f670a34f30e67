//! One module per subcommand; each takes a connected [`Controller`] and prints its result.

pub mod cancel;
pub mod compare;
pub mod diagnose;
pub mod logs;
pub mod nodes;
pub mod preflight;
pub mod slurm;
pub mod status;
pub mod submit;
pub mod watch;

use trainyard_proto::words::{JobState, UnknownWord};

/// A job in a state it does not leave (its words checked where the reply arrived).
pub fn is_terminal(state: Result<JobState, UnknownWord>) -> bool {
    state.is_ok_and(JobState::is_terminal)
}

/// A fresh idempotency key: 128 bits from the kernel's random source, or, if that cannot be
/// read, the time and process id (unique enough for one host's submits).
pub fn new_key() -> String {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    let random = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if random.is_err() {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        bytes[..8].copy_from_slice(&(nanos.as_nanos() as u64).to_le_bytes());
        bytes[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests;
