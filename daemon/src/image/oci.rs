//! Container images as guest root filesystems: an OCI image layout (a directory, or a tar
//! of one) or `docker save` output is unpacked, layer by layer with its whiteouts, into a
//! directory tree, and its config says what the image runs (Entrypoint, Cmd, Env,
//! WorkingDir, User).
//!
//! Everything read is checked: blobs against their digests, layer paths against escaping
//! the tree (no `..`, no absolute link targets followed while unpacking).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{ImageError, invalid, io_error};

/// What an image's config says it runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunConfig {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// `KEY=VALUE` entries, in order.
    pub env: Vec<String>,
    pub working_dir: String,
    /// `uid[:gid]` or a user name, as the image says.
    pub user: String,
}

#[derive(Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Deserialize)]
struct Platform {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
}

#[derive(Deserialize)]
struct Index {
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct Manifest {
    config: Descriptor,
    layers: Vec<Descriptor>,
}

/// One entry of `docker save`'s manifest.json.
#[derive(Deserialize)]
struct DockerEntry {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

#[derive(Deserialize, Default)]
struct ImageConfigBlob {
    #[serde(default)]
    config: Option<ContainerConfig>,
}

#[derive(Deserialize, Default)]
struct ContainerConfig {
    #[serde(rename = "Entrypoint", default)]
    entrypoint: Option<Vec<String>>,
    #[serde(rename = "Cmd", default)]
    cmd: Option<Vec<String>>,
    #[serde(rename = "Env", default)]
    env: Option<Vec<String>>,
    #[serde(rename = "WorkingDir", default)]
    working_dir: Option<String>,
    #[serde(rename = "User", default)]
    user: Option<String>,
}

/// Unpacks the image at `source` into `root` (an empty directory) and returns its config.
/// `scratch` holds an archive's extracted layout while it is read.
pub fn unpack(source: &Path, root: &Path, scratch: &Path) -> Result<RunConfig, ImageError> {
    let layout = if source.is_dir() {
        source.to_owned()
    } else {
        let file = File::open(source).map_err(io_error(source))?;
        let dir = scratch.join("archive");
        std::fs::create_dir_all(&dir).map_err(io_error(&dir))?;
        let mut archive = tar::Archive::new(BufReader::new(file));
        for entry in archive.entries().map_err(io_error(source))? {
            let mut entry = entry.map_err(io_error(source))?;
            entry.unpack_in(&dir).map_err(io_error(source))?;
        }
        dir
    };
    let (config, layers) = if layout.join("index.json").is_file() {
        oci_layout(&layout)?
    } else if layout.join("manifest.json").is_file() {
        docker_save(&layout)?
    } else {
        return Err(invalid(
            "oci",
            format!(
                "{}: neither an OCI image layout (index.json) nor `docker save` output \
                 (manifest.json)",
                source.display()
            ),
        ));
    };
    for layer in &layers {
        apply_layer(layer, root)?;
    }
    let blob: ImageConfigBlob = serde_json::from_slice(&config)
        .map_err(|e| invalid("oci", format!("the image config is not JSON: {e}")))?;
    let c = blob.config.unwrap_or_default();
    Ok(RunConfig {
        entrypoint: c.entrypoint.unwrap_or_default(),
        cmd: c.cmd.unwrap_or_default(),
        env: c.env.unwrap_or_default(),
        working_dir: c.working_dir.unwrap_or_default(),
        user: c.user.unwrap_or_default(),
    })
}

/// The config blob and the layer files of an OCI image layout.
fn oci_layout(layout: &Path) -> Result<(Vec<u8>, Vec<PathBuf>), ImageError> {
    let index: Index = read_json(&layout.join("index.json"))?;
    let mut descriptor = pick(index.manifests, "index.json")?;
    // A multi-platform image: an index whose entries are per-platform manifests.
    for _ in 0..4 {
        if !descriptor.media_type.contains("index") {
            break;
        }
        let nested: Index = serde_json::from_slice(&blob(layout, &descriptor.digest)?)
            .map_err(|e| invalid("oci", format!("{}: {e}", descriptor.digest)))?;
        descriptor = pick(nested.manifests, &descriptor.digest)?;
    }
    let manifest: Manifest = serde_json::from_slice(&blob(layout, &descriptor.digest)?)
        .map_err(|e| invalid("oci", format!("manifest {}: {e}", descriptor.digest)))?;
    let config = blob(layout, &manifest.config.digest)?;
    let layers = manifest
        .layers
        .iter()
        .map(|layer| {
            verified_blob_path(layout, &layer.digest).inspect(|_| {
                tracing::debug!(digest = %layer.digest, media_type = %layer.media_type, "layer");
            })
        })
        .collect::<Result<_, _>>()?;
    Ok((config, layers))
}

/// The linux/amd64 entry (or the only one).
fn pick(manifests: Vec<Descriptor>, what: &str) -> Result<Descriptor, ImageError> {
    let count = manifests.len();
    let mut amd64 = manifests.into_iter().filter(|d| {
        d.platform
            .as_ref()
            .is_none_or(|p| p.architecture == "amd64" && p.os == "linux")
    });
    match (amd64.next(), amd64.next()) {
        (Some(one), None) => Ok(one),
        (None, _) => Err(invalid(
            "oci",
            format!("{what}: none of its {count} manifests is for linux/amd64"),
        )),
        (Some(_), Some(_)) => Err(invalid(
            "oci",
            format!("{what}: more than one linux/amd64 manifest; keep one"),
        )),
    }
}

/// The config blob and layer files of `docker save` output (one image).
fn docker_save(dir: &Path) -> Result<(Vec<u8>, Vec<PathBuf>), ImageError> {
    let entries: Vec<DockerEntry> = read_json(&dir.join("manifest.json"))?;
    let [entry] = <[DockerEntry; 1]>::try_from(entries).map_err(|entries| {
        invalid(
            "oci",
            format!(
                "manifest.json lists {} images; save exactly one",
                entries.len()
            ),
        )
    })?;
    let inside = |name: &str| -> Result<PathBuf, ImageError> {
        relative(name)
            .map(|rel| dir.join(rel))
            .ok_or_else(|| invalid("oci", format!("manifest.json names {name:?} outside it")))
    };
    let config = std::fs::read(inside(&entry.config)?).map_err(io_error(dir))?;
    let layers = entry
        .layers
        .iter()
        .map(|l| inside(l))
        .collect::<Result<_, _>>()?;
    Ok((config, layers))
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ImageError> {
    let bytes = std::fs::read(path).map_err(io_error(path))?;
    serde_json::from_slice(&bytes).map_err(|e| invalid("oci", format!("{}: {e}", path.display())))
}

/// `blobs/sha256/<hex>` of `digest`, which must be a sha256 digest.
fn blob_path(layout: &Path, digest: &str) -> Result<PathBuf, ImageError> {
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| invalid("oci", format!("{digest:?} is not a sha256 digest")))?;
    Ok(layout.join("blobs/sha256").join(hex))
}

/// A small blob's bytes, checked against its digest.
fn blob(layout: &Path, digest: &str) -> Result<Vec<u8>, ImageError> {
    let path = blob_path(layout, digest)?;
    let bytes = std::fs::read(&path).map_err(io_error(&path))?;
    check_digest(digest, &hex::encode(Sha256::digest(&bytes)))?;
    Ok(bytes)
}

/// A layer blob's path, once its contents are checked against its digest.
fn verified_blob_path(layout: &Path, digest: &str) -> Result<PathBuf, ImageError> {
    let path = blob_path(layout, digest)?;
    let mut file = File::open(&path).map_err(io_error(&path))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).map_err(io_error(&path))?;
    check_digest(digest, &hex::encode(hasher.finalize()))?;
    Ok(path)
}

fn check_digest(want: &str, got_hex: &str) -> Result<(), ImageError> {
    if want.strip_prefix("sha256:") == Some(got_hex) {
        Ok(())
    } else {
        Err(invalid(
            "oci",
            format!("blob {want} does not match its digest (sha256:{got_hex})"),
        ))
    }
}

/// A layer as a tar stream: plain, gzip or zstd, told by its first bytes.
fn layer_reader(path: &Path) -> Result<Box<dyn Read>, ImageError> {
    let mut file = File::open(path).map_err(io_error(path))?;
    let mut magic = [0u8; 4];
    let n = file.read(&mut magic).map_err(io_error(path))?;
    let file = BufReader::new(File::open(path).map_err(io_error(path))?);
    Ok(match &magic[..n] {
        [0x1f, 0x8b, ..] => Box::new(flate2::read::GzDecoder::new(file)),
        [0x28, 0xb5, 0x2f, 0xfd] => {
            Box::new(zstd::stream::read::Decoder::with_buffer(file).map_err(io_error(path))?)
        }
        _ => Box::new(file),
    })
}

/// `name` as a path inside the tree: leading `/` and `./` dropped; `None` for one that
/// climbs out (`..`) or is empty.
fn relative(name: &str) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for part in Path::new(name).components() {
        match part {
            Component::Normal(p) => out.push(p),
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    (!out.as_os_str().is_empty()).then_some(out)
}

/// Where a layer entry goes inside the tree (`None`: nowhere it may).
fn entry_path<R: Read>(entry: &tar::Entry<'_, R>) -> std::io::Result<Option<PathBuf>> {
    Ok(relative(&entry.path()?.to_string_lossy()))
}

/// Applies one layer over `root`: its whiteouts first (a `.wh.NAME` removes NAME from the
/// layers below; `.wh..wh..opq` empties its directory of them), then its entries.
fn apply_layer(path: &Path, root: &Path) -> Result<(), ImageError> {
    let corrupt = |e: std::io::Error| invalid("oci", format!("layer {}: {e}", path.display()));
    let mut removals: Vec<(PathBuf, bool)> = Vec::new();
    let mut archive = tar::Archive::new(layer_reader(path)?);
    for entry in archive.entries().map_err(corrupt)? {
        let entry = entry.map_err(corrupt)?;
        let Some(rel) = entry_path(&entry).map_err(corrupt)? else {
            continue;
        };
        let Some(file_name) = rel.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if file_name == ".wh..wh..opq" {
            removals.push((rel.parent().unwrap_or(Path::new("")).to_owned(), true));
        } else if let Some(hidden) = file_name.strip_prefix(".wh.") {
            removals.push((rel.with_file_name(hidden), false));
        }
    }
    for (target, opaque) in removals {
        let at = root.join(&target);
        // Only what is really inside the tree: a symlinked parent must not redirect this.
        if !inside(root, &at) {
            continue;
        }
        if opaque {
            if let Ok(children) = std::fs::read_dir(&at) {
                for child in children.flatten() {
                    remove(&child.path()).map_err(io_error(&child.path()))?;
                }
            }
        } else if at.symlink_metadata().is_ok() {
            remove(&at).map_err(io_error(&at))?;
        }
    }
    let mut archive = tar::Archive::new(layer_reader(path)?);
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(nix::unistd::geteuid().is_root());
    archive.set_unpack_xattrs(false);
    archive.set_overwrite(true);
    let mut skipped: BTreeMap<&'static str, u64> = BTreeMap::new();
    for entry in archive.entries().map_err(corrupt)? {
        let mut entry = entry.map_err(corrupt)?;
        let Some(rel) = entry_path(&entry).map_err(corrupt)? else {
            continue;
        };
        if rel
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(".wh."))
        {
            continue;
        }
        let kind = entry.header().entry_type();
        if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            // The guest's /dev is its own devtmpfs; device nodes in an image are never used.
            *skipped.entry("device or fifo").or_default() += 1;
            continue;
        }
        // A later layer may turn a directory into a file or the other way round.
        let at = root.join(&rel);
        if let Ok(meta) = at.symlink_metadata()
            && (meta.is_dir() != kind.is_dir() || meta.file_type().is_symlink())
        {
            remove(&at).map_err(io_error(&at))?;
        }
        entry.unpack_in(root).map_err(corrupt)?;
    }
    for (what, n) in skipped {
        tracing::info!(layer = %path.display(), what, n, "skipped layer entries");
    }
    Ok(())
}

