//! The door: an address that floods the controller with calls it has no credential for is
//! turned away at the TCP accept, before its connections cost a TLS handshake.
//!
//! A refused call is cheap (no store query, a rate-limited audit row), but a new TLS connection
//! is not: on a 2-core controller the handshake and HTTP/2 set-up of each cost about 0.5 ms of
//! CPU, so 200 made-up tokens a second, each on a new connection, took a fifth of the receipt
//! ingest rate. The door counts refused calls per source address; an address past
//! [`REFUSALS_BURST`] (then [`REFUSALS_PER_SEC`]) is *limited* for [`LIMITED_FOR_MS`] (renewed while
//! it keeps failing): it may open at most [`ACCEPTS_PER_SEC_WHEN_LIMITED`] new connections a
//! second, and the others are closed as soon as they are accepted. Connections already open
//! (an agent's stream, a `watch`) are never touched, and a user with a valid token behind the
//! same address still gets in, at that rate.
//!
//! What it does not stop: a flood spread over many addresses, each below the burst. The gRPC
//! concurrency limits still bound what those cost.

use std::collections::HashMap;
use std::net::IpAddr;

use super::budget::RefusalBudget;

/// Refused calls an address may make at once before it is limited, and per second after.
pub const REFUSALS_BURST: f64 = 20.0;
pub const REFUSALS_PER_SEC: f64 = 2.0;
/// How long a limited address stays limited after its last refused call.
pub const LIMITED_FOR_MS: i64 = 10_000;
/// New connections a second a limited address may open (and at once).
pub const ACCEPTS_PER_SEC_WHEN_LIMITED: f64 = 10.0;
/// Addresses tracked at most; past it, addresses that are not limited are forgotten first.
pub const MAX_TRACKED_ADDRESSES: usize = 4096;

/// Per-address refusals and admissions; shared by the listener and the authenticator.
#[derive(Debug, Default)]
pub struct Door {
    addresses: std::sync::Mutex<HashMap<IpAddr, Visitor>>,
}

#[derive(Debug)]
struct Visitor {
    refusals: RefusalBudget,
    limited_until_ms: i64,
    accepts: RefusalBudget,
}

/// What [`Door::refused`] did to the address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Within its allowance.
    Allowed,
    /// This refusal put the address over its allowance: it is limited from now.
    NowLimited,
    /// It was limited already; the limit is renewed.
    StillLimited,
}

impl Door {
    /// A call from `ip` was refused for want of a valid credential.
    pub fn refused(&self, ip: IpAddr, now_ms: i64) -> Verdict {
        let mut addresses = self.lock();
        if !addresses.contains_key(&ip) && addresses.len() >= MAX_TRACKED_ADDRESSES {
            addresses.retain(|_, v| v.limited_until_ms > now_ms);
            if addresses.len() >= MAX_TRACKED_ADDRESSES {
                return Verdict::Allowed;
            }
        }
        let visitor = addresses.entry(ip).or_insert_with(|| Visitor {
            refusals: RefusalBudget::new(REFUSALS_PER_SEC, REFUSALS_BURST),
            limited_until_ms: 0,
            accepts: RefusalBudget::new(ACCEPTS_PER_SEC_WHEN_LIMITED, ACCEPTS_PER_SEC_WHEN_LIMITED),
        });
        let was_limited = visitor.limited_until_ms > now_ms;
        if visitor.refusals.take(now_ms) && !was_limited {
            return Verdict::Allowed;
        }
        visitor.limited_until_ms = now_ms + LIMITED_FOR_MS;
        if was_limited { Verdict::StillLimited } else { Verdict::NowLimited }
    }

    /// Whether a new connection from `ip` may go on to its handshake.
    pub fn admit(&self, ip: IpAddr, now_ms: i64) -> bool {
        let mut addresses = self.lock();
        match addresses.get_mut(&ip) {
            Some(v) if v.limited_until_ms > now_ms => {
                let admitted = v.accepts.take(now_ms);
                if !admitted {
                    crate::metrics::metrics().connections_turned_away.inc();
                }
                admitted
            }
            _ => true,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Visitor>> {
        self.addresses.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn an_address_is_limited_past_its_burst_and_others_are_not() {
        let door = Door::default();
        for _ in 0..REFUSALS_BURST as usize {
            assert_eq!(door.refused(ip(1), 1_000), Verdict::Allowed);
        }
        assert!(door.admit(ip(1), 1_000), "not limited within the burst");
        assert_eq!(door.refused(ip(1), 1_000), Verdict::NowLimited);
        assert_eq!(door.refused(ip(1), 1_001), Verdict::StillLimited);
        let admitted = (0..100).filter(|_| door.admit(ip(1), 1_002)).count();
        assert_eq!(
            admitted, ACCEPTS_PER_SEC_WHEN_LIMITED as usize,
            "a limited address opens so many at once"
        );
        assert!(door.admit(ip(2), 1_002), "another address is not limited");
        // A second later, the allowance has refilled by its rate.
        let admitted = (0..100).filter(|_| door.admit(ip(1), 2_002)).count();
        assert_eq!(admitted, ACCEPTS_PER_SEC_WHEN_LIMITED as usize);
    }

    #[test]
    fn the_limit_lifts_once_the_refusals_stop_and_is_renewed_while_they_go_on() {
        let door = Door::default();
        for _ in 0..=REFUSALS_BURST as usize {
            door.refused(ip(1), 0);
        }
        assert_eq!(door.refused(ip(1), 5_000), Verdict::StillLimited, "renewed at 5 s");
        let drained = (0..100).filter(|_| door.admit(ip(1), 14_000)).count();
        assert!(drained < 100, "still limited 9 s after the last refusal");
        assert!((0..100).all(|_| door.admit(ip(1), 15_001)), "free 10 s after the last refusal");
        // A slow trickle of refusals (below the rate) never limits.
        for s in 0..100 {
            assert_ne!(door.refused(ip(3), 20_000 + s * 1_000), Verdict::NowLimited);
        }
    }

    #[test]
    fn the_table_of_addresses_is_bounded_and_keeps_the_limited_ones() {
        let door = Door::default();
        for _ in 0..=REFUSALS_BURST as usize {
            door.refused(ip(1), 0);
        }
        for n in 0..(MAX_TRACKED_ADDRESSES as u32 + 100) {
            door.refused(IpAddr::from(n.to_be_bytes()), 1);
        }
        assert!(door.lock().len() <= MAX_TRACKED_ADDRESSES);
        assert!(door.lock().contains_key(&ip(1)), "the limited address is kept");
        assert!(!(0..100).all(|_| door.admit(ip(1), 2)));
    }
}
