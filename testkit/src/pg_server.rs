//! A throwaway PostgreSQL server on loopback, for the test suites and benchmarks.
//!
//! [`TempPostgres::start`] runs `initdb` into a fresh temporary directory, then `postgres` on
//! 127.0.0.1 with a free port, under a small guardian shell whose standard input is a pipe held by
//! this process. Dropping the value, or this process ending in any way (a panic, SIGKILL), closes
//! the pipe: the guardian stops the server (fast shutdown) and deletes the directory. No server
//! outlives the test that started it.
//!
//! It needs the server binaries of Debian's `postgresql` package (`deploy/setup.sh` installs
//! it); they are looked up in `$TRAINYARD_PG_BIN`, then on `PATH`, then under
//! `/usr/lib/postgresql/*/bin`. PostgreSQL refuses to run as root, so when this process is root
//! the server runs as the `postgres` user the package creates.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long the server may take to accept connections after a start or restart.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// The role every database belongs to (`initdb -U`); connections are trusted on loopback.
pub const USER: &str = "trainyard";

/// Durability settings of the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// The server's defaults (`fsync`, `synchronous_commit` on): what a benchmark measures.
    Full,
    /// `fsync`, `synchronous_commit` and `full_page_writes` off: a process crash still loses
    /// nothing committed, only an OS crash would. Fast enough for hundreds of test databases.
    Relaxed,
}

/// A running throwaway server. See the [module documentation](self).
pub struct TempPostgres {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    guardian: Child,
    control: Option<ChildStdin>,
}

impl TempPostgres {
    /// Starts a fresh server; fails with a message that says what to install when the
    /// binaries are missing.
    pub fn start(durability: Durability) -> Result<Self, String> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let bin = find_bin_dir()?;
        let as_postgres = is_root();
        let dir = std::env::temp_dir().join(format!(
            "trainyard-pg-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        if as_postgres {
            run(
                Command::new("chown").args(["postgres:", &dir.to_string_lossy()]),
                "chown the data directory",
            )?;
        }
        let data = dir.join("data");
        let mut initdb = command(&bin, "initdb", as_postgres);
        initdb.arg("-D").arg(&data).args([
            "-A",
            "trust",
            "-U",
            USER,
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        ]);
        run(&mut initdb, "initdb")?;
        let port = free_port()?;
        let settings = match durability {
            Durability::Full => "",
            Durability::Relaxed => "-c fsync=off -c synchronous_commit=off -c full_page_writes=off",
        };
        // Restarts on a "restart" line; stops and cleans up on EOF (or any other line).
        let script = format!(
            "while :; do \"$0/postgres\" -D \"$1/data\" -p \"$2\" -k \"$1\" -c listen_addresses=127.0.0.1 \
             -c max_connections=300 {settings} >>\"$1/server.log\" 2>&1 & pid=$!; \
             read cmd down; kill -INT $pid; wait $pid; [ \"$cmd\" = restart ] || break; sleep \"${{down:-0}}\"; done; \
             rm -rf \"$1\""
        );
        let mut guardian = if as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", "sh", "-c"]);
            c
        } else {
            let mut c = Command::new("sh");
            c.arg("-c");
            c
        };
        let mut guardian = guardian
            .arg(script)
            .arg(&bin)
            .arg(&dir)
            .arg(port.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("start postgres: {e}"))?;
        let control = guardian.stdin.take();
        let server = TempPostgres { bin, dir, port, guardian, control };
        server.wait_ready()?;
        Ok(server)
    }

    /// URL of database `db` on this server.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://{USER}@127.0.0.1:{}/{db}", self.port)
    }

    /// Creates a fresh, empty database and returns its URL.
    pub fn create_database(&self) -> Result<String, String> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!("t{}_{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let mut createdb = command(&self.bin, "createdb", false);
        createdb.args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", USER, &name]);
        run(&mut createdb, "createdb")?;
        Ok(self.url(&name))
    }

    /// Stops the server (fast shutdown: open connections are cut) and starts it again on the
    /// same port and data; returns once it accepts connections.
    pub fn restart(&mut self) -> Result<(), String> {
        self.outage(Duration::ZERO)
    }

    /// Stops the server (fast shutdown) for `down` (whole seconds), then starts it again on the
    /// same port and data; returns once it accepts connections: a database lost for a while.
    pub fn outage(&mut self, down: Duration) -> Result<(), String> {
        let control = self.control.as_mut().ok_or("the server is stopped")?;
        control
            .write_all(format!("restart {}\n", down.as_secs()).as_bytes())
            .and_then(|_| control.flush())
            .map_err(|e| format!("restart postgres: {e}"))?;
        // Wait for the old server to go away before polling, or the poll sees it.
        let deadline = Instant::now() + READY_TIMEOUT;
        while self.ready() {
            if Instant::now() > deadline {
                return Err("postgres did not stop for its restart".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_secs(down.as_secs()));
        self.wait_ready()
    }

    /// The server's log so far (what it printed on stderr), for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    fn ready(&self) -> bool {
        command(&self.bin, "pg_isready", false)
            .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", USER, "-d", "postgres"])
            .status()
            .is_ok_and(|s| s.success())
    }

    fn wait_ready(&self) -> Result<(), String> {
        let deadline = Instant::now() + READY_TIMEOUT;
        while !self.ready() {
            if Instant::now() > deadline {
                return Err(format!(
                    "postgres did not accept connections within {READY_TIMEOUT:?}: {}",
                    self.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        Ok(())
    }
}

impl Drop for TempPostgres {
    fn drop(&mut self) {
        drop(self.control.take());
        let _ = self.guardian.wait();
    }
}

/// `bin/name`, run as the `postgres` user when `as_postgres`.
fn command(bin: &Path, name: &str, as_postgres: bool) -> Command {
    let program = bin.join(name);
    if as_postgres {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn run(c: &mut Command, what: &str) -> Result<(), String> {
    let out = c.stdin(Stdio::null()).output().map_err(|e| format!("{what}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()))
    }
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

fn free_port() -> Result<u16, String> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("find a free port: {e}"))?;
    listener.local_addr().map(|a| a.port()).map_err(|e| format!("find a free port: {e}"))
}

/// The directory holding `initdb`, `postgres`, `pg_isready` and `createdb`.
fn find_bin_dir() -> Result<PathBuf, String> {
    let has_all =
        |d: &Path| ["initdb", "postgres", "pg_isready", "createdb"].iter().all(|b| d.join(b).exists());
    if let Some(dir) = std::env::var_os("TRAINYARD_PG_BIN") {
        let dir = PathBuf::from(dir);
        return if has_all(&dir) {
            Ok(dir)
        } else {
            Err(format!("TRAINYARD_PG_BIN={} lacks initdb, postgres, pg_isready or createdb", dir.display()))
        };
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|d| std::fs::canonicalize(d.join("initdb")).ok())
        .filter_map(|p| p.parent().map(Path::to_path_buf));
    let mut debian: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| entries.filter_map(|e| e.ok()).map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    // Newest major version first.
    debian.sort_by_key(|d| std::cmp::Reverse(version_of(d)));
    on_path.chain(debian).find(|d| has_all(d)).ok_or_else(|| {
        "PostgreSQL server binaries (initdb, postgres) not found: run deploy/setup.sh, which installs \
         Debian's postgresql package, or set TRAINYARD_PG_BIN to their directory"
            .to_string()
    })
}

fn version_of(bin: &Path) -> u32 {
    bin.parent()
        .and_then(|v| v.file_name())
        .and_then(|v| v.to_str())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}