/// Whether `path`'s parent, with symlinks resolved, lies inside `root`.
fn inside(root: &Path, path: &Path) -> bool {
    let (Ok(root), Some(parent)) = (root.canonicalize(), path.parent()) else {
        return false;
    };
    parent.canonicalize().is_ok_and(|p| p.starts_with(root))
}

fn remove(path: &Path) -> std::io::Result<()> {
    match path.symlink_metadata()?.is_dir() {
        true => std::fs::remove_dir_all(path),
        false => std::fs::remove_file(path),
    }
}

#[cfg(test)]
mod tests {
    use super::super::oci_layout::{self, LayerEntry};
    use super::*;

    #[test]
    fn layer_paths_stay_inside_the_tree() {
        assert_eq!(relative("./usr/bin/x"), Some(PathBuf::from("usr/bin/x")));
        assert_eq!(relative("/etc/passwd"), Some(PathBuf::from("etc/passwd")));
        for bad in ["../etc", "a/../../b", "", "./", "/"] {
            assert_eq!(relative(bad), None, "{bad}");
        }
    }

    /// A two-layer image: the second removes a file, empties a directory and replaces a
    /// directory with a file.
    fn two_layers(dir: &Path) {
        let bottom = oci_layout::layer(&[
            LayerEntry::Dir("bin", 0o755),
            LayerEntry::File("bin/app", 0o755, b"#!app v1"),
            LayerEntry::Dir("etc", 0o755),
            LayerEntry::File(
                "etc/passwd",
                0o644,
                b"root:x:0:0::/root:/bin/sh\nagent:x:1000:1001::/home/agent:/bin/sh\n",
            ),
            LayerEntry::Dir("data", 0o755),
            LayerEntry::File("data/keep", 0o644, b"kept"),
            LayerEntry::File("data/gone", 0o644, b"removed by the top layer"),
            LayerEntry::Dir("cache", 0o755),
            LayerEntry::File("cache/old", 0o644, b"old"),
            LayerEntry::Dir("swap", 0o755),
            LayerEntry::File("swap/inner", 0o644, b"inner"),
            LayerEntry::Symlink("bin/app-link", "app"),
        ])
        .unwrap();
        let top = oci_layout::layer(&[
            LayerEntry::File("bin/app", 0o755, b"#!app v2"),
            LayerEntry::File("data/.wh.gone", 0o644, b""),
            LayerEntry::File("cache/.wh..wh..opq", 0o644, b""),
            LayerEntry::File("cache/new", 0o644, b"new"),
            LayerEntry::File("swap", 0o644, b"now a file"),
        ])
        .unwrap();
        oci_layout::write(
            dir,
            &[oci_layout::gzip(&bottom).unwrap(), top],
            serde_json::json!({
                "Entrypoint": ["app"],
                "Cmd": ["--listen", "unix:{socket}"],
                "Env": ["PATH=/bin", "LANG=C.UTF-8"],
                "WorkingDir": "/data",
                "User": "agent",
            }),
        )
        .unwrap();
    }

