//! Templates: a new session starts from its image's booted, ready VM, restored
//! copy-on-write, instead of booting the image.
//!
//! Why: a boot costs the kernel, the agent as PID 1, the root filesystem and the harness's
//! own start (a Python or Node harness's imports alone take hundreds of milliseconds), and
//! every session of an image pays it for the same result. The first session of an image
//! (or `agentvm image warm`, or `warm_templates` at start) boots one VM of it, waits until
//! its agent is ready and its harness has answered Describe, and snapshots it into the
//! store as `template.HARNESS.KEY`; every later session restores that snapshot (its memory
//! file mapped copy-on-write, so sessions share the pages nobody wrote) and is told its own
//! identity, entropy, clock and network before anything else reaches it, exactly as a fork
//! child is. The template's own VM is stopped once it is saved; it never serves a session.
//!
//! The key is everything the saved VM depends on: the image's files (by content), its
//! command line and shape (vCPUs, memory, disks, network), the VMM binary (by content) and
//! flavour, this daemon's version, and the host CPU's model and features (a snapshot
//! restored on another CPU model is refused by the VMM anyway). A change of any of them
//! makes a new template; ones no image has as its key any more are deleted once no session
//! maps them (the store keeps a snapshot while it has holders or layers).

use super::lock;
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::GuestImage;

/// Prefix of every template's snapshot id (never a session's `SESSION-EPOCH-N`).
pub const ID_PREFIX: &str = "template.";
/// Bumped when what a template holds or how it is made changes.
const FORMAT: &str = "1";
/// Prefix of the name a template's VM runs under (its VMM directory's).
const VM_PREFIX: &str = "template-";

/// Whether `name` is a template's VM rather than a session's.
pub fn is_template_vm(name: &str) -> bool {
    name.starts_with(VM_PREFIX)
}

/// How long after a template could not be made sessions of its key boot without trying.
const RETRY_AFTER: Duration = Duration::from_secs(300);

/// How a session's current VM started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartPath {
    /// Restored from its image's template.
    Template,
    /// Booted its image.
    Boot,
    /// Restored from its own snapshot (a resume).
    Restore,
    /// Restored from its parent's snapshot (a fork child).
    Fork,
}

impl StartPath {
    pub fn name(self) -> &'static str {
        match self {
            StartPath::Template => "template",
            StartPath::Boot => "boot",
            StartPath::Restore => "restore",
            StartPath::Fork => "fork",
        }
    }
}

/// A template's identity: its snapshot id and what went into its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateKey {
    pub id: String,
    pub parts: Vec<(&'static str, String)>,
}

/// What a file is, as far as its digest goes: a file whose identity and times are unchanged
/// is not hashed again.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct FileStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl FileStamp {
    fn of(meta: &std::fs::Metadata) -> Self {
        FileStamp {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
        }
    }
}

/// The runtime's templates: keys, the one-at-a-time making of each, and what failed.
#[derive(Default)]
pub struct Templates {
    digests: Mutex<HashMap<FileStamp, String>>,
    /// Held while a key's template is made, so concurrent first sessions wait for one.
    making: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    failed: Mutex<HashMap<String, Instant>>,
    /// How each session's current VM started.
    starts: Mutex<HashMap<String, StartPath>>,
    /// Each image's key as last computed, by harness.
    current: Mutex<HashMap<String, String>>,
}

impl Templates {
    /// The sha256 of `path`'s contents (cached while the file is unchanged).
    pub fn file_digest(&self, path: &Path) -> std::io::Result<String> {
        let file = std::fs::File::open(path)?;
        let stamp = FileStamp::of(&file.metadata()?);
        if let Some(known) = lock(&self.digests).get(&stamp) {
            return Ok(known.clone());
        }
        let mut hasher = Sha256::new();
        std::io::copy(&mut std::io::BufReader::new(file), &mut hasher)?;
        let digest = hex::encode(hasher.finalize());
        lock(&self.digests).insert(stamp, digest.clone());
        Ok(digest)
    }

