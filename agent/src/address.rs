//! The address other hosts dial for `MASTER_ADDR` when this host holds rank 0: by default the
//! local address of a TCP connection to the controller, i.e. the interface this host uses to
//! reach the rest of the fleet (a 127.0.0.1 default cannot rendezvous across hosts). `--address`
//! overrides it, for hosts whose training network differs from their control network.

use std::net::IpAddr;
use std::time::Duration;

/// How long the probe connection may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The local IP of a TCP connection to `controller` (a URL such as `http://10.0.0.5:7070`).
pub async fn detect(controller: &str) -> Result<IpAddr, String> {
    let uri: tonic::transport::Uri =
        controller.parse().map_err(|e| format!("controller URL {controller:?}: {e}"))?;
    let host = uri.host().ok_or_else(|| format!("controller URL {controller:?} has no host"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().unwrap_or(if uri.scheme_str() == Some("https") { 443 } else { 80 });
    let connect = tokio::net::TcpStream::connect((host, port));
    let stream = tokio::time::timeout(PROBE_TIMEOUT, connect)
        .await
        .map_err(|_| format!("no connection to {host}:{port} within {} s", PROBE_TIMEOUT.as_secs()))?
        .map_err(|e| format!("cannot connect to {host}:{port}: {e}"))?;
    let ip = stream.local_addr().map_err(|e| format!("local address of the connection: {e}"))?.ip();
    if ip.is_unspecified() {
        return Err("the connection has no local address".into());
    }
    Ok(ip)
}

/// The first IPv4 address of this host that is not loopback, if any (for tests and messages).
pub fn non_loopback_ipv4() -> Option<std::net::Ipv4Addr> {
    let mut found = None;
    // SAFETY: getifaddrs fills a linked list we only read and then free with freeifaddrs.
    unsafe {
        let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut list) != 0 {
            return None;
        }
        let mut cur = list;
        while !cur.is_null() && found.is_none() {
            let addr = (*cur).ifa_addr;
            if !addr.is_null() && i32::from((*addr).sa_family) == libc::AF_INET {
                let sin = &*(addr as *const libc::sockaddr_in);
                let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                if !ip.is_loopback() && !ip.is_unspecified() {
                    found = Some(ip);
                }
            }
            cur = (*cur).ifa_next;
        }
        libc::freeifaddrs(list);
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_address_is_the_one_the_controller_is_reached_from() {
        let lo = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = lo.local_addr().unwrap().port();
        assert_eq!(detect(&format!("http://127.0.0.1:{port}")).await, Ok(IpAddr::from([127, 0, 0, 1])));
        // A controller on this host's own non-loopback address (local traffic only): the agent
        // advertises that interface, not 127.0.0.1.
        match non_loopback_ipv4() {
            Some(ip) => {
                let l = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
                let port = l.local_addr().unwrap().port();
                assert_eq!(detect(&format!("http://{ip}:{port}")).await, Ok(IpAddr::V4(ip)));
            }
            None => eprintln!("skipped the non-loopback case: this host has no non-loopback IPv4 address"),
        }
        drop(lo);
        let err = detect(&format!("http://127.0.0.1:{port}")).await.expect_err("nothing listens");
        assert!(err.starts_with("cannot connect to 127.0.0.1:"), "{err}");
        assert!(detect("not a url at all").await.is_err());
    }
}
