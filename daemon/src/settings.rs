//! agentvmd's settings: command-line flags over an optional TOML file (`--config FILE`) over
//! embedded defaults. Every flag has a key of the same name in the file (dashes become
//! underscores), so one struct describes both:
//!
//! ```toml
//! state_dir = "/var/lib/agentvm"
//! listen = "unix:/run/agentvm/agentvmd.sock"
//! metrics_listen = "127.0.0.1:9464"
//! vmm_binary = "/usr/local/bin/agentvm-vmm"
//! image_dir = "/var/lib/agentvm/images"
//! log_format = "json"
//! ```
//!
//! Unknown keys and bad values are errors naming the key.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize};

use crate::config::ListenAddr;
use crate::runtime::microvm::flavour::VmmFlavour;

fn parsed<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: std::fmt::Display,
{
    let Some(text) = Option::<String>::deserialize(d)? else {
        return Ok(None);
    };
    text.parse().map(Some).map_err(serde::de::Error::custom)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// What a stopping daemon does with running sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ShutdownPolicy {
    /// Leave VMMs running; the next agentvmd adopts them (a restart or upgrade).
    #[default]
    Leave,
    /// Suspend every running session first (memory-tier ones to a snapshot), so the node
    /// can go down (a reboot, a drain).
    Suspend,
}