    /// The key of `image`'s template on a node whose VMs boot with `cmdline` (what the
    /// runtime adds to the image's own), with `vmm` of `flavour`, on `cpu`.
    pub fn key(
        &self,
        image: &GuestImage,
        shape: &VmShape,
        vmm: &Path,
        cpu: &str,
    ) -> std::io::Result<TemplateKey> {
        let file = |path: Option<&Path>| -> std::io::Result<String> {
            path.map_or(Ok("none".to_owned()), |p| self.file_digest(p))
        };
        let parts = vec![
            ("format", FORMAT.to_owned()),
            ("agentvmd", env!("CARGO_PKG_VERSION").to_owned()),
            ("harness", image.harness.clone()),
            ("kernel", file(Some(&image.kernel))?),
            ("initramfs", file(image.initramfs.as_deref())?),
            ("rootfs", file(image.rootfs.as_deref())?),
            ("workspace", file(image.workspace_template.as_deref())?),
            ("workspace_mib", image.workspace_mib.to_string()),
            ("cmdline", format!("{} | {}", shape.cmdline, image.cmdline)),
            ("vcpus", shape.vcpus.to_string()),
            ("memory_mib", shape.memory_mib.to_string()),
            ("network", image.network.is_some().to_string()),
            ("vmm", file(Some(vmm))?),
            ("flavour", shape.flavour.to_owned()),
            ("cpu", cpu.to_owned()),
        ];
        let mut hasher = Sha256::new();
        for (name, value) in &parts {
            hasher.update(name.as_bytes());
            hasher.update([0]);
            hasher.update(value.as_bytes());
            hasher.update([0]);
        }
        let digest = hex::encode(hasher.finalize());
        Ok(TemplateKey {
            id: format!("{ID_PREFIX}{}.{}", id_safe(&image.harness), &digest[..24]),
            parts,
        })
    }

    /// The lock under which `id`'s template is made.
    pub fn making(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.making).entry(id.to_owned()).or_default().clone()
    }

    /// Whether making `id` failed lately (sessions then boot without trying).
    pub fn failed_lately(&self, id: &str) -> bool {
        lock(&self.failed)
            .get(id)
            .is_some_and(|at| at.elapsed() < RETRY_AFTER)
    }

    pub fn mark_failed(&self, id: &str) {
        lock(&self.failed).insert(id.to_owned(), Instant::now());
    }

    pub fn remember_current(&self, harness: &str, id: &str) {
        lock(&self.current).insert(harness.to_owned(), id.to_owned());
    }

    /// The key `harness`'s image had when it was last computed.
    pub fn current(&self, harness: &str) -> Option<String> {
        lock(&self.current).get(harness).cloned()
    }

    pub fn record_start(&self, session: &str, path: StartPath) {
        lock(&self.starts).insert(session.to_owned(), path);
    }

    pub fn forget_start(&self, session: &str) {
        lock(&self.starts).remove(session);
    }

    /// How each session with a VM now got it.
    pub fn starts(&self) -> Vec<(String, StartPath)> {
        let mut all: Vec<_> = lock(&self.starts)
            .iter()
            .map(|(s, p)| (s.clone(), *p))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }
}

/// What the runtime makes of every VM of an image beyond the image's own files.
#[derive(Debug, Clone)]
pub struct VmShape {
    pub vcpus: u8,
    pub memory_mib: u64,
    /// The command line the runtime puts before the image's (without the session).
    pub cmdline: String,
    pub flavour: &'static str,
}

/// A harness name as part of a snapshot id (the store's alphabet).
fn id_safe(harness: &str) -> String {
    harness
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '-' | '_' => c,
            _ => '_',
        })
        .take(48)
        .collect()
}

/// The host CPU as a restored VM depends on it: vendor, family, model, stepping and feature
/// flags of its first processor.
pub fn host_cpu() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    cpu_identity(&info)
}

