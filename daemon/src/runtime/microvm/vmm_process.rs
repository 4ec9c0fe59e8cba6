//! One agentvm-vmm process per session: started in the session's directory, driven only
//! through its Cloud Hypervisor API socket, and stopped politely first, by signal if it
//! does not go.
//!
//! A VMM runs in its own process group and does not die with the daemon: a restarted
//! agentvmd finds it again by its API socket (see `MicrovmRuntime::attach`).

use std::os::fd::AsFd;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use agentvm_vmm_api::VmmClient;

use super::exit_watch::ExitWatch;
use super::flavour::VmmFlavour;
pub use super::guest::VmmHealth;
use super::jail::Jail;

/// How long a fresh VMM has to answer `vmm.ping`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `vmm.shutdown` may take before the process is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// Paths of one session's VMM.
#[derive(Debug, Clone)]
pub struct VmmDir {
    pub dir: PathBuf,
    pub flavour: VmmFlavour,
    /// Where its guest RAM file goes; `private` when it is this VMM's alone (removed with it).
    pub ram: PathBuf,
    pub private_ram: bool,
    /// The bound on each call to its API.
    pub api_timeout: Duration,
}

impl VmmDir {
    pub fn new(dir: PathBuf, flavour: VmmFlavour, ram: PathBuf, private_ram: bool) -> Self {
        Self {
            dir,
            flavour,
            ram,
            private_ram,
            api_timeout: agentvm_vmm_api::client::DEFAULT_TIMEOUT,
        }
    }

    /// The same directory, its API calls bounded by `timeout`.
    pub fn with_api_timeout(mut self, timeout: Duration) -> Self {
        self.api_timeout = timeout;
        self
    }
    pub fn api(&self) -> PathBuf {
        self.dir.join("api.sock")
    }
    pub fn vsock(&self) -> PathBuf {
        self.dir.join("vsock.sock")
    }
    /// The session's workspace disk (a VM whose image asks for one).
    pub fn workspace(&self) -> PathBuf {
        self.dir.join("workspace.img")
    }

    pub fn serial(&self) -> PathBuf {
        self.dir.join("serial.log")
    }
    pub fn log(&self) -> PathBuf {
        self.dir.join("vmm.log")
    }
    /// Where root records the pid of this directory's VMM: beside the directory, in root's
    /// own `.pids/` (see [`pid_record`]), never inside the directory the VMM can write.
    pub fn pid_file(&self) -> PathBuf {
        pid_record(&self.dir)
    }
    /// The harness the guest serves, as the VM was created for.
    pub fn harness_file(&self) -> PathBuf {
        self.dir.join("harness")
    }
    /// Where a restore prepares what it restores from, when the VMM needs that.
    pub fn restore_scratch(&self) -> PathBuf {
        self.dir.join("restore")
    }
    /// Where the VMM writes a snapshot, inside its own directory; agentvmd moves it into the
    /// store once written.
    pub fn snapshot_outbox(&self) -> PathBuf {
        self.dir.join("snapshot")
    }
    /// Where the VMM writes turn checkpoint `id` layered on its last one, inside its own
    /// directory; agentvmd moves it into the store once written. Never reused: a daemon
    /// restarted mid-checkpoint finds the VMM may still be writing the last one.
    pub fn checkpoint_outbox(&self, id: &str) -> PathBuf {
        self.dir.join("checkpoints").join(id)
    }
    /// Where the VMM writes a live fork of its VM: in its RAM directory, so the VM's RAM file
    /// is linked there rather than copied, and the VM goes on running over it.
    pub fn fork_dir(&self, id: &str) -> PathBuf {
        self.forks().join(id)
    }
    fn forks(&self) -> PathBuf {
        match self.private_ram {
            true => self.ram.join("forks"),
            false => self.ram.join("agentvm-forks"),
        }
    }
    pub fn client(&self) -> VmmClient {
        VmmClient::new(self.api()).with_timeout(self.api_timeout)
    }

    /// [`Self::health`], for the guest protocol to watch while it waits.
    pub fn liveness(&self) -> super::guest::Liveness {
        let dir = self.clone();
        std::sync::Arc::new(move || dir.health())
    }

