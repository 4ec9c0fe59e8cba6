//! Container images as guest root filesystems: an OCI image layout (a directory, or a tar
//! of one) or `docker save` output is unpacked, layer by layer with its whiteouts, into a
//! directory tree, and its config says what the image runs (Entrypoint, Cmd, Env,
//! WorkingDir, User).
//!
//! Everything read is checked: blobs against their digests (a `docker save` layer against
//! its config's `diff_ids`), every size against a cap before it is read, and every file
//! made, changed or removed goes through [`super::tree::Tree`], so nothing an image holds (a
//! `..`, a symlink planted by an earlier entry or layer, an archive's own links) reaches a
//! file outside the tree being built or the archive being read.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::sandbox::Sandbox;
use super::tree::{Meta, Tree};
use super::{ImageError, invalid, io_error};

/// The most a manifest, an index or a config may be: real ones are a few KiB.
const MAX_METADATA: u64 = 4 << 20;
/// The most an image may unpack to, all layers together (a layer is a compressed stream: a
/// small blob can declare files of any size).
pub const MAX_UNPACKED: u64 = 64 << 30;

/// Where an image archive's contents go in the scratch directory while they are read.
const ARCHIVE_DIR: &str = "archive";

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
    #[serde(default)]
    rootfs: Option<RootFs>,
}

/// The digests of the image's layers, uncompressed: what a `docker save` layer is checked
/// against.
#[derive(Deserialize, Default)]
struct RootFs {
    #[serde(default)]
    diff_ids: Vec<String>,
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
    unpack_with(source, root, scratch, None)
}