fn cpu_identity(cpuinfo: &str) -> String {
    let first = cpuinfo.split("\n\n").next().unwrap_or_default();
    let mut out = Vec::new();
    for key in [
        "vendor_id",
        "cpu family",
        "model",
        "model name",
        "stepping",
        "flags",
    ] {
        let value = first
            .lines()
            .filter_map(|line| line.split_once(':'))
            .find(|(k, _)| k.trim() == key)
            .map_or("", |(_, v)| v.trim());
        out.push(format!("{key}={value}"));
    }
    let mut hasher = Sha256::new();
    hasher.update(out.join("\n").as_bytes());
    hex::encode(&hasher.finalize()[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> VmShape {
        VmShape {
            vcpus: 1,
            memory_mib: 64,
            cmdline: "console=ttyS0".into(),
            flavour: "agentvm",
        }
    }

    /// Every part of the key makes another template: the image's files by content, its
    /// shape, the VMM by content, the host CPU; touching a file without changing it does not.
    #[test]
    fn every_part_of_the_key_makes_another_template() {
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("vmlinux");
        let vmm = dir.path().join("vmm");
        std::fs::write(&kernel, b"kernel v1").unwrap();
        std::fs::write(&vmm, b"vmm v1").unwrap();
        let image = GuestImage {
            harness: "echo".into(),
            kernel: kernel.clone(),
            ..Default::default()
        };
        let t = Templates::default();
        let base = t.key(&image, &shape(), &vmm, "cpu-a").unwrap();
        assert!(base.id.starts_with("template.echo."), "{}", base.id);
        assert_eq!(t.key(&image, &shape(), &vmm, "cpu-a").unwrap(), base);
        // Rewritten with the same bytes: the same template.
        std::fs::write(&kernel, b"kernel v1").unwrap();
        assert_eq!(t.key(&image, &shape(), &vmm, "cpu-a").unwrap().id, base.id);
        let mut changed = Vec::new();
        std::fs::write(&kernel, b"kernel v2").unwrap();
        changed.push(t.key(&image, &shape(), &vmm, "cpu-a").unwrap().id);
        std::fs::write(&kernel, b"kernel v1").unwrap();
        std::fs::write(&vmm, b"vmm v2").unwrap();
        changed.push(t.key(&image, &shape(), &vmm, "cpu-a").unwrap().id);
        std::fs::write(&vmm, b"vmm v1").unwrap();
        changed.push(t.key(&image, &shape(), &vmm, "cpu-b").unwrap().id);
        let mut bigger = shape();
        bigger.memory_mib = 128;
        changed.push(t.key(&image, &bigger, &vmm, "cpu-a").unwrap().id);
        let mut more = shape();
        more.vcpus = 2;
        changed.push(t.key(&image, &more, &vmm, "cpu-a").unwrap().id);
        let other_cmdline = GuestImage {
            cmdline: "testguest.echo".into(),
            ..image.clone()
        };
        changed.push(t.key(&other_cmdline, &shape(), &vmm, "cpu-a").unwrap().id);
        let with_disk = GuestImage {
            workspace_mib: 16,
            ..image.clone()
        };
        changed.push(t.key(&with_disk, &shape(), &vmm, "cpu-a").unwrap().id);
        for id in &changed {
            assert_ne!(id, &base.id);
        }
        let unique: std::collections::HashSet<_> = changed.iter().collect();
        assert_eq!(unique.len(), changed.len(), "{changed:?}");
        // Back as it was: the first template again.
        assert_eq!(t.key(&image, &shape(), &vmm, "cpu-a").unwrap().id, base.id);
    }

    #[test]
    fn the_cpu_is_known_by_model_and_features() {
        let a = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n\
                 model name\t: EPYC\nstepping\t: 1\nflags\t\t: fpu sse avx2\n\n\
                 processor\t: 1\nvendor_id\t: AuthenticAMD\n";
        let b = a.replace("avx2", "avx512f");
        assert_eq!(cpu_identity(a), cpu_identity(a));
        assert_ne!(cpu_identity(a), cpu_identity(&b));
        assert_ne!(cpu_identity(a), cpu_identity(&a.replace("EPYC", "EPYC 2")));
    }
}

/// Why a template was not made.
#[derive(Debug)]
enum MakeError {
    /// Its VM did not boot (or its guest never became ready).
    Boot(String),
    /// It booted, but its harness did not answer or it could not be saved.
    Save(String),
}

impl std::fmt::Display for MakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MakeError::Boot(why) => write!(f, "its VM did not start: {why}"),
            MakeError::Save(why) => write!(f, "it could not be saved: {why}"),
        }
    }
}

/// A template as node status shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateStatus {
    pub harness: String,
    pub id: String,
    /// What it holds on disk (its memory file's data, its disks, its device state).
    pub bytes: u64,
    /// Sessions whose VM maps it now.
    pub sessions: u64,
    /// It is its image's template today (else it waits for its last session to go).
    pub current: bool,
    /// Its archive's pinned URI in the fleet's snapshot store, once published.
    pub published: String,
}

/// What `agentvm image warm` got.
#[derive(Debug, Clone)]
pub struct Warmed {
    pub id: String,
    /// Made by this call (else it was there).
    pub made: bool,
    pub took: Duration,
}

impl super::MicrovmRuntime {
    /// What this node adds to every VM of `image`.
    fn vm_shape(&self, image: &GuestImage) -> VmShape {
        VmShape {
            vcpus: image.vcpus.unwrap_or(self.config.vcpus),
            memory_mib: image.memory_mib.unwrap_or(self.config.memory_mib),
            cmdline: format!(
                "harness_ready_ms={}",
                self.config.guest_timeouts.ready.as_millis()
            ),
            flavour: self.config.flavour.name(),
        }
    }

