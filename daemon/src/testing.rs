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

    /// Stops the server at once (as a crash would): the database is unreachable until
    /// `start_again`.
    pub fn crash(&self) -> Result<(), String> {
        self.pg_ctl(&["stop", "-m", "immediate"])
    }

    /// Starts a crashed server again on the same files.
    pub fn start_again(&self) -> Result<(), String> {
        self.pg_ctl_start()
    }

    /// Stops the server at once (as a crash would: nothing flushed beyond what committed
    /// transactions already made durable) and starts it again on the same files.
    pub fn restart_after_crash(&self) -> Result<(), String> {
        self.crash()?;
        self.start_again()
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

/// An S3-compatible server of its own (`s3s-fs`, from the Rust registry: `cargo install
/// s3s-fs --features binary`), serving one bucket from a temporary directory on a loopback
/// port, with credentials of its own; stopped on drop.
pub struct TestS3 {
    dir: tempfile::TempDir,
    child: Option<std::process::Child>,
    bin: PathBuf,
    port: u16,
}

const S3_BUCKET: &str = "agentvm";
const S3_KEY: &str = "agentvm-test";
const S3_SECRET: &str = "agentvm-test-secret";

impl TestS3 {
    pub fn start() -> Result<Self, String> {
        let bin = find_program("s3s-fs").ok_or(
            "s3s-fs is not installed (cargo install s3s-fs --features binary; scripts/setup.sh \
             does it)",
        )?;
        let dir = tempfile::Builder::new()
            .prefix("agentvm-s3-")
            .tempdir()
            .map_err(|e| format!("creating a directory for the S3 server: {e}"))?;
        let bucket = dir.path().join("data").join(S3_BUCKET);
        std::fs::create_dir_all(&bucket)
            .map_err(|e| format!("creating {}: {e}", bucket.display()))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("finding a free port: {e}"))?
            .port();
        let mut server = Self {
            dir,
            child: None,
            bin,
            port,
        };
        server.run()?;
        Ok(server)
    }

    fn run(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("server.log"))
            .map_err(|e| format!("opening the S3 server's log: {e}"))?;
        let child = Command::new(&self.bin)
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", S3_KEY, "--secret-key", S3_SECRET])
            .arg(self.dir.path().join("data"))
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", self.bin.display()))?;
        self.child = Some(child);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if std::time::Instant::now() > deadline {
                return Err(format!(
                    "the S3 server never listened on port {}: {}",
                    self.port,
                    std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Ok(())
    }

    /// Stops the server (the store becomes unreachable); `resume` starts it again on the
    /// same data and port.
    pub fn pause(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn resume(&mut self) -> Result<(), String> {
        self.run()
    }

    /// `--snapshot-url` for keys under `prefix`.
    pub fn url(&self, prefix: &str) -> String {
        format!("s3://{S3_BUCKET}/{prefix}")
    }

    /// The `AWS_*` environment that reaches this server.
    pub fn env(&self) -> Vec<(String, String)> {
        [
            (
                "AWS_ENDPOINT_URL",
                format!("http://127.0.0.1:{}", self.port),
            ),
            ("AWS_REGION", "us-east-1".to_owned()),
            ("AWS_ACCESS_KEY_ID", S3_KEY.to_owned()),
            ("AWS_SECRET_ACCESS_KEY", S3_SECRET.to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Where the server keeps object `key` of the bucket, for tests that damage one.
    pub fn object_file(&self, key: &str) -> PathBuf {
        self.dir.path().join("data").join(S3_BUCKET).join(key)
    }

    /// The objects the bucket holds (file names under the key prefix directories).
    pub fn objects(&self) -> Vec<String> {
        fn walk(dir: &Path, out: &mut Vec<String>) {
            for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    walk(&path, out);
                } else if let Some(name) = path.file_name().and_then(|n| n.to_str()) {
                    out.push(name.to_owned());
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.dir.path().join("data").join(S3_BUCKET), &mut out);
        out.sort();
        out
    }
}

impl Drop for TestS3 {
    fn drop(&mut self) {
        self.pause();
    }
}

/// `name` on PATH, or in cargo's bin directory.
fn find_program(name: &str) -> Option<PathBuf> {
    let cargo_bin = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .map(|home| home.join("bin"));
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain(cargo_bin)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}
