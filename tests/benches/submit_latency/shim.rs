//! One shim's start, the part of a launch every rank pays: the agent's shim supervising a rank
//! that exits at once (`/bin/true`), from its spawn to its exit (its exit file written), with
//! the CPU it and its rank used; beside it the same rank forked and exec'd bare, the floor. Two
//! programs, alternating: `trainyard-shim` (what the agent starts) and `trainyard-agent
//! supervise` (the same code in the agent's binary, what an agent without the small binary
//! beside it starts).

use std::path::Path;
use std::process::Command;
use std::time::Instant;

/// Starts of each program measured.
pub const STARTS: usize = 100;

/// Wall-clock median and mean CPU of one start, in microseconds.
#[derive(Debug, Clone, Copy)]
pub struct Cost {
    pub wall_p50_us: i64,
    pub cpu_mean_us: i64,
}

/// `(trainyard-shim, trainyard-agent supervise, bare rank)`.
pub fn start_costs() -> anyhow::Result<[Cost; 3]> {
    let dir = tempfile::Builder::new().prefix("trainyard-shim-start-").tempdir()?;
    std::fs::write(dir.path().join("env.json"), br#"{"PATH":"/usr/bin:/bin"}"#)?;
    let programs = [
        trainyard_tests::bin("trainyard-shim")?,
        trainyard_tests::bin("trainyard-agent")?,
        "/bin/true".into(),
    ];
    let mut samples: [(Vec<i64>, i64); 3] = Default::default();
    for _ in 0..STARTS {
        for (program, (walls, cpu)) in programs.iter().zip(samples.iter_mut()) {
            let (wall, used) = one_start(program, dir.path())?;
            walls.push(wall);
            *cpu += used;
        }
    }
    Ok(samples.map(|(mut walls, cpu)| {
        walls.sort_unstable();
        Cost { wall_p50_us: walls[walls.len() / 2], cpu_mean_us: cpu / STARTS as i64 }
    }))
}

/// One start of `program` (a shim when it is not `/bin/true`): its wall time and the CPU it
/// and its children used, in microseconds.
fn one_start(program: &Path, dir: &Path) -> anyhow::Result<(i64, i64)> {
    let mut command = Command::new(program);
    if program != Path::new("/bin/true") {
        let _ = std::fs::remove_file(dir.join("exit.json"));
        let _ = std::fs::remove_file(dir.join("pid"));
        command.arg("supervise").arg("--status-file").arg(dir.join("exit.json"));
        command.arg("--pid-file").arg(dir.join("pid")).arg("--env-file").arg(dir.join("env.json"));
        command.arg("--workdir").arg(dir).args(["--", "/bin/true"]);
    }
    let (cpu0, t0) = (children_cpu_us(), Instant::now());
    let status = command.env_clear().env("PATH", "/usr/bin:/bin").status()?;
    let wall = t0.elapsed().as_micros() as i64;
    anyhow::ensure!(status.success(), "{} exited with {status}", program.display());
    Ok((wall, children_cpu_us() - cpu0))
}

/// CPU time, user and system, of this process's waited-for children so far.
fn children_cpu_us() -> i64 {
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage);
        usage
    };
    let us = |t: libc::timeval| t.tv_sec * 1_000_000 + t.tv_usec;
    us(usage.ru_utime) + us(usage.ru_stime)
}
