//! The loopback demo's doors: a tokenless call is let in only from the Unix account that
//! started the controller (the uid the kernel records for the caller's TCP socket on this host,
//! read from `/proc/net/tcp` and `tcp6`), and its HTTP listener answers only requests addressed
//! to the loopback (`Host`), so a web page of another site that rebinds its name to 127.0.0.1
//! reads nothing.

use std::net::{IpAddr, SocketAddr};

/// The uid owning the local TCP socket whose address is `peer` (the caller's end of a loopback
/// connection), from the kernel's socket tables of this network namespace.
pub fn loopback_peer_uid(peer: SocketAddr) -> Option<u32> {
    let (file, want) = match peer.ip() {
        IpAddr::V4(ip) => {
            ("/proc/net/tcp", format!("{:08X}:{:04X}", u32::from_ne_bytes(ip.octets()), peer.port()))
        }
        IpAddr::V6(ip) => {
            let words: String = ip
                .octets()
                .chunks(4)
                .map(|c| format!("{:08X}", u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
                .collect();
            ("/proc/net/tcp6", format!("{words}:{:04X}", peer.port()))
        }
    };
    let text = std::fs::read_to_string(file).ok()?;
    uid_of_local_address(&text, &want)
}

/// The uid column of the established connections of a `/proc/net/tcp` table whose local
/// address is `want`; `None` when there is none, or when two disagree. Only established rows
/// count: a closed connection that used the same local port lingers in the table (`TIME_WAIT`,
/// shown with uid 0), and taking it first let another account's call in as root's. Two live
/// connections may share a local port towards different peers: then whose call this is cannot
/// be told from the address, and the answer is no one's.
fn uid_of_local_address(table: &str, want: &str) -> Option<u32> {
    const ESTABLISHED: &str = "01";
    let mut uids = table.lines().skip(1).filter_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.get(1) != Some(&want) || fields.get(3) != Some(&ESTABLISHED) {
            return None;
        }
        fields.get(7)?.parse::<u32>().ok()
    });
    let first = uids.next()?;
    uids.all(|uid| uid == first).then_some(first)
}

/// Whether a tokenless call from `peer` comes from this process's own account (`None`: the
/// caller is unknown, so no).
pub fn is_own_account(peer: Option<SocketAddr>) -> bool {
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    peer.and_then(loopback_peer_uid) == Some(me)
}

/// Whether an HTTP `Host` value names the loopback: `localhost`, an address in 127.0.0.0/8 or
/// `[::1]`, with or without a port. No `Host` at all (HTTP/1.0) is not a browser's request.
pub fn is_loopback_host(host: Option<&str>) -> bool {
    let Some(host) = host else { return true };
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(h, p)| if p.parse::<u16>().is_ok() { h } else { host }),
    };
    let name = name.trim_end_matches('.');
    name.eq_ignore_ascii_case("localhost") || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_callers_uid_is_read_from_the_kernels_table() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
                     0: 0100007F:9C40 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  65534        0 1\n\
                     1: 0100007F:1F90 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 2\n";
        assert_eq!(uid_of_local_address(table, "0100007F:9C40"), Some(65534));
        assert_eq!(uid_of_local_address(table, "0100007F:1F90"), Some(0));
        assert_eq!(uid_of_local_address(table, "0100007F:0001"), None);
        // A closed connection of root's that used the same local port earlier (TIME_WAIT, 06)
        // comes first in the table: the live one is nobody's, and so is the call.
        let reused = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
                      0: 0100007F:9C40 0100007F:0050 06 00000000:00000000 03:00000000 00000000     0        0 0\n\
                      1: 0100007F:9C40 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  65534        0 1\n";
        assert_eq!(uid_of_local_address(reused, "0100007F:9C40"), Some(65534));
        // Two live connections on one local port, of two accounts: no one's.
        let shared = format!(
            "{reused}   2: 0100007F:9C40 0100007F:0050 01 00000000:00000000 00:00000000 00000000     0        0 2\n"
        );
        assert_eq!(uid_of_local_address(&shared, "0100007F:9C40"), None);
        // A real connection on this machine: our own socket is ours.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, peer) = listener.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        assert!(is_own_account(Some(peer)));
        assert!(!is_own_account(None));
    }

    #[test]
    fn only_loopback_names_pass() {
        for host in
            ["localhost", "localhost:7071", "127.0.0.1:7071", "127.0.0.2", "[::1]:80", "[::1]", "LOCALHOST."]
        {
            assert!(is_loopback_host(Some(host)), "{host}");
        }
        for host in [
            "attacker.example",
            "attacker.example:7071",
            "10.0.0.1:7071",
            "[2001:db8::1]:80",
            "127.0.0.1.evil.com",
        ] {
            assert!(!is_loopback_host(Some(host)), "{host}");
        }
        assert!(is_loopback_host(None));
    }
}
