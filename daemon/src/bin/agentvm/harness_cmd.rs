//! `agentvm harness serve NAME --listen ADDR`: runs a reference harness as a standalone
//! `agentsessions.v1.Harness` server (what the process runtime starts per session).

use agentvm_harnesses::server::GrpcHarness;
use agentvmd::config::ListenAddr;
use agentvmd::server;
use anyhow::Context;
use tonic::service::Routes;

pub fn serve(name: &str, listen: &ListenAddr) -> anyhow::Result<()> {
    let harness = agentvm_harnesses::builtin(name)
        .with_context(|| format!("no built-in harness named {name:?} (echo, counter, chat)"))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let routes = Routes::new(GrpcHarness::new(harness).into_service());
        server::serve(listen, routes, 0o600, async {
            use tokio::signal::unix::{SignalKind, signal};
            match signal(SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = tokio::signal::ctrl_c() => {}
                    }
                }
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        })
        .await
    })
}

/// `agentvm harness register|get|list|retire`: the harness registry on agentvmd's admin
/// socket, with upstream agentctl's flags; `--json` prints what agentctl prints (the
/// proto-JSON answer, proto field names).
pub mod registry {
    use std::path::{Path, PathBuf};

    use agentvm_proto::canon::{from_proto_json, to_proto_json};
    use agentvm_proto::v1::harness_registry_client::HarnessRegistryClient;
    use agentvm_proto::v1::harness_spec::Placement;
    use agentvm_proto::v1::{
        GetHarnessRequest, HarnessRegistration, HarnessSource, HarnessSpec, HarnessState,
        ListHarnessesRequest, RegisterHarnessRequest, RegisterOutcome, RetireHarnessRequest,
    };
    use agentvmd::config::ListenAddr;
    use anyhow::Context;

