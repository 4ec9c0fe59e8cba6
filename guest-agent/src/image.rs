//! `image.toml`: what a guest image runs and how. The image builder validates it and puts it
//! in the initramfs at [`IMAGE_CONFIG_PATH`]; the agent reads it there at boot.
//!
//! ```toml
//! [harness]
//! command = ["/opt/harness/agentvm-harness", "serve", "echo", "--listen", "unix:{socket}"]
//! env = { RUST_LOG = "info" }
//! workdir = "/opt/harness"
//! resumability = "STATELESS_REPLAY"       # or REQUIRES_MEMORY_SNAPSHOT
//! restart = "on-failure"                 # always | on-failure | never
//! max_restarts = 5
//!
//! [vm]
//! vcpus = 1
//! memory_mib = 256
//! cmdline = "console=ttyS0"
//! workspace_mib = 1024                    # a writable disk per session; 0: none
//! workspace_fs = "ext4"                   # or "raw" (the harness formats it)
//! workspace_mount = "/workspace"          # where the agent mounts an ext4 workspace
//!
//! [network]                               # off (no network device) unless enabled
//! enabled = true
//! allow = ["pypi.org:443", "*.githubusercontent.com:443", "10.1.0.0/16"]
//! rate_limit_mbit = 100                   # per direction; 0: none
//!
//! [build]                                 # for `agentvm image build` only
//! kernel = "vmlinux"
//! harness_binary = "target/release/agentvm-harness"   # or harness_dir = "dir"
//! ```
//!
//! `{socket}` in an argument or an environment value becomes the unix socket the agent
//! expects the harness's `agentsessions.v1.Harness` server on; it is also in
//! `$AGENTVM_HARNESS_SOCKET`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where the image builder puts the configuration inside the guest.
pub const IMAGE_CONFIG_PATH: &str = "/etc/agentvm/image.toml";
/// The largest workspace disk an image may ask for, in MiB (1 TiB).
pub const MAX_WORKSPACE_MIB: u32 = 1 << 20;
/// The placeholder for the harness socket in `command` and `env`.
pub const SOCKET_PLACEHOLDER: &str = "{socket}";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageConfig {
    pub harness: HarnessConfig,
    #[serde(default)]
    pub vm: VmConfig,
    #[serde(default)]
    pub network: NetworkConfig,
    /// Where the image builder takes the image's parts from (host paths, relative to the
    /// configuration file). Not part of the image: the copy inside the guest has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<BuildConfig>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BuildConfig {
    /// The guest kernel (`vmlinux` ELF or `bzImage`).
    pub kernel: Option<PathBuf>,
    /// The static `agentvm-guest` binary to install as `/init`.
    pub agent: Option<PathBuf>,
    /// A directory copied to `/opt/harness` (a harness with its runtime and files)…
    pub harness_dir: Option<PathBuf>,
    /// …or one static binary installed as `/opt/harness/<its file name>`.
    pub harness_binary: Option<PathBuf>,
    /// A container image (an OCI image layout directory or archive, or `docker save`
    /// output) that becomes the guest's root filesystem; its Entrypoint and Cmd are the
    /// harness command unless `harness.command` gives one.
    pub oci: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HarnessConfig {
    /// Program and arguments; the program is an absolute path inside the guest. May be left
    /// out when `[build] oci` gives a container image: its Entrypoint and Cmd are used.
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default = "default_workdir")]
    pub workdir: PathBuf,
    pub resumability: Resumability,
    #[serde(default)]
    pub restart: RestartPolicy,
    /// Restarts allowed before the harness is left down (its error reported to the host).
    #[serde(default = "default_max_restarts")]
    pub max_restarts: u32,
    /// The user and group the harness runs as (a container image's `User`).
    #[serde(default)]
    pub uid: u32,
    #[serde(default)]
    pub gid: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Resumability {
    StatelessReplay,
    RequiresMemorySnapshot,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RestartPolicy {
    Always,
    #[default]
    OnFailure,
    Never,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    #[serde(default = "default_vcpus")]
    pub vcpus: u8,
    #[serde(default = "default_memory_mib")]
    pub memory_mib: u32,
    /// Appended to the kernel command line the host builds.
    #[serde(default)]
    pub cmdline: String,
    /// A writable disk of this many MiB for each session (the guest's first virtio disk,
    /// serial `workspace`), blank at the first boot and carried through suspend, resume and
    /// fork (each child gets a copy of its own). 0: none. For now only a harness whose state
    /// lives in memory snapshots (REQUIRES_MEMORY_SNAPSHOT) may have one: a stateless one is
    /// resumed by replay into a fresh VM, which would start from a blank disk.
    #[serde(default)]
    pub workspace_mib: u32,
    /// `ext4`: the image builder ships a formatted template (the bundle's `workspace.img`)
    /// each session's disk starts as, and the agent mounts it at `workspace_mount` before the
    /// harness starts. `raw`: a blank disk the harness uses as it likes.
    #[serde(default)]
    pub workspace_fs: WorkspaceFs,
    #[serde(default = "default_workspace_mount")]
    pub workspace_mount: PathBuf,
    /// The guest's root is the bundle's `rootfs.erofs` (a container image, read-only and
    /// shared by every VM of the image), made writable by an overlay in guest memory: the
    /// agent mounts it and switches into it before the harness starts. Set by the builder.
    #[serde(default)]
    pub rootfs: bool,
    /// Every session boots the image: the node makes no template of it (for an image whose
    /// boot must happen per session, such as one that draws secrets at start).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cold_boot: bool,
    /// Which turns of a memory-tier session stay fork points (time travel): `"off"`, `"K"`
    /// (the last K) or `"K/M"` (and every Mth older one). Unset: the node's setting. A
    /// session's `agentvm.dev/checkpoints` annotation overrides it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoints: Option<String>,
}

/// A checkpoint retention (`[vm] checkpoints`, the `agentvm.dev/checkpoints` annotation):
/// `(keep_last, keep_every)`, `(0, 0)` for `off`; `None` if `value` is none of `off`, `K`
/// or `K/M`.
pub fn parse_checkpoint_retention(value: &str) -> Option<(u32, u32)> {
    if value.trim() == "off" {
        return Some((0, 0));
    }
    let (last, every) = match value.split_once('/') {
        Some((last, every)) => (last, Some(every)),
        None => (value, None),
    };
    let keep_last = last.trim().parse().ok()?;
    let keep_every = match every {
        Some(every) => every.trim().parse().ok()?,
        None => 0,
    };
    Some((keep_last, keep_every))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkspaceFs {
    #[default]
    Ext4,
    Raw,
}

/// The workspace disk's serial: how the agent (and a harness) finds it among the disks.
pub const WORKSPACE_SERIAL: &str = "workspace";
/// The root filesystem disk's serial.
pub const ROOTFS_SERIAL: &str = "rootfs";
/// Set in the harness's environment to where the workspace is mounted.
pub const WORKSPACE_ENV: &str = "AGENTVM_WORKSPACE";

/// `[network]`: whether the VM has a network interface, and what it may reach through it.
/// Off by default: a VM without it has no network device at all.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkConfig {
    #[serde(default)]
    pub enabled: bool,
    /// `TARGET[:PORT[-PORT]]` entries (see [`crate::egress`]); nothing else is reachable,
    /// not even the host or other VMs. Names resolve through the host, which answers only
    /// for the names allowed here.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Each direction's bandwidth cap in megabits per second; 0: none.
    #[serde(default)]
    pub rate_limit_mbit: u32,
}

impl NetworkConfig {
    /// The allow entries, parsed.
    pub fn entries(&self) -> Result<Vec<crate::egress::AllowEntry>, String> {
        self.allow
            .iter()
            .enumerate()
            .map(|(i, e)| {
                crate::egress::AllowEntry::parse(e).map_err(|why| format!("allow[{i}]: {why}"))
            })
            .collect()
    }
}

fn default_workspace_mount() -> PathBuf {
    PathBuf::from("/workspace")
}

impl Default for VmConfig {
    fn default() -> Self {
        Self {
            vcpus: default_vcpus(),
            memory_mib: default_memory_mib(),
            cmdline: String::new(),
            workspace_mib: 0,
            workspace_fs: WorkspaceFs::default(),
            workspace_mount: default_workspace_mount(),
            rootfs: false,
            cold_boot: false,
            checkpoints: None,
        }
    }
}

fn default_workdir() -> PathBuf {
    PathBuf::from("/")
}
fn default_max_restarts() -> u32 {
    5
}
fn default_vcpus() -> u8 {
    1
}
fn default_memory_mib() -> u32 {
    256
}

#[derive(Debug, thiserror::Error)]
pub enum ImageConfigError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("{path}: {field}: {why}")]
    Invalid {
        path: String,
        field: &'static str,
        why: String,
    },
}

