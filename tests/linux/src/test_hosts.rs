//! Hosts for the egress-policy scenario, on the L1 only: each a network namespace joined to
//! the L1 by a veth pair, serving one line (its name) to every TCP connection on port 8080,
//! and named in the L1's /etc/hosts (where agentvmd's guest resolver looks first).

use std::fs::File;
use std::io::Write;
use std::net::{Ipv4Addr, TcpListener};
use std::process::Command;

use anyhow::{Context, bail};
use nix::sched::CloneFlags;

pub const PORT: u16 = 8080;

pub struct TestHost {
    pub name: &'static str,
    pub address: Ipv4Addr,
}

/// `allowed.test` at 10.78.1.2 and `refused.test` at 10.78.2.2.
pub const HOSTS: [TestHost; 2] = [
    TestHost {
        name: "allowed.test",
        address: Ipv4Addr::new(10, 78, 1, 2),
    },
    TestHost {
        name: "refused.test",
        address: Ipv4Addr::new(10, 78, 2, 2),
    },
];

fn ip(args: &str) -> anyhow::Result<()> {
    let out = Command::new("/sbin/ip")
        .args(args.split_whitespace())
        .output()
        .context("running /sbin/ip")?;
    if !out.status.success() {
        bail!("ip {args}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Starts every test host once (a second call finds them running).
pub fn start() -> anyhow::Result<()> {
    let mut hosts_file = String::from("127.0.0.1 localhost\n");
    for (i, host) in HOSTS.iter().enumerate() {
        hosts_file.push_str(&format!("{} {}\n", host.address, host.name));
        let ns = format!("lane-host{i}");
        if std::path::Path::new("/run/netns").join(&ns).exists() {
            continue;
        }
        let [a, b, c, _] = host.address.octets();
        let gateway = Ipv4Addr::new(a, b, c, 1);
        let veth = format!("lh{i}");
        ip(&format!("netns add {ns}"))?;
        ip(&format!(
            "link add {veth} type veth peer name eth0 netns {ns}"
        ))?;
        ip(&format!("address add {gateway}/30 dev {veth}"))?;
        ip(&format!("link set {veth} up"))?;
        ip(&format!("-n {ns} link set lo up"))?;
        ip(&format!("-n {ns} address add {}/30 dev eth0", host.address))?;
        ip(&format!("-n {ns} link set eth0 up"))?;
        ip(&format!("-n {ns} route add default via {gateway}"))?;
        serve(&ns, host)?;
    }
    std::fs::create_dir_all("/etc")?;
    std::fs::write("/etc/hosts", hosts_file).context("writing /etc/hosts")?;
    Ok(())
}

/// A thread in the host's namespace that answers every connection with the host's name.
fn serve(ns: &str, host: &TestHost) -> anyhow::Result<()> {
    let namespace = File::open(format!("/run/netns/{ns}"))?;
    let (address, name) = (host.address, host.name);
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let listener = nix::sched::setns(&namespace, CloneFlags::CLONE_NEWNET)
            .map_err(|e| format!("setns: {e}"))
            .and_then(|()| TcpListener::bind((address, PORT)).map_err(|e| format!("bind: {e}")));
        let listener = match listener {
            Ok(l) => {
                let _ = bound_tx.send(Ok(()));
                l
            }
            Err(e) => {
                let _ = bound_tx.send(Err(e));
                return;
            }
        };
        for mut stream in listener.incoming().flatten() {
            let _ = writeln!(stream, "{name}");
        }
    });
    match bound_rx.recv() {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => bail!("test host {name}: {e}"),
        Err(_) => bail!("test host {name}: its thread ended"),
    }
}
