//! MASTER_PORT is a port the rank-0 agent found free: jobs launched at once on one host never
//! share one, ports other programs hold are never handed out, and every rank of a multi-host
//! job gets the rank-0 host's port.

use std::collections::BTreeSet;
use std::time::Duration;

use trainyard_tests::Cluster;

#[test]
fn master_ports_are_free_distinct_and_shared_by_every_host_of_a_job() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("a", 4)?;
    c.start_agent("b", 4)?;
    // Ports another program holds while the jobs launch.
    let held: Vec<std::net::TcpListener> =
        (0..16).map(|_| std::net::TcpListener::bind("127.0.0.1:0")).collect::<Result<_, _>>()?;
    let held_ports: BTreeSet<u16> =
        held.iter().map(|l| l.local_addr().map(|a| a.port())).collect::<Result<_, _>>()?;

    let singles: Vec<u64> = (0..4)
        .map(|i| c.submit(&c.job_file(&format!("one-{i}"), 1, 1, &["--steps", "5", "--step-ms", "20"], "")))
        .collect::<Result<_, _>>()?;
    let wide = c.submit(&c.job_file("wide", 4, 2, &["--steps", "5", "--step-ms", "20"], ""))?;
    let mut ports = Vec::new();
    for job in singles.iter().chain([&wide]) {
        let status = c.wait_state(*job, &["succeeded", "failed"], Duration::from_secs(90))?;
        assert_eq!(status["state"], "succeeded", "{status}");
        let rows = c.query_text(&format!(
            "SELECT DISTINCT CAST(json_extract(body, '$.env.MASTER_PORT') AS TEXT) FROM receipts WHERE job_id = {job} AND kind = 'launch'"
        ))?;
        assert_eq!(rows.len(), 1, "job {job}: every rank has the same MASTER_PORT: {rows:?}");
        let port: u16 = rows[0][0].parse()?;
        assert!(port >= 1024, "job {job}: port {port}");
        assert!(!held_ports.contains(&port), "job {job} got port {port}, which another program holds");
        ports.push((*job, port));
    }
    let distinct: BTreeSet<u16> = ports.iter().map(|(_, p)| *p).collect();
    assert_eq!(distinct.len(), ports.len(), "jobs launched at once never share a port: {ports:?}");
    let hosts =
        c.query(&format!("SELECT COUNT(DISTINCT agent_id) FROM allocations WHERE job_id = {wide}"))?;
    assert_eq!(hosts[0][0], 2, "the wide job spans both hosts");
    drop(held);
    Ok(())
}