    /// Whether the VMM runs, is gone, or is alive but cannot run (stopped or frozen).
    pub fn health(&self) -> VmmHealth {
        match pid_of(self) {
            Some(pid) if self.vmm_alive() => match super::stall::stall(pid) {
                Some(stall) => VmmHealth::Stalled(stall.to_string()),
                None => VmmHealth::Running,
            },
            _ => VmmHealth::Gone,
        }
    }

    /// The VMM recorded in this directory is still running: its pid is alive and is still a
    /// VMM serving this directory's socket (a pid reused by another process is not).
    pub fn vmm_alive(&self) -> bool {
        let Some(pid) = pid_of(self) else {
            return false;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        // A VMM from the pool was started with the pool's socket, moved here since.
        let api = read_record(self)
            .and_then(|r| r.pooled_api)
            .unwrap_or_else(|| self.api());
        alive(pid)
            && cmdline
                .split(|b| *b == 0)
                .any(|arg| self.flavour.names_api_socket(arg, &api))
    }
}

/// A VMM that answers its API, on its way into its cgroups.
pub struct Spawned {
    pub pid: u32,
    pub confined: Confinement,
}

/// The move of a new VMM into its cgroups. A cgroup (v1) migration waits for an RCU grace
/// period (about 10 ms here), so it runs beside the VMM's start-up and the VM's creation or
/// restore; the guest must not run before it is done (its memory is charged where its
/// VMM is when it faults the pages in).
pub struct Confinement(tokio::task::JoinHandle<Result<(), String>>);

impl Confinement {
    pub async fn wait(self) -> Result<(), String> {
        self.0
            .await
            .unwrap_or_else(|e| Err(format!("joining its cgroups: {e}")))
    }
}

/// Starts a VMM serving its API in `dir` (already created, with its RAM directory), jailed
/// when `jail` is given, starts moving it into the cgroups of `cgroup_procs`, and waits until
/// it answers. From the moment it runs, `watch` reaps it and reports an exit nobody asked
/// for.
pub async fn spawn(
    binary: &Path,
    dir: &VmmDir,
    watch: &ExitWatch,
    jail: Option<&Jail>,
    cgroup_procs: Vec<PathBuf>,
) -> Result<Spawned, String> {
    let pid = launch(binary, dir.flavour, &dir.dir, &dir.ram, jail, None)?;
    watch.watch(dir.clone(), pid);
    let confined = Confinement(tokio::task::spawn_blocking(move || {
        super::cgroups::join(&cgroup_procs, pid)
    }));
    if let Err(e) = dir.client().wait_ready(READY_TIMEOUT).await {
        watch.expect_exit(pid);
        kill(pid);
        return Err(format!("the VMM did not come up: {e}"));
    }
    Ok(Spawned { pid, confined })
}

/// Starts a VMM serving its API on `in_dir/api.sock`, logging to `in_dir/vmm.log`, its pid
/// on root's record ([`record_pid`]), its VMs' RAM in `ram_dir` (`none`: memfds), jailed when `jail` is
/// given. With `anchor` (a pipe's read end; agentvm-vmm only) it exits once the pipe's
/// writers are gone unless it was asked for a VM by then. Blocking: the clone waits until
/// the VMM has exec'd.
pub fn launch(
    binary: &Path,
    flavour: VmmFlavour,
    in_dir: &Path,
    ram_dir: &Path,
    jail: Option<&Jail>,
    anchor: Option<std::os::fd::BorrowedFd>,
) -> Result<u32, String> {
    let api = in_dir.join("api.sock");
    let log_path = in_dir.join("vmm.log");
    let log = std::fs::File::create(&log_path)
        .map_err(|e| format!("creating {}: {e}", log_path.display()))?;
    // Bound here and handed down where the VMM can take it: the first request then waits
    // in the backlog until the VMM serves, instead of polling for the socket.
    let listener = match flavour.takes_api_listener() {
        true => Some(
            agentvm_vmm_api::bind_api_listener(&api)
                .map_err(|e| format!("binding the VMM's API socket: {e}"))?,
        ),
        false => None,
    };
    // Its own process group (a signal for the daemon is not one for its VMs), no handle:
    // the exit watch reaps it through its pidfd.
    let mut args = flavour.args(
        &api,
        ram_dir,
        listener.as_ref().map(|_| super::jail::INHERITED_FD),
    );
    if anchor.is_some() {
        args.extend([
            "--exit-with-fd".into(),
            super::jail::ANCHOR_FD.to_string().into(),
        ]);
    }
    let pid = super::jail::spawn(&super::jail::Command {
        binary,
        args: &args,
        env: &[("AGENTVM_VMM_LOG", "warn")],
        output: &log,
        jail,
        listener: listener.as_ref().map(|l| l.as_fd()),
        anchor,
    })?;
    // The VMM's now; a copy here would keep connections queueing after it died.
    drop(listener);
    if let Err(e) = record_pid(in_dir, pid, None) {
        tracing::warn!(pid, error = %e, "the VMM's pid is not on record");
    }
    Ok(pid)
}

/// Root's directory of VMM pids, beside the VMMs' own directories.
const PID_RECORDS: &str = ".pids";

/// Where root records the pid of the VMM of directory `dir`: `PARENT/.pids/NAME`. The
/// parent (`vms/`) and `.pids/` are root's, so a VMM, which can rewrite everything in its own
/// directory, cannot touch what root reads back to find, stop or adopt it.
pub fn pid_record(dir: &Path) -> PathBuf {
    let name = dir.file_name().unwrap_or_default();
    dir.parent()
        .unwrap_or(Path::new("/"))
        .join(PID_RECORDS)
        .join(name)
}

/// Records `pid` as the VMM of `dir` (see [`pid_record`]), with the API socket it was
/// started on when that was a pool slot's (its command line names that one, not `dir`'s).
pub fn record_pid(dir: &Path, pid: u32, pooled_api: Option<&Path>) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    let record = pid_record(dir);
    if let Some(records) = record.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(records)
            .map_err(|e| format!("creating {}: {e}", records.display()))?;
    }
    let mut text = format!("{pid}\n").into_bytes();
    if let Some(api) = pooled_api {
        text.extend_from_slice(api.as_os_str().as_encoded_bytes());
        text.push(b'\n');
    }
    write_vmm_file(&record, &text)?;
    // For operators and tools: `vms/SESSION/vmm.pid`. The VMM can rewrite it; root never
    // reads it back.
    let _ = write_vmm_file(&dir.join("vmm.pid"), pid.to_string().as_bytes());
    Ok(())
}

