//! The vocabulary of GPU telemetry shared by the agent (which samples it), the controller (which
//! stores and judges it) and `ctl`: NVML's clocks-event (throttle) reason bits with one word
//! each, and what the field knows of each XID (its meaning and what an operator does about it).
//!
//! The bits are NVML's own (`nvmlClocksEventReason*`, formerly `nvmlClocksThrottleReason*`), so
//! a window's `clock_reasons` is the same number DCGM exports as
//! `DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`.

/// One clocks-event reason: its NVML bit and its word.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClockReason {
    pub bit: u64,
    pub word: &'static str,
    /// It slows the GPU against the operator's wishes (idle and the clocks someone set are not).
    pub slows: bool,
}

pub const GPU_IDLE: ClockReason = ClockReason { bit: 0x1, word: "gpu_idle", slows: false };
pub const APPLICATIONS_CLOCKS: ClockReason =
    ClockReason { bit: 0x2, word: "applications_clocks", slows: false };
pub const SW_POWER_CAP: ClockReason = ClockReason { bit: 0x4, word: "sw_power_cap", slows: true };
pub const HW_SLOWDOWN: ClockReason = ClockReason { bit: 0x8, word: "hw_slowdown", slows: true };
pub const SYNC_BOOST: ClockReason = ClockReason { bit: 0x10, word: "sync_boost", slows: true };
pub const SW_THERMAL: ClockReason = ClockReason { bit: 0x20, word: "sw_thermal_slowdown", slows: true };
pub const HW_THERMAL: ClockReason = ClockReason { bit: 0x40, word: "hw_thermal_slowdown", slows: true };
pub const HW_POWER_BRAKE: ClockReason =
    ClockReason { bit: 0x80, word: "hw_power_brake_slowdown", slows: true };
pub const DISPLAY_CLOCKS: ClockReason = ClockReason { bit: 0x100, word: "display_clocks", slows: false };

/// Every reason, in bit order.
pub const CLOCK_REASONS: &[ClockReason] = &[
    GPU_IDLE,
    APPLICATIONS_CLOCKS,
    SW_POWER_CAP,
    HW_SLOWDOWN,
    SYNC_BOOST,
    SW_THERMAL,
    HW_THERMAL,
    HW_POWER_BRAKE,
    DISPLAY_CLOCKS,
];

/// The words of the reasons set in `bits` ("sw_power_cap,hw_thermal_slowdown"; "" for none).
pub fn reason_words(bits: u64) -> String {
    CLOCK_REASONS.iter().filter(|r| bits & r.bit != 0).map(|r| r.word).collect::<Vec<_>>().join(",")
}

/// The bits of a comma-separated list of reason words; the error names the word it does not know.
pub fn reason_bits(words: &str) -> Result<u64, String> {
    let mut bits = 0;
    for word in words.split(',').map(str::trim).filter(|w| !w.is_empty()) {
        let reason = CLOCK_REASONS.iter().find(|r| r.word == word).ok_or_else(|| {
            let known: Vec<&str> = CLOCK_REASONS.iter().map(|r| r.word).collect();
            format!("unknown clock reason {word:?} (expected one of {})", known.join(", "))
        })?;
        bits |= reason.bit;
    }
    Ok(bits)
}

/// What an XID asks of the operator (NVIDIA's XID catalogue, "Resolution").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum XidAction {
    /// Usually the application's own fault (a bad kernel, an out-of-bounds access): restart the
    /// job; the node is not to blame.
    Application,
    /// Note it; act when it repeats.
    Watch,
    /// The GPU needs a reset (drain the node, reset, run a full preflight).
    ResetGpu,
    /// The node needs a reboot, or the GPU service (drain it).
    RebootNode,
}

impl XidAction {
    /// The node must be drained: its GPU cannot be trusted until reset or serviced.
    pub fn drains(self) -> bool {
        matches!(self, XidAction::ResetGpu | XidAction::RebootNode)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            XidAction::Application => "restart the application",
            XidAction::Watch => "watch for repeats",
            XidAction::ResetGpu => "drain the node and reset the GPU",
            XidAction::RebootNode => "drain the node and reboot it (service the GPU if it recurs)",
        }
    }
}

/// One XID the field knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Xid {
    pub number: u32,
    pub meaning: &'static str,
    pub action: XidAction,
}

/// The XIDs seen on training fleets, with their meaning and action.
pub const XIDS: &[Xid] = &[
    Xid { number: 13, meaning: "graphics engine exception", action: XidAction::Application },
    Xid { number: 31, meaning: "GPU memory page fault", action: XidAction::Application },
    Xid { number: 43, meaning: "GPU stopped processing", action: XidAction::Application },
    Xid { number: 45, meaning: "preemptive cleanup after earlier errors", action: XidAction::Watch },
    Xid { number: 48, meaning: "double-bit ECC error", action: XidAction::ResetGpu },
    Xid { number: 61, meaning: "internal micro-controller breakpoint", action: XidAction::ResetGpu },
    Xid { number: 62, meaning: "internal micro-controller halt", action: XidAction::ResetGpu },
    Xid { number: 63, meaning: "ECC page retirement or row remapping recorded", action: XidAction::Watch },
    Xid { number: 64, meaning: "ECC page retirement or row remapping failed", action: XidAction::ResetGpu },
    Xid { number: 74, meaning: "NVLink error", action: XidAction::ResetGpu },
    Xid { number: 79, meaning: "GPU has fallen off the bus", action: XidAction::RebootNode },
    Xid { number: 92, meaning: "high single-bit ECC error rate", action: XidAction::Watch },
    Xid { number: 94, meaning: "contained ECC error", action: XidAction::Application },
    Xid { number: 95, meaning: "uncontained ECC error", action: XidAction::ResetGpu },
    Xid { number: 119, meaning: "GSP RPC timeout", action: XidAction::ResetGpu },
    Xid { number: 120, meaning: "GSP error", action: XidAction::ResetGpu },
    Xid { number: 140, meaning: "unrecovered ECC error", action: XidAction::ResetGpu },
    Xid {
        number: 154,
        meaning: "GPU recovery action changed: reset or reboot required",
        action: XidAction::RebootNode,
    },
];

/// What is known of XID `number`; an unknown one is watched.
pub fn xid(number: u32) -> Xid {
    XIDS.iter().copied().find(|x| x.number == number).unwrap_or(Xid {
        number,
        meaning: "not in trainyard's XID table (see NVIDIA's XID catalogue)",
        action: XidAction::Watch,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_words_round_trip_and_unknown_words_are_named() {
        let bits = SW_POWER_CAP.bit | HW_THERMAL.bit;
        assert_eq!(reason_words(bits), "sw_power_cap,hw_thermal_slowdown");
        assert_eq!(reason_bits("sw_power_cap, hw_thermal_slowdown"), Ok(bits));
        assert_eq!(reason_bits(""), Ok(0));
        let err = reason_bits("too_hot").unwrap_err();
        assert!(err.contains("unknown clock reason \"too_hot\""), "{err}");
        let mut seen = 0;
        for r in CLOCK_REASONS {
            assert_eq!(seen & r.bit, 0, "bits are distinct");
            seen |= r.bit;
        }
    }

    #[test]
    fn xids_say_what_to_do() {
        assert!(xid(79).action.drains());
        assert!(!xid(13).action.drains());
        assert_eq!(xid(4242).action, XidAction::Watch);
        let mut numbers: Vec<u32> = XIDS.iter().map(|x| x.number).collect();
        numbers.dedup();
        assert_eq!(numbers.len(), XIDS.len(), "sorted and unique");
    }
}
