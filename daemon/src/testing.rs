//! Real servers for tests and benchmarks, started on this machine and stopped with their
//! handle: a PostgreSQL from the host's packages, in a temporary directory, reached over a
//! unix socket only.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A PostgreSQL server of its own: initdb'd into a temporary directory, listening only on a
/// unix socket there, trusting local connections, stopped (and its files removed) on drop.
pub struct TestPostgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// `(uid, gid)` the server runs as: PostgreSQL refuses to run as root.
    owner: Option<(u32, u32)>,
}

const USER: &str = "agentvm";

impl TestPostgres {
    /// Starts a server, or says why it cannot (PostgreSQL not installed, say).
    pub fn start() -> Result<Self, String> {
        let bin = bindir()?;
        let dir = tempfile::Builder::new()
            .prefix("agentvm-pg-")
            .tempdir()
            .map_err(|e| format!("creating a directory for PostgreSQL: {e}"))?;
        let owner = match std::fs::metadata("/proc/self").map(|m| {
            use std::os::unix::fs::MetadataExt;
            m.uid()
        }) {
            Ok(0) => {
                let owner = passwd_entry("postgres").ok_or(
                    "running as root and there is no `postgres` user to run PostgreSQL as",
                )?;
                std::os::unix::fs::chown(dir.path(), Some(owner.0), Some(owner.1))
                    .map_err(|e| format!("chown {}: {e}", dir.path().display()))?;
                Some(owner)
            }
            _ => None,
        };
        let server = Self { dir, bin, owner };
        server.run(
            "initdb",
            &[
                "-D".as_ref(),
                server.data().as_os_str(),
                "-U".as_ref(),
                USER.as_ref(),
                "-A".as_ref(),
                "trust".as_ref(),
                "-E".as_ref(),
                "UTF8".as_ref(),
                "--no-sync".as_ref(),
            ],
        )?;
        server.pg_ctl_start()?;
        Ok(server)
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The directory holding the server's socket.
    pub fn socket_dir(&self) -> &Path {
        self.dir.path()
    }

    /// A connection URL for database `db`.
    pub fn url(&self, db: &str) -> String {
        format!(
            "postgresql:///{db}?host={}&user={USER}",
            self.socket_dir().display()
        )
    }

    /// Creates database `name` (empty).
    pub fn create_database(&self, name: &str) -> Result<(), String> {
        self.run(
            "createdb",
            &[
                "-h".as_ref(),
                self.socket_dir().as_os_str(),
                "-U".as_ref(),
                USER.as_ref(),
                name.as_ref(),
            ],
        )
    }

    /// Stops the server at once (as a crash would: nothing flushed beyond what committed
    /// transactions already made durable) and starts it again on the same files.
    pub fn restart_after_crash(&self) -> Result<(), String> {
        self.pg_ctl(&["stop", "-m", "immediate"])?;
        self.pg_ctl_start()
    }

    fn pg_ctl_start(&self) -> Result<(), String> {
        let options = format!(
            "-k {} -c listen_addresses='' -c fsync=on",
            self.socket_dir().display()
        );
        let log = self.dir.path().join("server.log");
        let log = log.to_string_lossy().into_owned();
        self.pg_ctl(&["start", "-w", "-l", &log, "-o", &options])
    }

    fn pg_ctl(&self, args: &[&str]) -> Result<(), String> {
        let data = self.data();
        let mut all: Vec<&std::ffi::OsStr> = vec!["-D".as_ref(), data.as_os_str()];
        all.extend(args.iter().map(std::ffi::OsStr::new));
        self.run("pg_ctl", &all)
    }

    fn run(&self, program: &str, args: &[&std::ffi::OsStr]) -> Result<(), String> {
        let mut command = Command::new(self.bin.join(program));
        command.args(args).current_dir(self.dir.path());
        if let Some((uid, gid)) = self.owner {
            command.uid(uid).gid(gid);
        }
        let out = command
            .output()
            .map_err(|e| format!("running {program}: {e}"))?;
        if !out.status.success() {
            let log =
                std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
            return Err(format!(
                "{program} {args:?}: {}\n{}\n{}\nserver log:\n{log}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(())
    }
}

impl Drop for TestPostgres {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["stop", "-m", "immediate"]);
    }
}

/// The newest installed PostgreSQL's programs (Debian: /usr/lib/postgresql/N/bin).
fn bindir() -> Result<PathBuf, String> {
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(root)
        .map_err(|e| format!("PostgreSQL is not installed ({}: {e})", root.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .ok_or_else(|| format!("no PostgreSQL server under {}", root.display()))
}

/// `(uid, gid)` of a user in /etc/passwd.
fn passwd_entry(name: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        (fields.next()? == name).then_some(())?;
        let _password = fields.next()?;
        Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
    })
}