/// What root recorded of a VMM.
struct Record {
    pid: u32,
    pooled_api: Option<PathBuf>,
}

fn read_record(dir: &VmmDir) -> Option<Record> {
    let bytes = read_vmm_file(&dir.pid_file(), 4096)?;
    let mut lines = bytes.split(|b| *b == b'\n');
    let pid = std::str::from_utf8(lines.next()?)
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let pooled_api = lines
        .next()
        .filter(|l| !l.is_empty())
        .map(|l| PathBuf::from(std::ffi::OsString::from_vec(l.to_vec())));
    Some(Record { pid, pooled_api })
}

/// Moves the record of the VMM of `from` to `to` (its directory was renamed).
pub fn move_pid(from: &Path, to: &Path) {
    let _ = std::fs::rename(pid_record(from), pid_record(to));
}

/// Forgets the pid on record for `dir`.
pub fn forget_pid(dir: &Path) {
    let _ = std::fs::remove_file(pid_record(dir));
}

/// Makes the pooled VMM `pooled`, already shown its files, the VMM of `dir`: its socket,
/// log and pid move there, `watch` watches it, it starts moving into the cgroups of
/// `cgroup_procs`, and it is told where its VM's RAM goes.
pub async fn adopt(
    dir: &VmmDir,
    pooled: &super::pool::Pooled,
    watch: &ExitWatch,
    cgroup_procs: Vec<PathBuf>,
) -> Result<Spawned, String> {
    let pid = pooled.pid;
    let started = std::time::Instant::now();
    let moved = record_pid(&dir.dir, pid, Some(&pooled.api())).and_then(|()| {
        std::fs::rename(pooled.api(), dir.api())
            .and_then(|()| std::fs::rename(pooled.slot.join("vmm.log"), dir.log()))
            .map_err(|e| e.to_string())
    });
    if let Err(e) = moved {
        kill(pid);
        return Err(format!(
            "moving the pooled VMM into {}: {e}",
            dir.dir.display()
        ));
    }
    // Its uid is on record in `dir` now, its pid under the session's name.
    let _ = std::fs::remove_dir_all(&pooled.slot);
    forget_pid(&pooled.slot);
    watch.watch(dir.clone(), pid);
    let confined = Confinement(tokio::task::spawn_blocking(move || {
        super::cgroups::join(&cgroup_procs, pid)
    }));
    let moved = started.elapsed();
    let told = tokio::time::timeout(READY_TIMEOUT, dir.client().set_ram_dir(Some(&dir.ram))).await;
    tracing::debug!(
        pid,
        moved_ms = moved.as_secs_f64() * 1e3,
        told_ms = started.elapsed().as_secs_f64() * 1e3,
        "pooled VMM adopted"
    );
    match told {
        Ok(Ok(())) => Ok(Spawned { pid, confined }),
        failed => {
            watch.expect_exit(pid);
            kill(pid);
            Err(format!(
                "the pooled VMM did not take its RAM directory: {failed:?}"
            ))
        }
    }
}

