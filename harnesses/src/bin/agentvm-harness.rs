//! `agentvm-harness serve NAME --listen unix:PATH`: a reference harness (echo, counter, chat)
//! as a standalone `agentsessions.v1.Harness` server — what a guest image runs behind the
//! agent. Small and dependency-light so it links statically into an initramfs.

use std::process::ExitCode;

use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

fn usage() -> ExitCode {
    eprintln!("usage: agentvm-harness serve NAME --listen unix:PATH   (NAME: echo, counter, chat)");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (name, path) = match args.as_slice() {
        [serve, name, listen, addr] if serve == "serve" && listen == "--listen" => {
            match addr.strip_prefix("unix:") {
                Some(path) if !path.is_empty() => (name.clone(), path.to_owned()),
                _ => return usage(),
            }
        }
        _ => return usage(),
    };
    let Some(harness) = agentvm_harnesses::builtin(&name) else {
        eprintln!("agentvm-harness: no reference harness named {name:?}");
        return usage();
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("agentvm-harness: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let served = runtime.block_on(async move {
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        tonic::transport::Server::builder()
            .add_service(agentvm_harnesses::server::GrpcHarness::new(harness).into_service())
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                if let Ok(mut term) =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                {
                    term.recv().await;
                }
            })
            .await
            .map_err(std::io::Error::other)
    });
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agentvm-harness: {e}");
            ExitCode::FAILURE
        }
    }
}