#[derive(clap::Parser, Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[command(name = "agentvmd", version, about = "agentvm node daemon")]
pub struct Settings {
    /// A TOML file with any of these settings (flags given here win).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Validate the settings (flags and file), print the effective ones, and exit.
    #[arg(long)]
    #[serde(skip)]
    pub check_config: bool,
    /// State directory (journal, snapshots, images). Default: /var/lib/agentvm as root,
    /// $XDG_STATE_HOME/agentvm otherwise.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// The journal every node of a fleet shares: a PostgreSQL URL
    /// (`postgres://USER:PASSWORD@HOST/DB`, or `postgresql:///DB?host=/run/postgresql` over a
    /// unix socket). Default: the embedded sqlite journal, STATE_DIR/journal.db.
    #[arg(long)]
    pub journal_url: Option<String>,
    /// Where snapshots are published so any node of a fleet can resume any session:
    /// `file:///DIR`, a directory every node mounts, or `s3://BUCKET/PREFIX` (endpoint,
    /// region and credentials from the AWS_* environment). Default: the node's own store only.
    #[arg(long)]
    pub snapshot_url: Option<String>,
    /// This node's name in the fleet (what its sessions and intents are recorded under).
    /// Default: the host name.
    #[arg(long)]
    pub node_name: Option<String>,
    /// Where other nodes and schedulers reach this node's Sessions API, as its heartbeats
    /// tell the fleet. Default: the --listen address.
    #[arg(long)]
    pub advertise_address: Option<String>,
    /// A node that misses heartbeats this long (seconds) loses its sessions: another node
    /// may take each over at its next call. It beats every third of it. Default: 15.
    #[arg(long)]
    pub lease_secs: Option<u64>,
    /// How often (seconds) the node deletes the snapshots of deleted sessions that it or the
    /// fleet's snapshot store still holds (with --journal-url or --snapshot-url).
    /// Default: 300.
    #[arg(long)]
    pub snapshot_sweep_secs: Option<u64>,
    /// Listener, `unix:PATH` or `HOST:PORT` (loopback). Default: unix:/run/agentvm/agentvmd.sock.
    #[arg(long)]
    #[serde(default, deserialize_with = "parsed")]
    pub listen: Option<ListenAddr>,
    /// Admin listener for the HarnessRegistry API (unix socket or loopback TCP).
    /// Default: admin.sock beside the API socket (in the state directory when the API
    /// listens on TCP).
    #[arg(long)]
    #[serde(default, deserialize_with = "parsed")]
    pub admin_listen: Option<ListenAddr>,
    /// Serve Prometheus metrics (families agentvm_*) at http://HOST:PORT/metrics.
    #[arg(long)]
    #[serde(default, deserialize_with = "parsed")]
    pub metrics_listen: Option<SocketAddr>,
    /// Give each running VMM's memory its own series, labelled with its session's uid. Off
    /// by default: one series a session grows the scraper's store without bound, and names
    /// every tenant's sessions to whoever reads the metrics.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub metrics_session_labels: Option<bool>,
    /// Log lines as `text` (default) or `json` (one object per line, span fields included).
    #[arg(long)]
    pub log_format: Option<LogFormat>,
    /// Program that serves a built-in harness for the process runtime, invoked as
    /// `PROGRAM harness serve NAME --listen unix:PATH`. Default: `agentvm` beside agentvmd.
    #[arg(long)]
    pub harness_bin: Option<PathBuf>,
    /// The VMM binary the microvm runtime starts, one per session. Default: `agentvm-vmm`
    /// beside agentvmd, or `cloud-hypervisor` on PATH; the runtime is left out if missing.
    #[arg(long)]
    pub vmm_binary: Option<PathBuf>,
    /// Which VMM that is: `agentvm` (forks copy-on-write) or `cloud-hypervisor` (v52 or
    /// later; forks by snapshot and full restore). Default: agentvm.
    #[arg(long)]
    #[serde(default, deserialize_with = "parsed")]
    pub vmm_flavour: Option<VmmFlavour>,
    /// Directory for guest RAM files; a tmpfs lets a fork link RAM instead of copying it.
    /// Default: /dev/shm.
    #[arg(long)]
    pub ram_dir: Option<PathBuf>,
    /// Guest image bundles (`agentvm image build -o DIR/NAME`), each served as harness NAME
    /// on the microvm runtime. Default: STATE_DIR/images.
    #[arg(long)]
    pub image_dir: Option<PathBuf>,
    /// The bundles' kernels are PVM guest kernels (built with CONFIG_PVM_GUEST). A host whose
    /// /dev/kvm is PVM boots no ordinary Linux guest, so without this it lists its bundles
    /// as harnesses it cannot run and refuses their sessions, naming why.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub pvm_guest_kernels: Option<bool>,
    /// New microVM sessions start from their image's template (its booted, ready VM,
    /// restored copy-on-write) instead of booting it; `false` boots every session.
    /// Default: true.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub templates: Option<bool>,
    /// Make every image's template when the daemon starts (in the background), not when
    /// its first session needs it. Default: false.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub warm_templates: Option<bool>,
    /// A memory-tier session keeps a checkpoint of its VM at each of its last N turns' ends
    /// (each a point it can be forked from); 0 keeps none. A session's
    /// `agentvm.dev/checkpoints` annotation overrides it (README: Time travel). Default: 32.
    #[arg(long)]
    pub checkpoints_keep: Option<u32>,
    /// Of the checkpoints older than the last `checkpoints_keep`, every Nth turn's is kept
    /// too; 0 drops them all. Default: 10.
    #[arg(long)]
    pub checkpoints_every: Option<u32>,
    /// The first of 65536 uids (and gids) given to VMMs, one each, so no two VMs share one:
    /// pick a range no other user or container of the node has. Default: 1879048192
    /// (0x70000000).
    #[arg(long)]
    pub vm_uid_base: Option<u32>,
    /// How many jailed VMMs wait, already started, for the next create, resume or fork
    /// child (each idle one holds ~3 MiB); 0 starts every VMM when it is needed. Default: 0
    /// (on 2 cores a claim and its refill cost what a start does).
    #[arg(long)]
    pub vmm_pool: Option<usize>,
    /// OpenAI-compatible endpoint (up to the version path, e.g. https://api.openai.com/v1)
    /// serving every model except the built-in `echo`.
    #[arg(long)]
    pub openai_base_url: Option<String>,
    /// Environment variable holding the endpoint's API key. Default: OPENAI_API_KEY.
    #[arg(long)]
    pub openai_api_key_env: Option<String>,
    /// File holding the API key (first line); takes precedence over the variable.
    #[arg(long)]
    pub openai_api_key_file: Option<PathBuf>,
    /// Per-request timeout of model calls, in seconds. Default: 600.
    #[arg(long)]
    pub openai_timeout_secs: Option<u64>,
    /// HTTP endpoint that executes host-mediated tool calls (JSON POST, deduplicated by its
    /// Idempotency-Key header); without it such calls fail with MissingToolExecutor.
    #[arg(long)]
    pub tool_executor_url: Option<String>,
    /// Per-call timeout of the tool executor, in seconds. Default: 60.
    #[arg(long)]
    pub tool_executor_timeout_secs: Option<u64>,
    /// TLS for a TCP Sessions listener: the server certificate chain and key (PEM). With them
    /// the listener may be on any address; without, TCP is loopback only.
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// Require TLS client certificates signed by this CA (PEM): mutual TLS.
    #[arg(long)]
    pub tls_client_ca: Option<PathBuf>,
    /// Principals, their credentials (bearer token or client certificate digests) and
    /// projects; with it every Sessions call must authenticate (README: API security).
    #[arg(long)]
    pub auth_file: Option<PathBuf>,
    /// On SIGTERM: `leave` running sessions to the next agentvmd (default) or `suspend`
    /// them all first.
    #[arg(long)]
    pub shutdown_policy: Option<ShutdownPolicy>,
    /// How long a `suspend` shutdown may take, in seconds. Default: 60.
    #[arg(long)]
    pub shutdown_timeout_secs: Option<u64>,
    /// How long a booted or restored guest may take to answer on vsock before it is taken
    /// for stuck, in seconds. Default: 20 (raise it where guests run emulated).
    #[arg(long)]
    pub guest_ready_timeout_secs: Option<u64>,
    /// How long the guest agent may take to answer a call of its own (the vsock handshake,
    /// Hello, a restore notice), in seconds. Default: 30. A Describe and a turn wait on the
    /// harness instead (--guest-ready-timeout-secs, --harness-idle-timeout-secs); a VMM
    /// that exits or is stopped (SIGSTOP, a frozen cgroup) ends any wait within a second.
    #[arg(long)]
    pub guest_reply_timeout_secs: Option<u64>,
    /// The bound on each call to a VMM's API, a snapshot or restore included, in seconds.
    /// Default: 10.
    #[arg(long)]
    pub vmm_api_timeout_secs: Option<u64>,
    /// How long a harness may send nothing while the host waits on it (between Start or a
    /// reply and its next event) before the turn fails with DEADLINE_EXCEEDED, in seconds.
    /// Default: 600.
    #[arg(long)]
    pub harness_idle_timeout_secs: Option<u64>,
    /// Free space, in MiB, the node keeps in its state and RAM directories: below it, new
    /// sessions, suspends and forks are refused with RESOURCE_EXHAUSTED (running sessions go
    /// on). 0 turns the reserve off. Default: 256.
    #[arg(long)]
    pub min_free_disk_mib: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {key}: {message}")]
    Invalid {
        path: String,
        key: String,
        message: String,
    },
}