/// [`unpack`], with what writes the image's own bytes (an archive's extraction, the layers)
/// run by `sandbox` where one is given: this process then only reads (`root` must lie in
/// `scratch`).
pub fn unpack_with(
    source: &Path,
    root: &Path,
    scratch: &Path,
    sandbox: Option<&Sandbox>,
) -> Result<RunConfig, ImageError> {
    let layout_dir = if source.is_dir() {
        source.to_owned()
    } else {
        let dir = scratch.join(ARCHIVE_DIR);
        match sandbox {
            Some(sandbox) => sandbox.extract_archive(source, scratch, ARCHIVE_DIR)?,
            None => {
                std::fs::create_dir_all(&dir).map_err(io_error(&dir))?;
                let file = File::open(source).map_err(io_error(source))?;
                extract_archive(file, &source.display().to_string(), &dir)?;
            }
        }
        dir
    };
    let layout = Tree::open(&layout_dir).map_err(io_error(&layout_dir))?;
    let read = |name: &str| -> Result<Vec<u8>, ImageError> {
        layout
            .read(Path::new(name), MAX_METADATA)
            .map_err(|e| invalid("oci", format!("{}: {name}: {e}", source.display())))
    };
    let has = |name: &str| layout.kind(Path::new(name)).ok().flatten().is_some();
    let (config, layers) = if has("index.json") {
        oci_layout(&read("index.json")?, &layout)?
    } else if has("manifest.json") {
        docker_save(&read("manifest.json")?, &layout)?
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
    let blob: ImageConfigBlob = serde_json::from_slice(&config)
        .map_err(|e| invalid("oci", format!("the image config is not JSON: {e}")))?;
    let mut files = Vec::with_capacity(layers.len());
    for layer in &layers {
        let file = layout
            .open_file(&layer.path)
            .map_err(io_error(&layer.path))?;
        if let Some(diff_id) = &layer.diff_id {
            check_diff_id(&file, diff_id, &layer.path)?;
        }
        files.push((layer.path.clone(), file));
    }
    match sandbox {
        Some(sandbox) => sandbox.apply_layers(scratch, root, &files)?,
        None => {
            let tree = Tree::open(root).map_err(io_error(root))?;
            let mut budget = MAX_UNPACKED;
            for (path, file) in &files {
                let mut open = || layer_reader(file, path);
                apply_layer(&mut open, path, &tree, &mut budget)?;
            }
        }
    }
    let c = blob.config.unwrap_or_default();
    Ok(RunConfig {
        entrypoint: c.entrypoint.unwrap_or_default(),
        cmd: c.cmd.unwrap_or_default(),
        env: c.env.unwrap_or_default(),
        working_dir: c.working_dir.unwrap_or_default(),
        user: c.user.unwrap_or_default(),
    })
}

/// One layer to apply: its file in the layout, and for `docker save` output the digest of
/// its uncompressed tar, which nothing else vouches for.
struct LayerFile {
    path: PathBuf,
    diff_id: Option<String>,
}

/// Extracts an image archive (an OCI layout or `docker save` output as a tar, `source`
/// in messages) into `dir` through a [`Tree`]: its symlinks are made as links (docker save
/// links repeated layers) and never followed out of it, its devices are skipped.
pub(super) fn extract_archive(
    archive: impl Read,
    source: &str,
    dir: &Path,
) -> Result<(), ImageError> {
    let tree = Tree::open(dir).map_err(io_error(dir))?;
    let mut budget = MAX_UNPACKED;
    let corrupt = |e: std::io::Error| invalid("oci", format!("{source}: {e}"));
    let mut archive = tar::Archive::new(BufReader::new(archive));
    for entry in archive.entries().map_err(corrupt)? {
        let mut entry = entry.map_err(corrupt)?;
        let Some(rel) = entry_path(&entry).map_err(corrupt)? else {
            continue;
        };
        write_entry(&tree, &mut entry, &rel, false, &mut budget)
            .map_err(|e| invalid("oci", format!("{source}: entry {}: {e}", rel.display())))?;
    }
    Ok(())
}

/// The config blob and the layer files of an OCI image layout, from its `index.json`.
fn oci_layout(index: &[u8], layout: &Tree) -> Result<(Vec<u8>, Vec<LayerFile>), ImageError> {
    let index: Index =
        serde_json::from_slice(index).map_err(|e| invalid("oci", format!("index.json: {e}")))?;
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
            tracing::debug!(digest = %layer.digest, media_type = %layer.media_type, "layer");
            verified_blob_path(layout, &layer.digest).map(|path| LayerFile {
                path,
                diff_id: None,
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

/// The config blob and layer files of `docker save` output (one image), from its
/// `manifest.json`. Nothing there carries a digest of the config or the layers but the
/// config's own `diff_ids`: each layer is checked against its entry before it is applied.
fn docker_save(manifest: &[u8], layout: &Tree) -> Result<(Vec<u8>, Vec<LayerFile>), ImageError> {
    let entries: Vec<DockerEntry> = serde_json::from_slice(manifest)
        .map_err(|e| invalid("oci", format!("manifest.json: {e}")))?;
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
            .ok_or_else(|| invalid("oci", format!("manifest.json names {name:?} outside it")))
    };
    let config_path = inside(&entry.config)?;
    let config = layout
        .read(&config_path, MAX_METADATA)
        .map_err(io_error(&config_path))?;
    // Docker names the config by its digest (`<hex>.json`, or `blobs/sha256/<hex>`).
    let named = config_path
        .file_name()
        .and_then(|n| n.to_str())
        .map(|n| n.trim_end_matches(".json"))
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()));
    if let Some(hex) = named {
        check_digest(
            &format!("sha256:{hex}"),
            &hex::encode(Sha256::digest(&config)),
        )?;
    }
    let diff_ids = serde_json::from_slice::<ImageConfigBlob>(&config)
        .ok()
        .and_then(|c| c.rootfs)
        .map(|r| r.diff_ids)
        .unwrap_or_default();
    if diff_ids.len() != entry.layers.len() {
        return Err(invalid(
            "oci",
            format!(
                "manifest.json lists {} layers, the image config's rootfs.diff_ids {}: \
                 nothing vouches for the layers",
                entry.layers.len(),
                diff_ids.len()
            ),
        ));
    }
    let layers = entry
        .layers
        .iter()
        .zip(diff_ids)
        .map(|(l, diff_id)| {
            inside(l).map(|path| LayerFile {
                path,
                diff_id: Some(diff_id),
            })
        })
        .collect::<Result<_, _>>()?;
    Ok((config, layers))
}

/// `blobs/sha256/<hex>` of `digest`, which must be a sha256 digest.
fn blob_path(digest: &str) -> Result<PathBuf, ImageError> {
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| invalid("oci", format!("{digest:?} is not a sha256 digest")))?;
    Ok(Path::new("blobs/sha256").join(hex))
}

