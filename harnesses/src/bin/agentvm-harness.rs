//! `agentvm-harness serve NAME --listen unix:PATH`: a reference harness (echo, counter, chat)
//! as a standalone `agentsessions.v1.Harness` server — what a guest image runs behind the
//! agent. Small and dependency-light so it links statically into an initramfs.

use std::process::ExitCode;

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
    let served = agentvm_harnesses::server::serve_on_unix_socket(harness, &path);
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agentvm-harness: {e}");
            ExitCode::FAILURE
        }
    }
}