/// The sessions with a VMM directory in `run_dir` (the jail's staging directory is not one).
pub fn sessions(run_dir: &Path) -> Vec<String> {
    names(run_dir, |name| !name.starts_with('.'))
}

/// The directories in `run_dir` of VMMs that were stopping (`.retired-…`).
pub fn retired(run_dir: &Path) -> Vec<String> {
    names(run_dir, |name| name.starts_with(super::RETIRED))
}

fn names(run_dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(run_dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|name| keep(name))
        .collect()
}

/// The VMM's process id, as root recorded it, if that still names a process of the VMM's
/// own user.
///
/// The record is root's (outside the directory the VMM can write), and the process is
/// checked too: a pid reused by another process since is not the VMM unless that process
/// runs, with every one of its uids, as the user that owns the VMM's directory.
pub fn pid_of(dir: &VmmDir) -> Option<u32> {
    pinned_vmm(dir).map(|p| p.pid)
}

/// The VMM of `dir` (as [`pid_of`] finds it), pinned by a pidfd taken *before* its identity
/// was checked: a signal sent through it reaches that process or none, even if it exits
/// and its pid is reused by then.
pub fn pinned_vmm(dir: &VmmDir) -> Option<Pinned> {
    use std::os::unix::fs::MetadataExt;
    let owner = std::fs::symlink_metadata(&dir.dir).ok()?.uid();
    let claimed = recorded_pid(dir).filter(|&pid| pid > 1)?;
    let pinned = Pinned::open(claimed)?;
    runs_as(claimed, owner).then_some(pinned)
}

/// A process held by a pidfd.
#[derive(Debug)]
pub struct Pinned {
    pub pid: u32,
    fd: std::os::fd::OwnedFd,
}

impl Pinned {
    /// Pins `pid` (None once it is gone).
    pub fn open(pid: u32) -> Option<Self> {
        let fd = crate::sys::pidfd_open(pid).ok()?;
        Some(Self { pid, fd })
    }

    /// Sends `signal` (0: only whether it may be signalled) to the pinned process.
    fn signal(&self, signal: i32) -> bool {
        use std::os::fd::AsFd;
        crate::sys::pidfd_send_signal(self.fd.as_fd(), signal).is_ok()
    }

    /// Whether the pinned process still runs (a finished zombie does not).
    pub fn alive(&self) -> bool {
        self.signal(0) && !finished_zombie(self.pid)
    }

    pub fn kill(&self) {
        self.signal(libc::SIGKILL);
    }
}

/// The pid root recorded for the VMM of `dir` in its `.pids/` (or, for a directory root
/// renamed out of its session's way, in the name root gave it: `.retired-SESSION-PID`).
pub fn recorded_pid(dir: &VmmDir) -> Option<u32> {
    if let Some(record) = read_record(dir) {
        return Some(record.pid);
    }
    // A crash between the rename and the record's move: the name says it.
    let name = dir.dir.file_name()?.to_str()?;
    match name.starts_with(super::RETIRED) {
        true => name.rsplit_once('-')?.1.parse().ok(),
        false => None,
    }
}