    /// `image`'s template key, hashed off the async workers (a root filesystem or a debug
    /// VMM binary is large), and remembered as the image's current one.
    async fn template_key(&self, image: &GuestImage) -> Result<TemplateKey, String> {
        let templates = self.templates.clone();
        let (image, shape) = (image.clone(), self.vm_shape(image));
        let (vmm, cpu) = (self.config.vmm_binary.clone(), self.cpu.clone());
        let harness = image.harness.clone();
        let key = tokio::task::spawn_blocking(move || templates.key(&image, &shape, &vmm, &cpu))
            .await
            .map_err(|e| format!("the template key of {harness:?}: {e}"))?
            .map_err(|e| format!("the template key of {harness:?}: {e}"))?;
        self.templates.remember_current(&harness, &key.id);
        Ok(key)
    }

    /// Whether sessions of `image` start from a template on this node.
    fn serves_templates(&self, image: &GuestImage) -> bool {
        // Stock Cloud Hypervisor cannot give each restored VM its own disks and network yet.
        self.config.templates && !image.cold_boot && self.config.flavour.cow_fork()
    }

    /// The template a new session of `image` starts from, made now if there is none yet;
    /// `None`: the session boots (templates off for it, or this one could not be saved).
    /// A template whose VM did not even boot is the session's own failure: its boot would
    /// go the same way.
    pub(super) async fn template_for(
        &self,
        session: &str,
        image: &GuestImage,
    ) -> super::Result<Option<(TemplateKey, agentvm_proto::v1::SnapshotRef)>> {
        if !self.serves_templates(image) {
            return Ok(None);
        }
        let key = match self.template_key(image).await {
            Ok(key) => key,
            Err(why) => {
                tracing::warn!(harness = %image.harness, %why, "no template: sessions boot");
                return Ok(None);
            }
        };
        if self.templates.failed_lately(&key.id) {
            return Ok(None);
        }
        match self.ensure_template(image, &key).await {
            Ok(_) => Ok(self.template_ref(&key.id).map(|r| (key, r))),
            Err(MakeError::Boot(why)) => Err(super::failed(
                session,
                format!("its image's template VM did not start: {why}"),
            )),
            Err(MakeError::Save(why)) => {
                tracing::warn!(harness = %image.harness, template = %key.id, %why,
                    "the image's template could not be saved: its sessions boot for now");
                self.templates.mark_failed(&key.id);
                Ok(None)
            }
        }
    }

    /// Makes `harness`'s template unless it is there: `agentvm image warm`.
    pub async fn warm(&self, harness: &str) -> Result<Warmed, String> {
        let image = self
            .image(harness)
            .ok_or_else(|| format!("no guest image serves harness {harness:?}"))?
            .to_owned();
        if !self.serves_templates(&image) {
            return Err(match (self.config.templates, image.cold_boot) {
                (false, _) => "templates are off on this node (templates = false)".to_owned(),
                (true, true) => format!("image {harness:?} says cold_boot = true"),
                (true, false) => format!(
                    "the {} VMM cannot start sessions from a template",
                    self.config.flavour.name()
                ),
            });
        }
        let key = self.template_key(&image).await?;
        let started = Instant::now();
        let made = self
            .ensure_template(&image, &key)
            .await
            .map_err(|e| e.to_string())?;
        Ok(Warmed {
            id: key.id,
            made,
            took: started.elapsed(),
        })
    }

    /// Makes every template this node's images lack, one at a time (`warm_templates`).
    pub async fn warm_all(&self) {
        for harness in self
            .config
            .images
            .iter()
            .map(|i| i.harness.clone())
            .collect::<Vec<_>>()
        {
            match self.warm(&harness).await {
                Ok(w) => tracing::info!(harness, template = %w.id, made = w.made,
                    took_ms = w.took.as_millis() as u64, "template ready"),
                Err(why) => tracing::info!(harness, %why, "no template"),
            }
        }
    }

    /// `key`'s template, made first if the store lacks it; true when made by this call.
    async fn ensure_template(
        &self,
        image: &GuestImage,
        key: &TemplateKey,
    ) -> Result<bool, MakeError> {
        let making = self.templates.making(&key.id);
        let _one_at_a_time = making.lock().await;
        let dir = self
            .store
            .dir(&key.id)
            .map_err(|e| MakeError::Save(e.to_string()))?;
        if dir.is_dir() || self.fetch_fleet_template(image, key).await {
            return Ok(false);
        }
        self.make_template(image, key).await?;
        Ok(true)
    }

    fn template_ref(&self, id: &str) -> Option<agentvm_proto::v1::SnapshotRef> {
        let dir = self.store.dir(id).ok()?;
        Some(agentvm_proto::v1::SnapshotRef {
            local: id.to_owned(),
            external_uri: format!("file://{}", dir.display()),
            memory: true,
            sealed: false,
        })
    }