macro_rules! prefer {
    ($cli:ident, $file:ident, $($field:ident),*) => {
        $( if $cli.$field.is_none() { $cli.$field = $file.$field.take(); } )*
    };
}

impl Settings {
    /// Reads `path` as TOML settings.
    pub fn from_file(path: &Path) -> Result<Settings, SettingsError> {
        let text = std::fs::read_to_string(path).map_err(|source| SettingsError::Read {
            path: path.display().to_string(),
            source,
        })?;
        crate::toml_file::parse(&text).map_err(|(key, message)| SettingsError::Invalid {
            path: path.display().to_string(),
            key,
            message,
        })
    }

    /// The flags, with what they leave unset taken from `file`.
    pub fn over(mut self, mut file: Settings) -> Settings {
        let cli = &mut self;
        prefer!(
            cli,
            file,
            state_dir,
            journal_url,
            snapshot_url,
            node_name,
            advertise_address,
            lease_secs,
            snapshot_sweep_secs,
            listen,
            admin_listen,
            metrics_listen,
            metrics_session_labels,
            log_format,
            harness_bin,
            vmm_binary,
            vmm_flavour,
            ram_dir,
            image_dir,
            pvm_guest_kernels,
            templates,
            warm_templates,
            checkpoints_keep,
            checkpoints_every,
            vm_uid_base,
            vmm_pool,
            openai_base_url,
            openai_api_key_env,
            openai_api_key_file,
            openai_timeout_secs,
            tool_executor_url,
            tool_executor_timeout_secs,
            shutdown_policy,
            shutdown_timeout_secs,
            guest_ready_timeout_secs,
            guest_reply_timeout_secs,
            vmm_api_timeout_secs,
            harness_idle_timeout_secs,
            min_free_disk_mib,
            tls_cert,
            tls_key,
            tls_client_ca,
            auth_file
        );
        self
    }