/// Names, in the harness's environment, the signal it gets after every restore, fork or
/// start from a template.
pub const RESTORE_SIGNAL_ENV: &str = "AGENTVM_RESTORE_SIGNAL";
/// SIGWINCH: ignored unless handled, so a harness that knows nothing of it is not harmed
/// (SIGUSR1/2 would end it).
pub const RESTORE_SIGNAL_NAME: &str = "SIGWINCH";

impl ImageConfig {
    pub fn load(path: &Path) -> Result<Self, ImageConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ImageConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates; `origin` names the text in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ImageConfigError> {
        let config: ImageConfig = serde_path_to_error::deserialize(toml::Deserializer::new(text))
            .map_err(|e| {
            let at = e.path().to_string();
            let inner = e.into_inner();
            let message = inner.message().to_owned();
            ImageConfigError::Parse {
                path: origin.to_owned(),
                message: if at == "." {
                    message
                } else {
                    format!("{at}: {message}")
                },
            }
        })?;
        config.validate(origin)?;
        Ok(config)
    }

    fn validate(&self, origin: &str) -> Result<(), ImageConfigError> {
        let invalid = |field, why: &str| ImageConfigError::Invalid {
            path: origin.to_owned(),
            field,
            why: why.to_owned(),
        };
        // A build-time configuration may leave the command to its container image (the
        // builder fills it in, and checks the result); the guest's copy must have one.
        let build_time = self.build.is_some();
        match self.harness.command.first() {
            None if build_time => {}
            None => return Err(invalid("harness.command", "is empty")),
            Some(program) if !program.starts_with('/') => {
                return Err(invalid(
                    "harness.command",
                    "the program must be an absolute path inside the guest",
                ));
            }
            Some(_) => {}
        }
        if self.harness.command.iter().any(|a| a.contains('\0'))
            || self
                .harness
                .env
                .iter()
                .any(|(k, v)| k.contains('\0') || v.contains('\0'))
        {
            return Err(invalid("harness", "may not contain NUL bytes"));
        }
        if self
            .harness
            .env
            .keys()
            .any(|k| k.is_empty() || k.contains('='))
        {
            return Err(invalid(
                "harness.env",
                "variable names may not be empty or contain '='",
            ));
        }
        if !self.harness.workdir.is_absolute() {
            return Err(invalid("harness.workdir", "must be absolute"));
        }
        if self.vm.vcpus == 0 {
            return Err(invalid("vm.vcpus", "must be at least 1"));
        }
        if let Some(value) = &self.vm.checkpoints
            && parse_checkpoint_retention(value).is_none()
        {
            return Err(invalid(
                "vm.checkpoints",
                "must be \"off\", \"K\" or \"K/M\" (numbers of turns)",
            ));
        }
        if self.vm.memory_mib < 32 {
            return Err(invalid("vm.memory_mib", "must be at least 32"));
        }
        if self.vm.workspace_mib > MAX_WORKSPACE_MIB {
            return Err(invalid(
                "vm.workspace_mib",
                "must be at most 1048576 (1 TiB)",
            ));
        }
        if !self.vm.workspace_mount.is_absolute() || self.vm.workspace_mount == Path::new("/") {
            return Err(invalid(
                "vm.workspace_mount",
                "must be an absolute path other than /",
            ));
        }
        if let Err(why) = self.network.entries() {
            return Err(ImageConfigError::Invalid {
                path: origin.to_owned(),
                field: "network",
                why,
            });
        }
        if !self.network.enabled && !self.network.allow.is_empty() {
            return Err(invalid(
                "network.allow",
                "needs network.enabled = true (a VM without a network reaches nothing)",
            ));
        }
        if self.vm.workspace_mib > 0
            && self.harness.resumability != Resumability::RequiresMemorySnapshot
        {
            return Err(invalid(
                "vm.workspace_mib",
                "needs resumability = \"REQUIRES_MEMORY_SNAPSHOT\": a stateless harness is \
                 resumed by replay into a fresh VM, whose disk would be blank",
            ));
        }
        Ok(())
    }