    /// Boots a VM of `image` under a name of its own, waits for its harness to answer
    /// Describe, saves it as `key`'s template and stops it.
    async fn make_template(&self, image: &GuestImage, key: &TemplateKey) -> Result<(), MakeError> {
        let name = format!("{VM_PREFIX}{}", &key.id[key.id.len().saturating_sub(12)..]);
        let spec = super::SessionSpec {
            session_uid: name.clone(),
            harness: image.harness.clone(),
            ..Default::default()
        };
        let started = Instant::now();
        self.boot(&spec, image)
            .await
            .map_err(|e| MakeError::Boot(e.to_string()))?;
        let booted = started.elapsed();
        let dir = self.vmm_dir(&name);
        let saved = self.save_template(&name, &dir, &key.id).await;
        self.stop_vmm(&name, &dir).await;
        saved.map_err(MakeError::Save)?;
        let parts: Vec<String> = key
            .parts
            .iter()
            .map(|(name, value)| format!("{name}={}", short(value)))
            .collect();
        tracing::info!(
            template = %key.id,
            boot_ms = booted.as_millis() as u64,
            took_ms = started.elapsed().as_millis() as u64,
            key = %parts.join(" "),
            "template made"
        );
        Ok(())
    }

    async fn save_template(&self, name: &str, dir: &super::VmmDir, id: &str) -> Result<(), String> {
        // What the template saves is a harness that has started and answered.
        let mut conn = self
            .take_ready_conn(name)
            .ok_or("the booted VM's guest connection is gone")?;
        conn.describe()
            .await
            .map_err(|e| format!("the harness did not answer Describe: {e}"))?;
        drop(conn);
        super::pause_to_save(name, dir)
            .await
            .map_err(|e| e.to_string())?;
        let outbox = dir.snapshot_outbox();
        super::prepare_outbox(dir, &outbox)?;
        dir.client()
            .snapshot(&outbox)
            .await
            .map_err(|e| format!("vm.snapshot: {e}"))?;
        self.store
            .adopt(id, &outbox)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// Deletes the templates no image has as its key any more, once no session maps them.
    pub(super) async fn sweep_templates(&self) {
        let mut current = std::collections::HashSet::new();
        for image in &self.config.images {
            if let Ok(key) = self.template_key(image).await {
                current.insert(key.id);
            }
        }
        for id in self.store.list().unwrap_or_default() {
            if !id.starts_with(ID_PREFIX) || current.contains(&id) {
                continue;
            }
            match self.store.delete(&id) {
                Ok(()) => {
                    tracing::info!(template = %id, "deleted a template no image has any more")
                }
                Err(e) => {
                    tracing::debug!(template = %id, error = %e, "an old template still in use")
                }
            }
        }
    }

    /// The templates in this node's store ("current" as of the last time each image's key
    /// was computed: at start-up, and at each session's create).
    pub fn template_status(&self) -> Vec<TemplateStatus> {
        let current: HashMap<String, String> = self
            .config
            .images
            .iter()
            .filter(|i| self.serves_templates(i))
            .filter_map(|i| Some((self.templates.current(&i.harness)?, i.harness.clone())))
            .collect();
        self.store
            .list()
            .unwrap_or_default()
            .into_iter()
            .filter(|id| id.starts_with(ID_PREFIX))
            .map(|id| {
                let dir = self.store.dir(&id).unwrap_or_default();
                let harness = current.get(&id).cloned().unwrap_or_else(|| {
                    id.trim_start_matches(ID_PREFIX)
                        .rsplit_once('.')
                        .map_or(String::new(), |(h, _)| h.to_owned())
                });
                TemplateStatus {
                    harness,
                    bytes: disk_bytes(&dir),
                    sessions: self.store.holders(&id).map_or(0, |h| h.len() as u64),
                    current: current.contains_key(&id),
                    published: self.published_template_uri(&id).unwrap_or_default(),
                    id,
                }
            })
            .collect()
    }

    /// How each session with a VM now got it.
    pub fn vm_starts(&self) -> Vec<(String, StartPath)> {
        self.templates.starts()
    }
}

/// Blocks a directory's files take on disk (sparse memory files count what they hold).
fn disk_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| if m.is_dir() { 0 } else { m.blocks() * 512 })
        .sum()
}

/// A digest shortened for a log line.
fn short(value: &str) -> &str {
    match value.len() == 64 && value.bytes().all(|b| b.is_ascii_hexdigit()) {
        true => &value[..12],
        false => value,
    }
}