    /// Every setting as a TOML file would say it, with the value the node runs with: what
    /// was given, else its default. A setting that is off unless given is a comment saying
    /// what being unset means. The text reads back as the same settings.
    pub fn effective_toml(
        &self,
        node: &crate::node::NodeConfig,
        listen: &ListenAddr,
        admin_listen: &ListenAddr,
    ) -> String {
        let mut out = String::new();
        let mut set = |key: &str, value: toml::Value| out.push_str(&format!("{key} = {value}\n"));
        let text = |v: &str| toml::Value::String(v.to_owned());
        let path = |p: &Path| toml::Value::String(p.display().to_string());
        let secs = |n: u64| toml::Value::Integer(i64::try_from(n).unwrap_or(i64::MAX));
        set("state_dir", path(&node.state_dir));
        set("node_name", text(&node.node_name));
        set("listen", text(&listen.to_string()));
        set("admin_listen", text(&admin_listen.to_string()));
        set(
            "advertise_address",
            text(
                self.advertise_address
                    .as_deref()
                    .unwrap_or(&listen.to_string()),
            ),
        );
        set("lease_secs", secs(node.lease.as_secs()));
        set(
            "snapshot_sweep_secs",
            secs(
                self.snapshot_sweep_secs
                    .unwrap_or(DEFAULT_SNAPSHOT_SWEEP_SECS),
            ),
        );
        set(
            "log_format",
            text(match self.log_format.unwrap_or_default() {
                LogFormat::Text => "text",
                LogFormat::Json => "json",
            }),
        );
        if let Some(program) = node.harness_command.first() {
            set("harness_bin", text(program));
        }
        set("vmm_flavour", text(node.vmm_flavour.name()));
        set("ram_dir", path(&node.ram_dir));
        set(
            "image_dir",
            path(
                &node
                    .image_dir
                    .clone()
                    .unwrap_or_else(|| node.state_dir.join("images")),
            ),
        );
        set(
            "pvm_guest_kernels",
            toml::Value::Boolean(node.pvm_guest_kernels),
        );
        set("templates", toml::Value::Boolean(node.templates));
        set("warm_templates", toml::Value::Boolean(node.warm_templates));
        set(
            "checkpoints_keep",
            secs(u64::from(node.checkpoints.keep_last)),
        );
        set(
            "checkpoints_every",
            secs(u64::from(node.checkpoints.keep_every)),
        );
        set("vm_uid_base", secs(u64::from(node.vm_uid_base)));
        set("vmm_pool", secs(node.vmm_pool as u64));
        set(
            "metrics_session_labels",
            toml::Value::Boolean(self.metrics_session_labels.unwrap_or(false)),
        );
        set(
            "openai_api_key_env",
            text(
                self.openai_api_key_env
                    .as_deref()
                    .unwrap_or(DEFAULT_OPENAI_API_KEY_ENV),
            ),
        );
        set(
            "openai_timeout_secs",
            secs(
                self.openai_timeout_secs
                    .unwrap_or(DEFAULT_OPENAI_TIMEOUT_SECS),
            ),
        );
        set(
            "tool_executor_timeout_secs",
            secs(
                self.tool_executor_timeout_secs
                    .unwrap_or(DEFAULT_TOOL_EXECUTOR_TIMEOUT_SECS),
            ),
        );
        set(
            "shutdown_policy",
            text(match self.shutdown_policy.unwrap_or_default() {
                ShutdownPolicy::Leave => "leave",
                ShutdownPolicy::Suspend => "suspend",
            }),
        );
        set(
            "shutdown_timeout_secs",
            secs(
                self.shutdown_timeout_secs
                    .unwrap_or(DEFAULT_SHUTDOWN_TIMEOUT_SECS),
            ),
        );
        set(
            "guest_ready_timeout_secs",
            secs(node.guest_ready_timeout.as_secs()),
        );
        set(
            "guest_reply_timeout_secs",
            secs(node.guest_reply_timeout.as_secs()),
        );
        set("vmm_api_timeout_secs", secs(node.vmm_api_timeout.as_secs()));
        set(
            "harness_idle_timeout_secs",
            secs(node.harness_idle_timeout.as_secs()),
        );
        set("min_free_disk_mib", secs(node.min_free_disk_mib));
        let optional: [(&str, Option<String>, &str); 11] = [
            (
                "journal_url",
                self.journal_url.as_deref().map(without_password),
                "the embedded sqlite journal, STATE_DIR/journal.db",
            ),
            (
                "snapshot_url",
                self.snapshot_url.clone(),
                "snapshots stay in this node's own store",
            ),
            (
                "metrics_listen",
                self.metrics_listen.map(|a| a.to_string()),
                "no metrics endpoint",
            ),
            (
                "vmm_binary",
                node.vmm_binary.as_ref().map(|p| p.display().to_string()),
                "none found: the node has no microvm runtime",
            ),
            (
                "openai_base_url",
                self.openai_base_url.clone(),
                "only the built-in echo model",
            ),
            (
                "openai_api_key_file",
                self.openai_api_key_file
                    .as_ref()
                    .map(|p| p.display().to_string()),
                "the key comes from openai_api_key_env",
            ),
            (
                "tool_executor_url",
                self.tool_executor_url.clone(),
                "host-mediated tool calls fail with MissingToolExecutor",
            ),
            (
                "tls_cert",
                self.tls_cert.as_ref().map(|p| p.display().to_string()),
                "no TLS: the Sessions listener is a unix socket or loopback",
            ),
            (
                "tls_key",
                self.tls_key.as_ref().map(|p| p.display().to_string()),
                "no TLS",
            ),
            (
                "tls_client_ca",
                self.tls_client_ca.as_ref().map(|p| p.display().to_string()),
                "no client certificates asked for",
            ),
            (
                "auth_file",
                self.auth_file.as_ref().map(|p| p.display().to_string()),
                "no authentication: every caller may use every project",
            ),
        ];
        let mut unset_notes = String::new();
        for (key, value, unset) in optional {
            match value {
                Some(value) => set(key, text(&value)),
                None => unset_notes.push_str(&format!("# {key}: unset, {unset}\n")),
            }
        }
        out + &unset_notes
    }
}