/// A small blob's bytes, checked against its digest.
fn blob(layout: &Tree, digest: &str) -> Result<Vec<u8>, ImageError> {
    let path = blob_path(digest)?;
    let bytes = layout.read(&path, MAX_METADATA).map_err(io_error(&path))?;
    check_digest(digest, &hex::encode(Sha256::digest(&bytes)))?;
    Ok(bytes)
}

/// A layer blob's path, once its contents are checked against its digest.
fn verified_blob_path(layout: &Tree, digest: &str) -> Result<PathBuf, ImageError> {
    let path = blob_path(digest)?;
    let mut file = layout.open_file(&path).map_err(io_error(&path))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).map_err(io_error(&path))?;
    check_digest(digest, &hex::encode(hasher.finalize()))?;
    Ok(path)
}

/// A `docker save` layer's uncompressed tar against its `diff_id`, streamed.
fn check_diff_id(file: &File, diff_id: &str, path: &Path) -> Result<(), ImageError> {
    let mut hasher = Sha256::new();
    let mut tar = layer_reader(file, path)?;
    std::io::copy(&mut tar, &mut hasher).map_err(io_error(path))?;
    check_digest(diff_id, &hex::encode(hasher.finalize())).map_err(|_| {
        invalid(
            "oci",
            format!(
                "layer {} does not match its diff_id {diff_id} in the image config",
                path.display()
            ),
        )
    })
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

/// A layer as a tar stream from its start: plain, gzip or zstd, told by its first bytes.
pub(super) fn layer_reader(file: &File, path: &Path) -> Result<Box<dyn Read>, ImageError> {
    use std::io::{Seek, SeekFrom};
    let mut file = file.try_clone().map_err(io_error(path))?;
    file.seek(SeekFrom::Start(0)).map_err(io_error(path))?;
    let mut magic = [0u8; 4];
    let n = file.read(&mut magic).map_err(io_error(path))?;
    file.seek(SeekFrom::Start(0)).map_err(io_error(path))?;
    let file = BufReader::new(file);
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

/// What a link entry points at.
fn link_target<R: Read>(entry: &tar::Entry<'_, R>) -> std::io::Result<PathBuf> {
    entry
        .link_name()?
        .map(|l| l.into_owned())
        .ok_or_else(|| std::io::Error::other("a link entry without a target"))
}

/// Applies one layer over the tree: its whiteouts first (a `.wh.NAME` removes NAME from the
/// layers below; `.wh..wh..opq` empties its directory of them), then its entries, writing
/// at most `budget` bytes (what is left of it is returned there). `open` gives the layer's
/// tar stream from its start, once for each of the two passes.
pub(super) fn apply_layer<'a>(
    open: &mut dyn FnMut() -> Result<Box<dyn Read + 'a>, ImageError>,
    path: &Path,
    tree: &Tree,
    budget: &mut u64,
) -> Result<(), ImageError> {
    let corrupt = |e: std::io::Error| invalid("oci", format!("layer {}: {e}", path.display()));
    let mut removals: Vec<(PathBuf, bool)> = Vec::new();
    let mut archive = tar::Archive::new(open()?);
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
        let removed = match opaque {
            true => tree.empty(&target),
            false => tree.remove(&target),
        };
        removed
            .map_err(|e| corrupt(std::io::Error::other(format!("{}: {e}", target.display()))))?;
    }
    drop(archive);
    let owners = nix::unistd::geteuid().is_root();
    let mut skipped: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut archive = tar::Archive::new(open()?);
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
        if let Some(what) = write_entry(tree, &mut entry, &rel, owners, budget)
            .map_err(|e| corrupt(std::io::Error::other(format!("{}: {e}", rel.display()))))?
        {
            *skipped.entry(what).or_default() += 1;
        }
    }
    for (what, n) in skipped {
        tracing::info!(layer = %path.display(), what, n, "skipped layer entries");
    }
    Ok(())
}