    #[test]
    fn layers_apply_in_order_with_their_whiteouts() {
        let tmp = tempfile::tempdir().unwrap();
        let (layout, root) = (tmp.path().join("layout"), tmp.path().join("root"));
        std::fs::create_dir(&root).unwrap();
        two_layers(&layout);
        let run = unpack(&layout, &root, tmp.path()).unwrap();
        assert_eq!(run.entrypoint, ["app"]);
        assert_eq!(run.cmd, ["--listen", "unix:{socket}"]);
        assert_eq!(run.env, ["PATH=/bin", "LANG=C.UTF-8"]);
        assert_eq!(
            (run.working_dir.as_str(), run.user.as_str()),
            ("/data", "agent")
        );
        let read = |p: &str| std::fs::read(root.join(p)).unwrap();
        assert_eq!(read("bin/app"), b"#!app v2");
        assert_eq!(read("data/keep"), b"kept");
        assert!(!root.join("data/gone").exists());
        assert!(!root.join("data/.wh.gone").exists());
        assert!(
            !root.join("cache/old").exists(),
            "the opaque marker empties it"
        );
        assert_eq!(read("cache/new"), b"new");
        assert_eq!(read("swap"), b"now a file");
        assert_eq!(
            std::fs::read_link(root.join("bin/app-link")).unwrap(),
            Path::new("app")
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(root.join("bin/app"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
    }

    #[test]
    fn a_tampered_blob_or_an_unknown_layout_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let layout = tmp.path().join("layout");
        two_layers(&layout);
        let blobs: Vec<_> = std::fs::read_dir(layout.join("blobs/sha256"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        let biggest = blobs
            .iter()
            .max_by_key(|p| std::fs::metadata(p).unwrap().len())
            .unwrap();
        let mut bytes = std::fs::read(biggest).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(biggest, bytes).unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let err = unpack(&layout, &root, tmp.path()).unwrap_err().to_string();
        assert!(err.contains("does not match its digest"), "{err}");
        let err = unpack(tmp.path().join("root").as_path(), &root, tmp.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("neither an OCI image layout"), "{err}");
    }

    #[test]
    fn a_layer_cannot_write_outside_the_tree() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let layout = tmp.path().join("layout");
        // A symlink to a directory outside, then a file "through" it.
        let evil = oci_layout::layer(&[
            LayerEntry::Symlink("escape", outside.to_str().unwrap()),
            LayerEntry::File("escape/planted", 0o644, b"x"),
            LayerEntry::RawName(b"../../planted-too", b"x"),
        ])
        .unwrap();
        oci_layout::write(&layout, &[evil], serde_json::json!({"Cmd": ["/x"]})).unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let _ = unpack(&layout, &root, tmp.path());
        assert!(!outside.join("planted").exists());
        assert!(!tmp.path().join("planted-too").exists());
    }
}