/// A small file in a directory the VMM can write: read without following a symlink it may
/// have planted, and only if it is a regular file of at most `max` bytes (a FIFO or
/// /dev/zero in its place must not hang or flood the daemon).
pub(super) fn read_vmm_file(path: &Path, max: u64) -> Option<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() || meta.len() > max {
        return None;
    }
    let mut bytes = Vec::new();
    file.take(max).read_to_end(&mut bytes).ok()?;
    Some(bytes)
}

/// Writes `bytes` to `path` in a directory the VMM can write: never through a symlink it may
/// have planted there (root would write wherever it points), truncating a regular file.
pub(super) fn write_vmm_file(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return Err(format!("writing {}: not a regular file", path.display()));
    }
    file.write_all(bytes)
        .map_err(|e| format!("writing {}: {e}", path.display()))
}

/// Whether process `pid` runs as `uid`: its real, effective, saved and filesystem uids all.
pub fn runs_as(pid: u32, uid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .is_some_and(|ids| {
            let ids: Vec<&str> = ids.split_whitespace().collect();
            ids.len() == 4 && ids.iter().all(|id| id.parse() == Ok(uid))
        })
}

/// Whether `pid` still runs. A finished zombie does not: a VMM adopted from a dead daemon
/// has init (or a subreaper) as its parent, which may take its time to reap it.
pub fn alive(pid: u32) -> bool {
    // Signal 0 only checks that the process exists and may be signalled.
    pid != 0 && signal(pid, None).is_ok() && !finished_zombie(pid)
}

/// The process is a zombie with no thread left: its leader's state (after the parenthesised
/// name, which may hold spaces) is Z and its task list holds only the leader. A leader that
/// exited first reads Z while its other threads still run (and still hold its cgroups).
fn finished_zombie(pid: u32) -> bool {
    process_state(pid) == Some('Z')
        && std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|tasks| tasks.count() <= 1)
}

/// The state letter of process `pid` (`R`, `S`, `T`, `Z`, …): in `/proc/PID/stat` it follows
/// the parenthesised command name, which may hold anything.
pub(super) fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

pub fn kill(pid: u32) {
    if pid != 0 {
        let _ = signal(pid, Some(nix::sys::signal::Signal::SIGKILL));
    }
}

fn signal(pid: u32, signal: Option<nix::sys::signal::Signal>) -> nix::Result<()> {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal)
}

