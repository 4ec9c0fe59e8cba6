//! `agentvm image testguest -o FILE` writes the test guest ELF embedded in this binary;
//! `agentvm image build --config image.toml -o DIR` builds a Linux guest image bundle.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use anyhow::Context;

pub fn write_testguest(output: &Path) -> anyhow::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .open(output)
        .with_context(|| format!("creating {}", output.display()))?;
    file.write_all(agentvm_testguest::TESTGUEST_ELF)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", output.display()))?;
    // The umask may have narrowed the mode at creation, and an existing file keeps its own.
    file.set_permissions(std::fs::Permissions::from_mode(0o644))
        .with_context(|| format!("setting the mode of {}", output.display()))?;
    Ok(())
}

/// A root build handles the container image as an unprivileged uid (`image unpack`, this
/// binary), unless told not to; a build as anyone else already is unprivileged.
pub fn sandbox(refused: bool) -> anyhow::Result<Option<agentvmd::image::sandbox::Sandbox>> {
    if refused || !nix::unistd::geteuid().is_root() {
        return Ok(None);
    }
    let helper = std::env::current_exe().context("finding this binary to run `image unpack`")?;
    Ok(Some(agentvmd::image::sandbox::Sandbox::new(helper)))
}

/// `agentvm image unpack`: the namespace's side of a root build. What went wrong goes to
/// standard error as the image's error, alone, for the build to report.
pub fn unpack(job: &str, dir: &Path, label: &str, budget: Option<u64>) -> std::process::ExitCode {
    use agentvmd::image::sandbox::{Job, serve};
    let Some(job) = Job::parse(job) else {
        eprintln!("oci: no unpack job {job:?}");
        return std::process::ExitCode::from(2);
    };
    match serve(job, dir, label, budget) {
        Ok(out) => {
            print!("{out}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::ExitCode::from(2)
        }
    }
}

pub fn build(
    config: &Path,
    output: &Path,
    mut inputs: agentvmd::image::BuildInputs,
    json: bool,
) -> anyhow::Result<()> {
    inputs.agent = inputs.agent.or_else(default_agent);
    let manifest = agentvmd::image::build(config, output, &inputs)
        .with_context(|| format!("building the image of {}", config.display()))?;
    if json {
        outln!(
            "{}",
            serde_json::to_string(&manifest).context("rendering the manifest")?
        );
        return Ok(());
    }
    for (name, d) in &manifest.files {
        outln!("{name:16} {:>10} bytes  sha256:{}", d.size, d.sha256);
    }
    Ok(())
}

/// The agent an image gets when none is named: the statically linked `agentvm-guest` beside
/// this binary, or where `scripts/build-guest.sh` builds it for a binary in `target/release`;
/// else the one beside this binary (dynamically linked, as `cargo build` makes it), which the
/// build then refuses saying how to get the static one.
fn default_agent() -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let beside = exe.with_file_name("agentvm-guest");
    let built = exe
        .parent()?
        .parent()?
        .join("x86_64-unknown-linux-gnu/release/agentvm-guest");
    let is_static = |p: &std::path::Path| {
        std::fs::read(p).is_ok_and(|bytes| agentvmd::image::elf::check_static(&bytes).is_ok())
    };
    [&beside, &built]
        .into_iter()
        .find(|p| is_static(p))
        .or_else(|| beside.exists().then_some(&beside))
        .cloned()
}