    /// The command with `{socket}` replaced.
    pub fn command_for(&self, socket: &Path) -> Vec<String> {
        let s = socket.display().to_string();
        self.harness
            .command
            .iter()
            .map(|a| a.replace(SOCKET_PLACEHOLDER, &s))
            .collect()
    }

    /// The environment with `{socket}` replaced, plus `AGENTVM_HARNESS_SOCKET`, and
    /// `AGENTVM_WORKSPACE` where the image has a workspace the agent mounts.
    pub fn env_for(&self, socket: &Path) -> BTreeMap<String, String> {
        let s = socket.display().to_string();
        let mut env: BTreeMap<String, String> = self
            .harness
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.replace(SOCKET_PLACEHOLDER, &s)))
            .collect();
        env.insert("AGENTVM_HARNESS_SOCKET".into(), s);
        // docs/harness-protocol.md, "Restores and forks": how the harness hears that it
        // was restored, forked or started from a template (and should reseed what it drew).
        env.insert(RESTORE_SIGNAL_ENV.into(), RESTORE_SIGNAL_NAME.into());
        if self.vm.workspace_mib > 0 && self.vm.workspace_fs == WorkspaceFs::Ext4 {
            env.insert(
                WORKSPACE_ENV.into(),
                self.vm.workspace_mount.display().to_string(),
            );
        }
        env
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
        [harness]
        command = ["/opt/harness/echo", "--listen", "unix:{socket}"]
        env = { MODE = "fast", SOCK = "{socket}" }
        resumability = "STATELESS_REPLAY"
        restart = "always"

        [vm]
        memory_mib = 128
    "#;

    #[test]
    fn a_good_config_parses_with_defaults() {
        let c = ImageConfig::parse(GOOD, "image.toml").unwrap();
        assert_eq!(c.harness.restart, RestartPolicy::Always);
        assert_eq!(c.harness.max_restarts, 5);
        assert_eq!(c.harness.workdir, PathBuf::from("/"));
        assert_eq!(c.vm.vcpus, 1);
        assert_eq!(c.vm.memory_mib, 128);
        let socket = Path::new("/run/h.sock");
        assert_eq!(c.command_for(socket)[2], "unix:/run/h.sock");
        let env = c.env_for(socket);
        assert_eq!(env["SOCK"], "/run/h.sock");
        assert_eq!(env["AGENTVM_HARNESS_SOCKET"], "/run/h.sock");
    }

    #[test]
    fn a_network_is_off_unless_enabled_and_its_entries_parse() {
        let c = ImageConfig::parse(GOOD, "image.toml").unwrap();
        assert!(!c.network.enabled);
        let text = format!(
            "{GOOD}\n[network]\nenabled = true\nallow = [\"*.example.com:443\", \"10.0.0.0/8\"]\nrate_limit_mbit = 50"
        );
        let c = ImageConfig::parse(&text, "image.toml").unwrap();
        assert_eq!(c.network.rate_limit_mbit, 50);
        let entries = c.network.entries().unwrap();
        assert_eq!(entries.len(), 2);
        assert!(entries[0].allows_name("api.example.com"));
    }

    #[test]
    fn the_reference_images_are_valid() {
        let images = Path::new(env!("CARGO_MANIFEST_DIR")).join("../images");
        let mut seen = 0;
        for entry in std::fs::read_dir(&images).unwrap() {
            let config = entry.unwrap().path().join("image.toml");
            if config.is_file() {
                let c = ImageConfig::load(&config).unwrap();
                // A container image's harness command comes from the image itself.
                let from_image = c.harness.command.is_empty() && c.build.is_some();
                assert!(
                    from_image
                        || c.command_for(Path::new("/s"))
                            .contains(&"unix:/s".to_owned()),
                    "{}",
                    config.display()
                );
                seen += 1;
            }
        }
        assert_eq!(seen, 4, "echo, counter, chat and python");
    }

    #[test]
    fn bad_configs_name_the_field() {
        for (text, field) in [
            (
                "[harness]\ncommand = []\nresumability = \"STATELESS_REPLAY\"",
                "harness.command",
            ),
            (
                "[harness]\ncommand = [\"echo\"]\nresumability = \"STATELESS_REPLAY\"",
                "harness.command",
            ),
            (
                "[harness]\ncommand = [\"/e\"]\nresumability = \"SOMETIMES\"",
                "resumability",
            ),
            (
                "[harness]\ncommand = [\"/e\"]\nresumability = \"STATELESS_REPLAY\"\nrestart = \"maybe\"",
                "restart",
            ),
            (
                "[harness]\ncommand = [\"/e\"]\nresumability = \"STATELESS_REPLAY\"\ncolour = 1",
                "colour",
            ),
            ("[harness]\ncommand = [\"/e\"]", "resumability"),
            (
                "[harness]\ncommand = [\"/e\"]\nresumability = \"STATELESS_REPLAY\"\nworkdir = \"rel\"",
                "harness.workdir",
            ),
            (
                "[harness]\ncommand = [\"/e\"]\nresumability = \"STATELESS_REPLAY\"\nenv = { \"A=B\" = \"x\" }",
                "harness.env",
            ),
            (
                "[harness]\ncommand = [\"/e\"]\nresumability = \"STATELESS_REPLAY\"\n[vm]\nvcpus = 0",
                "vm.vcpus",
            ),
            (
                "[harness]\ncommand = [\"/e\"]\nresumability = \"STATELESS_REPLAY\"\n[vm]\ncheckpoints = \"5/\"",
                "vm.checkpoints",
            ),
            (
                "[harness]\ncommand = [\"/e\"]\nresumability = \"STATELESS_REPLAY\"\n[vm]\nmemory_mib = 4",
                "vm.memory_mib",
            ),
            (
                "[harness]\ncommand = [\"/e\"]\nresumability = \"STATELESS_REPLAY\"\n[network]\nallow = [\"a.test\"]",
                "network.allow: needs network.enabled",
            ),
            (
                "[harness]\ncommand = [\"/e\"]\nresumability = \"STATELESS_REPLAY\"\n[network]\nenabled = true\nallow = [\"a.test\", \"10.0.0.1/8\"]",
                "network: allow[1]: 10.0.0.1/8: host bits",
            ),
            (
                "[harness]\ncommand = [\"/e\"]\nresumability = \"STATELESS_REPLAY\"\n[network]\nenable = true",
                "network.enable",
            ),
            ("not toml at all [", "image.toml"),
        ] {
            let err = ImageConfig::parse(text, "image.toml")
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{text:?}: {err}");
        }
    }
}