/// Removes what the VMM in `dir` left on the host: its directory and private RAM directory.
pub fn remove_files(dir: &VmmDir) {
    let _ = std::fs::remove_dir_all(&dir.dir);
    super::network::forget(&dir.dir);
    forget_pid(&dir.dir);
    if dir.private_ram {
        let _ = std::fs::remove_dir_all(&dir.ram);
        return;
    }
    // Live forks in the shared RAM directory are named after their session.
    let Some(session) = dir.dir.file_name().and_then(|n| n.to_str()) else {
        return;
    };
    let prefix = format!("{session}-");
    for entry in std::fs::read_dir(dir.forks())
        .into_iter()
        .flatten()
        .flatten()
    {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Shuts the VMM down through its API, kills it if that does not work in time, and removes
/// its files.
pub async fn stop(dir: &VmmDir, watch: &ExitWatch) {
    let stopping = ask_stop(dir, watch).await;
    stopping.exited().await;
    stopping.remove_files();
}

/// A VMM asked to shut down. It answers before tearing its VM down (which takes the kernel
/// milliseconds), so the asking is quick and the rest can wait.
pub struct Stopping {
    dir: VmmDir,
    vmm: Option<Pinned>,
    polite: bool,
    asked: Duration,
    started: std::time::Instant,
}

/// Asks the VMM in `dir` to shut down; its exit is expected from now on.
pub async fn ask_stop(dir: &VmmDir, watch: &ExitWatch) -> Stopping {
    let vmm = pinned_vmm(dir);
    if let Some(vmm) = &vmm {
        watch.expect_exit(vmm.pid);
    }
    let started = std::time::Instant::now();
    // A VMM that cannot run cannot answer either: asking would only wait out the timeout.
    let stall = vmm.as_ref().and_then(|vmm| super::stall::stall(vmm.pid));
    if let (Some(pinned), Some(stall)) = (&vmm, stall) {
        tracing::info!(pid = pinned.pid, %stall, "killing a VMM that cannot run");
        super::stall::kill(pinned, &stall);
        return Stopping {
            dir: dir.clone(),
            vmm,
            polite: false,
            asked: started.elapsed(),
            started,
        };
    }
    let polite = tokio::time::timeout(STOP_TIMEOUT, dir.client().shutdown_vmm()).await;
    Stopping {
        dir: dir.clone(),
        vmm,
        polite: matches!(polite, Ok(Ok(()))),
        asked: started.elapsed(),
        started,
    }
}

impl Stopping {
    /// The directory it is stopping from, once moved to `dir`.
    pub fn moved_to(mut self, dir: VmmDir) -> Self {
        self.dir = dir;
        self
    }

    pub fn pid(&self) -> Option<u32> {
        self.vmm.as_ref().map(|vmm| vmm.pid)
    }

    /// Waits until the VMM is gone, killing it (through its pidfd) if it does not go in
    /// time.
    pub async fn exited(&self) {
        if let Some(vmm) = &self.vmm {
            let deadline = tokio::time::Instant::now() + STOP_TIMEOUT;
            while vmm.alive() && tokio::time::Instant::now() < deadline && self.polite {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            if vmm.alive() {
                vmm.kill();
            }
        }
    }

    pub fn remove_files(&self) {
        remove_files(&self.dir);
        tracing::debug!(
            dir = %self.dir.dir.display(),
            polite = self.polite,
            asked_ms = self.asked.as_millis() as u64,
            total_ms = self.started.elapsed().as_millis() as u64,
            "VMM stopped"
        );
    }
}

/// Makes `path` a disk of `bytes` in `dir`: a copy of `template`'s data pages, or blank
/// (sparse) without one. It is owned like the directory: the VMM in its jail runs as the
/// directory's owner and opens the disk read-write.
pub fn new_disk(
    dir: &VmmDir,
    path: &Path,
    bytes: u64,
    template: Option<&Path>,
) -> Result<(), String> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let owner = std::fs::metadata(&dir.dir).map_err(|e| format!("{}: {e}", dir.dir.display()))?;
    let made = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|file| {
            if let Some(template) = template {
                agentvm_snapshot::pages::copy_sparse(&std::fs::File::open(template)?, &file)?;
            }
            file.set_len(bytes)
        })
        .and_then(|()| std::os::unix::fs::chown(path, Some(owner.uid()), Some(owner.gid())));
    made.map_err(|e| format!("making the workspace disk {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    /// A VMM's uid can rewrite its pid file: root must then act on none of root's processes,
    /// nor follow a link it planted, nor hang on a FIFO in its place.
    #[test]
    fn root_writes_no_file_through_a_link_the_vmm_planted() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("root-owned");
        std::fs::write(&victim, b"root's").unwrap();
        let planted = dir.path().join("harness");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        assert!(write_vmm_file(&planted, b"testguest").is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"root's");
        // A regular file is written (truncated), and read back only as a small regular file.
        std::fs::remove_file(&planted).unwrap();
        std::fs::write(&planted, b"something much longer").unwrap();
        write_vmm_file(&planted, b"testguest").unwrap();
        assert_eq!(read_vmm_file(&planted, 256).unwrap(), b"testguest");
        assert_eq!(read_vmm_file(&planted, 4), None);
    }

    /// Root keeps its own record of each VMM's pid beside the VMMs' directories: what a VMM
    /// writes in its own directory is never read back, a directory renamed out of its
    /// session's way takes its record along, and a removed one's record goes.
    #[test]
    fn root_finds_its_vmms_by_its_own_record() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let vms = tmp.path().join("vms");
        std::fs::create_dir(&vms).unwrap();
        let vmm = VmmDir::new(
            vms.join("sess"),
            VmmFlavour::Agentvm,
            tmp.path().join("ram"),
            true,
        );
        std::fs::create_dir(&vmm.dir).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        record_pid(&vmm.dir, child.id(), None).unwrap();
        assert_eq!(pid_of(&vmm), Some(child.id()));
        let records = vms.join(PID_RECORDS);
        assert_eq!(
            std::fs::metadata(&records).unwrap().permissions().mode() & 0o777,
            0o700
        );
        // The VMM's own copy, rewritten: not what root goes by.
        std::fs::write(vmm.dir.join("vmm.pid"), "1").unwrap();
        assert_eq!(pid_of(&vmm), Some(child.id()));

        let retired = VmmDir::new(
            vms.join(format!("{}sess-{}", super::super::RETIRED, child.id())),
            VmmFlavour::Agentvm,
            tmp.path().join("ram2"),
            true,
        );
        std::fs::rename(&vmm.dir, &retired.dir).unwrap();
        move_pid(&vmm.dir, &retired.dir);
        assert_eq!(
            pid_of(&vmm),
            None,
            "the session's name is free for its next VMM"
        );
        assert_eq!(pid_of(&retired), Some(child.id()));
        remove_files(&retired);
        assert_eq!(
            recorded_pid(&retired),
            Some(child.id()),
            "the name still says it"
        );
        assert!(!pid_record(&retired.dir).exists());
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A pidfd follows its process, not its number: once the process is reaped, signals
    /// through it go nowhere, whoever gets the number next.
    #[test]
    fn a_pinned_vmm_is_signalled_only_while_that_process_lives() {
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pinned = Pinned::open(child.id()).expect("pidfd_open on a live child");
        assert!(pinned.alive());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!pinned.alive(), "a reaped process still counts as alive");
        assert!(!pinned.signal(0), "a signal reached a reaped process's pid");
        pinned.kill();
    }

    #[test]
    fn a_rewritten_pid_file_steers_root_to_nothing_but_the_vmms_own_processes() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: needs root to give the VMM directory another owner");
            return;
        }
        const VM_UID: u32 = 65534;
        let tmp = tempfile::tempdir().unwrap();
        let dir = VmmDir::new(
            tmp.path().join("sess"),
            VmmFlavour::Agentvm,
            tmp.path().join("ram"),
            true,
        );
        std::fs::create_dir(&dir.dir).unwrap();
        std::os::unix::fs::chown(&dir.dir, Some(VM_UID), Some(VM_UID)).unwrap();
        // Root's record is out of the VMM's reach; here it says whatever a bug or a
        // restore of old state could make it say, and root still checks the process.
        std::fs::create_dir(dir.pid_file().parent().unwrap()).unwrap();
        let spawn = |uid: Option<u32>| {
            let mut cmd = std::process::Command::new("sleep");
            cmd.arg("60");
            if let Some(uid) = uid {
                cmd.uid(uid).gid(uid);
            }
            cmd.spawn().unwrap()
        };
        let mut roots = spawn(None);
        let vmms = spawn(Some(VM_UID));

        std::fs::write(dir.pid_file(), roots.id().to_string()).unwrap();
        assert_eq!(pid_of(&dir), None, "root's process is not the VMM's");
        assert!(!dir.vmm_alive());
        std::fs::write(dir.pid_file(), "1").unwrap();
        assert_eq!(pid_of(&dir), None);
        std::fs::write(dir.pid_file(), vmms.id().to_string()).unwrap();
        assert_eq!(pid_of(&dir), Some(vmms.id()));

        // A link to a root-owned file naming root's process, and a FIFO: neither is read.
        let elsewhere = tmp.path().join("root-pid");
        std::fs::write(&elsewhere, roots.id().to_string()).unwrap();
        std::fs::remove_file(dir.pid_file()).unwrap();
        std::os::unix::fs::symlink(&elsewhere, dir.pid_file()).unwrap();
        assert_eq!(pid_of(&dir), None);
        std::fs::remove_file(dir.pid_file()).unwrap();
        nix::unistd::mkfifo(&dir.pid_file(), nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert_eq!(pid_of(&dir), None);

        // Stopping that "VMM" kills nothing of root's.
        std::fs::remove_file(dir.pid_file()).unwrap();
        std::fs::write(dir.pid_file(), roots.id().to_string()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let watch = ExitWatch::default();
            let stopping = ask_stop(&dir, &watch).await;
            assert_eq!(stopping.pid(), None);
            stopping.exited().await;
        });
        assert!(
            roots.try_wait().unwrap().is_none(),
            "root's process was killed"
        );
        for mut child in [roots, vmms] {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }
}