    /// Where the admin socket is: `--server`, else beside the API socket (`--addr` or
    /// `AGENTVM_ADDR`), as agentvmd puts it by default.
    #[derive(clap::Args, Debug, Clone)]
    #[command(next_help_heading = "Connection")]
    pub struct AdminConnection {
        /// agentvmd's admin (HarnessRegistry) address, `unix:PATH` or loopback `HOST:PORT`
        /// (agentctl's --server). Default: admin.sock beside the API socket.
        #[arg(
            long,
            alias = "admin",
            env = "AGENTVM_ADMIN_ADDR",
            hide_env_values = true
        )]
        server: Option<ListenAddr>,
        /// The daemon's API address, whose directory holds admin.sock by default.
        #[arg(long, env = "AGENTVM_ADDR", hide_env_values = true)]
        addr: Option<ListenAddr>,
    }

    impl AdminConnection {
        fn server(&self) -> ListenAddr {
            self.server.clone().unwrap_or_else(|| {
                let api = self
                    .addr
                    .clone()
                    .unwrap_or_else(agentvmd::config::default_listen);
                agentvmd::config::default_admin_listen(&api, &agentvmd::config::default_state_dir())
            })
        }

        async fn client(&self) -> anyhow::Result<HarnessRegistryClient<tonic::transport::Channel>> {
            let server = self.server();
            let channel = agentvmd::client::connect_with(&server, &Default::default())
                .await
                .with_context(|| format!("the harness registry at {server}"))?;
            Ok(HarnessRegistryClient::new(channel))
        }
    }

    #[derive(clap::Subcommand, Debug)]
    pub enum RegistryCommand {
        /// Register (or update, or reactivate) harness NAME from a HarnessSpec.
        Register {
            /// The harness's name (an RFC 1123 DNS label); sessions name it.
            #[arg(long)]
            name: String,
            /// A HarnessSpec in proto-JSON (`-`: standard input), e.g.
            /// {"remote": {"address": "unix:///run/h.sock"}, "capabilities": {"resumability":
            /// "RESUMABILITY_STATELESS_REPLAY"}}.
            #[arg(long)]
            spec: PathBuf,
            #[command(flatten)]
            conn: AdminConnection,
        },
        /// One harness: its registration, and with --observe what it says of itself.
        Get {
            #[arg(long)]
            name: String,
            /// Ask the harness to Describe itself (its failure is shown, not fatal).
            #[arg(long)]
            observe: bool,
            #[command(flatten)]
            conn: AdminConnection,
        },
        /// Every harness, built-in and registered, by name.
        List {
            /// Retired ones too.
            #[arg(long)]
            include_retired: bool,
            /// Entries per request (0: the server's default; at most 500).
            #[arg(long, default_value_t = 0)]
            page_size: i32,
            #[command(flatten)]
            conn: AdminConnection,
        },
        /// Retire harness NAME: new sessions may no longer choose it; existing ones go on.
        Retire {
            #[arg(long)]
            name: String,
            /// Why (recorded on the first retire only).
            #[arg(long, default_value = "")]
            reason: String,
            #[command(flatten)]
            conn: AdminConnection,
        },
    }

    pub async fn run(command: &RegistryCommand, json: bool) -> anyhow::Result<()> {
        match command {
            RegistryCommand::Register { name, spec, conn } => {
                let spec = read_spec(spec)?;
                let answer = conn
                    .client()
                    .await?
                    .register_harness(RegisterHarnessRequest {
                        name: name.clone(),
                        spec: Some(spec),
                    })
                    .await?
                    .into_inner();
                if json {
                    return print_json(&answer);
                }
                let outcome = match answer.outcome() {
                    RegisterOutcome::Created => "registered",
                    RegisterOutcome::Unchanged => "unchanged",
                    RegisterOutcome::Reactivated => "reactivated",
                    RegisterOutcome::Unspecified => "registered (outcome unknown)",
                };
                let digest = answer
                    .harness
                    .as_ref()
                    .map_or("", |h| h.spec_digest.as_str());
                outln!("{outcome} {name} {digest}");
            }
            RegistryCommand::Get {
                name,
                observe,
                conn,
            } => {
                let h = conn
                    .client()
                    .await?
                    .get_harness(GetHarnessRequest {
                        name: name.clone(),
                        observe: *observe,
                    })
                    .await?
                    .into_inner();
                if json {
                    return print_json(&h);
                }
                describe(&h);
            }
            RegistryCommand::List {
                include_retired,
                page_size,
                conn,
            } => {
                if *page_size < 0 {
                    anyhow::bail!("--page-size must not be negative");
                }
                let mut client = conn.client().await?;
                let mut all = agentvm_proto::v1::ListHarnessesResponse::default();
                let mut token = String::new();
                loop {
                    let page = client
                        .list_harnesses(ListHarnessesRequest {
                            page_size: (*page_size).min(500),
                            page_token: token,
                            include_retired: *include_retired,
                        })
                        .await?
                        .into_inner();
                    all.harnesses.extend(page.harnesses);
                    token = page.next_page_token;
                    if token.is_empty() {
                        break;
                    }
                }
                if json {
                    return print_json(&all);
                }
                outln!("{:<24} {:<8} {:<10} PLACEMENT", "NAME", "STATE", "SOURCE");
                for h in &all.harnesses {
                    outln!(
                        "{:<24} {:<8} {:<10} {}",
                        name_of(h),
                        state(h),
                        source(h),
                        placement(h)
                    );
                }
            }
            RegistryCommand::Retire { name, reason, conn } => {
                let h = conn
                    .client()
                    .await?
                    .retire_harness(RetireHarnessRequest {
                        name: name.clone(),
                        reason: reason.clone(),
                    })
                    .await?
                    .into_inner();
                if json {
                    return print_json(&h);
                }
                outln!("retired {}", name_of(&h));
            }
        }
        Ok(())
    }

    fn read_spec(path: &Path) -> anyhow::Result<HarnessSpec> {
        let text = match path == Path::new("-") {
            true => {
                let mut text = String::new();
                std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
                    .context("reading the HarnessSpec from standard input")?;
                text
            }
            false => std::fs::read_to_string(path)
                .with_context(|| format!("reading the HarnessSpec {}", path.display()))?,
        };
        let value: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("--spec {}: not JSON", path.display()))?;
        from_proto_json(&value)
            .with_context(|| format!("--spec {}: not a HarnessSpec", path.display()))
    }

    fn print_json<M: prost::Message + prost::Name>(message: &M) -> anyhow::Result<()> {
        outln!("{}", to_proto_json(message).context("rendering JSON")?);
        Ok(())
    }

    fn name_of(h: &HarnessRegistration) -> &str {
        h.metadata.as_ref().map_or("", |m| m.name.as_str())
    }

    fn state(h: &HarnessRegistration) -> &'static str {
        match h.state() {
            HarnessState::Active => "active",
            HarnessState::Retired => "retired",
            HarnessState::Unspecified => "-",
        }
    }

    fn source(h: &HarnessRegistration) -> &'static str {
        match h.source() {
            HarnessSource::Static => "built-in",
            HarnessSource::Registered => "registered",
            HarnessSource::Unspecified => "-",
        }
    }

    fn placement(h: &HarnessRegistration) -> String {
        match h.spec.as_ref().and_then(|s| s.placement.as_ref()) {
            Some(Placement::Remote(r)) => r.address.clone(),
            Some(Placement::Substrate(s)) => format!("substrate {}/{}", s.atespace, s.template),
            None => "-".into(),
        }
    }

    fn describe(h: &HarnessRegistration) {
        outln!("name:      {}", name_of(h));
        outln!("state:     {}", state(h));
        outln!("source:    {}", source(h));
        outln!("placement: {}", placement(h));
        if !h.spec_digest.is_empty() {
            outln!("digest:    {}", h.spec_digest);
        }
        if !h.retire_reason.is_empty() {
            outln!("retired:   {}", h.retire_reason);
        }
        if !h.unservable_reason.is_empty() {
            outln!("unservable here: {}", h.unservable_reason);
        }
        if let Some(d) = &h.observed {
            outln!("observed:  {} version {}", d.id, d.version);
        }
        if !h.observe_error.is_empty() {
            outln!("observe:   failed: {}", h.observe_error);
        }
    }
}