/// How often the node deletes snapshots of deleted sessions (with a fleet or a snapshot store).
pub const DEFAULT_SNAPSHOT_SWEEP_SECS: u64 = 300;
/// The environment variable holding the OpenAI-compatible endpoint's key.
pub const DEFAULT_OPENAI_API_KEY_ENV: &str = "OPENAI_API_KEY";
pub const DEFAULT_OPENAI_TIMEOUT_SECS: u64 = 600;
pub const DEFAULT_TOOL_EXECUTOR_TIMEOUT_SECS: u64 = 60;
/// How long a `suspend` shutdown may take.
pub const DEFAULT_SHUTDOWN_TIMEOUT_SECS: u64 = 60;

/// A database URL fit to print: its password, if any, replaced by `***`.
pub fn without_password(url: &str) -> String {
    let hidden = |s: &str| -> String {
        // `user:password@host` in the URL's authority.
        let (scheme, rest) = s.split_once("://").unwrap_or(("", s));
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        let authority = match authority.rsplit_once('@') {
            Some((userinfo, host)) => match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:***@{host}"),
                None => format!("{userinfo}@{host}"),
            },
            None => authority.to_owned(),
        };
        match scheme {
            "" => format!("{authority}{tail}"),
            scheme => format!("{scheme}://{authority}{tail}"),
        }
    };
    // `password=...` as a query parameter or a key=value connection string.
    let mut out = hidden(url);
    if let Some(at) = out.find("password=") {
        let value = at + "password=".len();
        let end = out[value..]
            .find(['&', ' '])
            .map_or(out.len(), |n| value + n);
        out.replace_range(value..end, "***");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn printed_journal_urls_keep_their_password_to_themselves() {
        for (url, shown) in [
            (
                "postgres://agentvm:s3cret@db.example:5432/agentvm",
                "postgres://agentvm:***@db.example:5432/agentvm",
            ),
            (
                "postgresql:///agentvm?host=/run/postgresql&password=s3cret&user=a",
                "postgresql:///agentvm?host=/run/postgresql&password=***&user=a",
            ),
            (
                "host=/run/postgresql user=a password=s3cret dbname=x",
                "host=/run/postgresql user=a password=*** dbname=x",
            ),
            (
                "postgres://agentvm@db/agentvm",
                "postgres://agentvm@db/agentvm",
            ),
        ] {
            assert_eq!(without_password(url), shown);
        }
    }

    fn file(text: &str) -> Result<Settings, SettingsError> {
        crate::toml_file::load_written("agentvmd.toml", text, Settings::from_file)
    }

    #[test]
    fn flags_win_over_the_file_which_wins_over_defaults() {
        let f = file(
            "state_dir = \"/srv/agentvm\"\nlisten = \"unix:/run/a.sock\"\n\
             metrics_listen = \"127.0.0.1:9464\"\nvmm_flavour = \"cloud-hypervisor\"\n\
             log_format = \"json\"\nopenai_timeout_secs = 30\n",
        )
        .unwrap();
        let cli = Settings::parse_from(["agentvmd", "--listen", "unix:/tmp/b.sock"]);
        let s = cli.over(f);
        assert_eq!(s.listen, Some(ListenAddr::Unix("/tmp/b.sock".into())));
        assert_eq!(s.state_dir, Some(PathBuf::from("/srv/agentvm")));
        assert_eq!(s.metrics_listen, Some("127.0.0.1:9464".parse().unwrap()));
        assert_eq!(s.vmm_flavour, Some(VmmFlavour::CloudHypervisor));
        assert_eq!(s.log_format, Some(LogFormat::Json));
        assert_eq!(s.openai_timeout_secs, Some(30));
        let node = crate::node::NodeConfig::new(s.state_dir.clone().unwrap());
        let listen = s.listen.clone().unwrap();
        let admin = crate::config::default_admin_listen(&listen, &node.state_dir);
        let effective = s.effective_toml(&node, &listen, &admin);
        assert!(
            effective.contains("listen = \"unix:/tmp/b.sock\""),
            "{effective}"
        );
        // What it prints reads back as the same settings.
        let again = file(&effective).unwrap();
        assert_eq!(again.listen, s.listen);
        assert_eq!(again.openai_timeout_secs, s.openai_timeout_secs);
        assert_eq!(again.log_format, s.log_format);
        assert_eq!(again.state_dir, s.state_dir);
    }

    #[test]
    fn the_effective_settings_name_every_setting() {
        use clap::CommandFactory;
        let s = Settings::default();
        let node = crate::node::NodeConfig::new(PathBuf::from("/var/lib/agentvm"));
        let listen = crate::config::default_listen();
        let admin = crate::config::default_admin_listen(&listen, &node.state_dir);
        let effective = s.effective_toml(&node, &listen, &admin);
        for arg in Settings::command().get_arguments() {
            let key = arg.get_id().as_str();
            if ["config", "check_config", "help", "version"].contains(&key) {
                continue;
            }
            let named = effective
                .lines()
                .filter(|l| {
                    l.starts_with(&format!("{key} = ")) || l.starts_with(&format!("# {key}: "))
                })
                .count();
            assert_eq!(named, 1, "{key}:\n{effective}");
        }
        // Defaults are spelled out, and the text is a valid settings file.
        assert!(effective.contains("min_free_disk_mib = 256"), "{effective}");
        assert!(effective.contains("# journal_url: unset"), "{effective}");
        file(&effective).unwrap();
    }

    #[test]
    fn the_shipped_example_is_valid() {
        let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/agentvmd.toml");
        let s = Settings::from_file(&example).unwrap();
        assert_eq!(s.state_dir, Some(PathBuf::from("/var/lib/agentvm")));
        assert_eq!(s.vmm_flavour, Some(VmmFlavour::Agentvm));
    }

    #[test]
    fn bad_files_name_the_key() {
        for (text, key) in [
            ("listen = \"nonsense\"\n", "listen"),
            ("metrics_listen = \"nowhere\"\n", "metrics_listen"),
            ("vmm_flavour = \"qemu\"\n", "vmm_flavour"),
            ("log_format = \"xml\"\n", "log_format"),
            ("openai_timeout_secs = \"soon\"\n", "openai_timeout_secs"),
            ("colour = \"blue\"\n", "colour"),
            ("config = \"/etc/x\"\n", "config"),
        ] {
            let err = file(text).unwrap_err().to_string();
            assert!(err.contains(key), "{text:?}: {err}");
        }
        let err = Settings::from_file(Path::new("/nonexistent/agentvmd.toml")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/agentvmd.toml"));
    }
}
