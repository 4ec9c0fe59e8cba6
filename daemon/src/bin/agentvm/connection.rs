//! Where a command that talks to agentvmd finds it, and what it shows it. Only those commands
//! take these options: `completions`, `man`, `image`, `harness serve` and `journal verify`
//! work without a daemon.

use std::path::PathBuf;

use agentvmd::client::{AuthedChannel, Credentials};
use agentvmd::config::ListenAddr;

#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Connection")]
pub struct Connection {
    /// The daemon's API address, `unix:PATH` or `HOST:PORT`. Default: agentvmd's default socket.
    #[arg(long, env = "AGENTVM_ADDR", hide_env_values = true)]
    addr: Option<ListenAddr>,
    /// Bearer token for a node with an auth file.
    #[arg(long, env = "AGENTVM_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// For a TCP address: speak TLS, trusting this CA certificate (PEM).
    #[arg(long, env = "AGENTVM_TLS_CA", hide_env_values = true)]
    tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS, with --tls-key.
    #[arg(long, env = "AGENTVM_TLS_CERT", hide_env_values = true)]
    tls_cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long, env = "AGENTVM_TLS_KEY", hide_env_values = true)]
    tls_key: Option<PathBuf>,
}

impl Connection {
    /// `--addr`, else `AGENTVM_ADDR`, else agentvmd's default socket.
    pub fn addr(&self) -> ListenAddr {
        self.addr
            .clone()
            .unwrap_or_else(agentvmd::config::default_listen)
    }

    /// The same credentials, shown to another address (another node of the fleet).
    pub fn at(&self, addr: ListenAddr) -> Connection {
        Connection {
            addr: Some(addr),
            ..self.clone()
        }
    }

    pub fn credentials(&self) -> Credentials {
        Credentials {
            token: self.token.clone(),
            tls_ca: self.tls_ca.clone(),
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
        }
    }

    /// A channel to the daemon that shows it the bearer token on every call.
    pub async fn connect(&self) -> anyhow::Result<AuthedChannel> {
        let creds = self.credentials();
        let channel = agentvmd::client::connect_with(&self.addr(), &creds).await?;
        Ok(AuthedChannel::new(
            channel,
            agentvmd::client::bearer(creds.token)?,
        ))
    }
}