/// Makes one archive entry at `rel` in `tree` (owned as the entry says when `owners`),
/// charging regular files' bytes to `budget`. `Some(what)` names an entry kind not made.
fn write_entry<R: Read>(
    tree: &Tree,
    entry: &mut tar::Entry<'_, R>,
    rel: &Path,
    owners: bool,
    budget: &mut u64,
) -> std::io::Result<Option<&'static str>> {
    let header = entry.header();
    let kind = header.entry_type();
    let owner = match owners {
        true => Some((
            u32::try_from(header.uid()?).unwrap_or(u32::MAX),
            u32::try_from(header.gid()?).unwrap_or(u32::MAX),
        )),
        false => None,
    };
    let meta = Meta {
        mode: Some(header.mode()? & 0o7777),
        owner,
        mtime: header.mtime().ok(),
    };
    match kind {
        tar::EntryType::Directory => tree.make_dir(rel, meta)?,
        tar::EntryType::Regular | tar::EntryType::Continuous => {
            let written = tree.write_file(rel, entry, *budget, meta)?;
            *budget -= written;
        }
        tar::EntryType::Symlink => tree.symlink(rel, &link_target(entry)?, meta)?,
        tar::EntryType::Link => {
            let target = relative(&link_target(entry)?.to_string_lossy())
                .ok_or_else(|| std::io::Error::other("a hard link to outside the tree"))?;
            tree.hard_link(rel, &target)?;
        }
        // The guest's /dev is its own devtmpfs; device nodes in an image are never used.
        k if k.is_character_special() || k.is_block_special() || k.is_fifo() => {
            return Ok(Some("device or fifo"));
        }
        _ => return Ok(Some("other entry type")),
    }
    Ok(None)
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

    /// A host directory a hostile image aims at: `dirA/a`, `dirB/b`, `precious.txt`.
    fn victim(tmp: &Path) -> PathBuf {
        let v = tmp.join("victim");
        for (path, data) in [("dirA/a", "a"), ("dirB/b", "b"), ("precious.txt", "p")] {
            std::fs::create_dir_all(v.join(path).parent().unwrap()).unwrap();
            std::fs::write(v.join(path), data).unwrap();
        }
        v
    }

    fn victim_untouched(v: &Path) {
        for (path, data) in [("dirA/a", "a"), ("dirB/b", "b"), ("precious.txt", "p")] {
            assert_eq!(
                std::fs::read_to_string(v.join(path)).unwrap_or_default(),
                data,
                "{path} was touched"
            );
        }
    }

    /// The reproductions of the security review: removals and replacements that followed
    /// symlinks planted by earlier entries or layers. Each leaves the host tree as it was.
    #[test]
    fn hostile_layers_never_remove_or_replace_host_files() {
        let tmp = tempfile::tempdir().unwrap();
        let v = victim(tmp.path());
        let dir_a = v.join("dirA");
        let climbing = format!("up{}", v.join("precious.txt").display());
        let cases: Vec<Vec<Vec<LayerEntry<'_>>>> = vec![
            // An opaque whiteout through a link to a host directory.
            vec![
                vec![LayerEntry::Symlink("evil", dir_a.to_str().unwrap())],
                vec![LayerEntry::File("evil/.wh..wh..opq", 0o644, b"")],
            ],
            // A whiteout of a host file through a link.
            vec![
                vec![LayerEntry::Symlink("evil", v.to_str().unwrap())],
                vec![LayerEntry::File("evil/.wh.precious.txt", 0o644, b"")],
            ],
            // A directory entry replacing a host file, a file entry replacing a host
            // directory, both through a link planted in the same layer.
            vec![vec![
                LayerEntry::Symlink("evil", v.to_str().unwrap()),
                LayerEntry::Dir("evil/precious.txt", 0o755),
                LayerEntry::File("evil/dirB", 0o644, b"replaced"),
                LayerEntry::Symlink("evil/dirA", "/"),
            ]],
            // The same through a relative link that climbs.
            vec![vec![
                LayerEntry::Symlink("up", "../../../../../../../../.."),
                LayerEntry::File(&climbing, 0o644, b"x"),
            ]],
        ];
        for (i, layers) in cases.iter().enumerate() {
            let layout = tmp.path().join(format!("layout-{i}"));
            let tars: Vec<Vec<u8>> = layers
                .iter()
                .map(|l| oci_layout::layer(l).unwrap())
                .collect();
            oci_layout::write(&layout, &tars, serde_json::json!({"Cmd": ["/x"]})).unwrap();
            let root = tmp.path().join(format!("root-{i}"));
            std::fs::create_dir(&root).unwrap();
            let _ = unpack(&layout, &root, tmp.path());
            victim_untouched(&v);
        }
    }

    /// `docker save` output as a tar: a manifest.json, a config named by its digest with the
    /// layers' diff_ids, and the layers.
    fn docker_archive(path: &Path, layers: &[Vec<u8>], diff_ids: &[String]) {
        let config = serde_json::to_vec(&serde_json::json!({
            "config": {"Cmd": ["/x"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }))
        .unwrap();
        let config_name = format!("{}.json", hex::encode(Sha256::digest(&config)));
        let names: Vec<String> = (0..layers.len())
            .map(|i| format!("l{i}/layer.tar"))
            .collect();
        let manifest = serde_json::to_vec(&serde_json::json!([
            {"Config": config_name, "RepoTags": ["x:latest"], "Layers": names}
        ]))
        .unwrap();
        let mut entries = vec![
            LayerEntry::File("manifest.json", 0o644, &manifest),
            LayerEntry::File(&config_name, 0o644, &config),
        ];
        for (name, layer) in names.iter().zip(layers) {
            entries.push(LayerEntry::File(name, 0o644, layer));
        }
        std::fs::write(path, oci_layout::layer(&entries).unwrap()).unwrap();
    }

    fn sha256_of(bytes: &[u8]) -> String {
        format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
    }

    #[test]
    fn docker_save_layers_are_checked_against_diff_ids_and_archive_links_stay_inside() {
        let tmp = tempfile::tempdir().unwrap();
        let layer = oci_layout::layer(&[LayerEntry::File("app", 0o755, b"app")]).unwrap();
        let unpack_archive = |name: &str, diff_ids: &[String], layers: &[Vec<u8>]| {
            let archive = tmp.path().join(format!("{name}.tar"));
            docker_archive(&archive, layers, diff_ids);
            let root = tmp.path().join(format!("root-{name}"));
            std::fs::create_dir(&root).unwrap();
            let scratch = tmp.path().join(format!("scratch-{name}"));
            std::fs::create_dir(&scratch).unwrap();
            (unpack(&archive, &root, &scratch), root)
        };
        let (ok, root) = unpack_archive("good", &[sha256_of(&layer)], std::slice::from_ref(&layer));
        ok.unwrap();
        assert_eq!(std::fs::read(root.join("app")).unwrap(), b"app");

        // A layer swapped after the config was made.
        let other = oci_layout::layer(&[LayerEntry::File("app", 0o755, b"evil")]).unwrap();
        let (err, _) = unpack_archive("swapped", &[sha256_of(&layer)], &[other]);
        let err = err.unwrap_err().to_string();
        assert!(err.contains("diff_id"), "{err}");
        let (err, _) = unpack_archive("no-diff-ids", &[], std::slice::from_ref(&layer));
        assert!(err.unwrap_err().to_string().contains("diff_ids"));

        // An archive link to the host's root, and a manifest naming a layer through it: the
        // host file is never read into the image.
        let host = tmp.path().join("host-secret");
        std::fs::write(
            &host,
            oci_layout::layer(&[LayerEntry::File("stolen", 0o644, b"secret")]).unwrap(),
        )
        .unwrap();
        let archive = tmp.path().join("linked.tar");
        let via_link = format!("root{}", host.display());
        let config = serde_json::to_vec(&serde_json::json!({
            "config": {"Cmd": ["/x"]},
            "rootfs": {"diff_ids": [sha256_of(&std::fs::read(&host).unwrap())]},
        }))
        .unwrap();
        let manifest = serde_json::to_vec(&serde_json::json!([
            {"Config": "config.json", "Layers": [via_link]}
        ]))
        .unwrap();
        std::fs::write(
            &archive,
            oci_layout::layer(&[
                LayerEntry::Symlink("root", "/"),
                LayerEntry::File("manifest.json", 0o644, &manifest),
                LayerEntry::File("config.json", 0o644, &config),
            ])
            .unwrap(),
        )
        .unwrap();
        let root = tmp.path().join("root-linked");
        std::fs::create_dir(&root).unwrap();
        let scratch = tmp.path().join("scratch-linked");
        std::fs::create_dir(&scratch).unwrap();
        assert!(unpack(&archive, &root, &scratch).is_err());
        assert!(!root.join("stolen").exists());
    }
}
