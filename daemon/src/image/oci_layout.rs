//! Writes an OCI image layout: the other half of [`super::oci`], for tests and for the Linux
//! lane, which build their container images locally (no registry is reachable there).

use std::path::Path;

use sha2::{Digest, Sha256};

/// One file of a layer: its path in the image, its mode, and what it is.
pub enum LayerEntry<'a> {
    File(&'a str, u32, &'a [u8]),
    Dir(&'a str, u32),
    Symlink(&'a str, &'a str),
    /// A regular file of this uid and gid (the others are root's).
    Owned(&'a str, u32, u32, u32, &'a [u8]),
    /// A regular file whose name goes into the header as is, unchecked (a hostile layer's
    /// `../x`): at most 100 bytes.
    RawName(&'a [u8], &'a [u8]),
}

/// A layer as an uncompressed tar (a `.wh.NAME` file is a whiteout).
pub fn layer(entries: &[LayerEntry<'_>]) -> std::io::Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries {
        let mut header = tar::Header::new_gnu();
        header.set_mtime(0);
        header.set_uid(0);
        header.set_gid(0);
        match entry {
            LayerEntry::File(path, mode, bytes) => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(*mode);
                header.set_size(bytes.len() as u64);
                builder.append_data(&mut header, path, *bytes)?;
            }
            LayerEntry::Owned(path, uid, gid, mode, bytes) => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_uid(u64::from(*uid));
                header.set_gid(u64::from(*gid));
                header.set_mode(*mode);
                header.set_size(bytes.len() as u64);
                builder.append_data(&mut header, path, *bytes)?;
            }
            LayerEntry::Dir(path, mode) => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_mode(*mode);
                header.set_size(0);
                builder.append_data(&mut header, path, std::io::empty())?;
            }
            LayerEntry::RawName(name, bytes) => {
                let mut raw = tar::Header::new_old();
                raw.as_old_mut().name[..name.len()].copy_from_slice(name);
                raw.set_entry_type(tar::EntryType::Regular);
                raw.set_mode(0o644);
                raw.set_mtime(0);
                raw.set_size(bytes.len() as u64);
                raw.set_cksum();
                builder.append(&raw, *bytes)?;
            }
            LayerEntry::Symlink(path, target) => {
                header.set_entry_type(tar::EntryType::Symlink);
                header.set_mode(0o777);
                header.set_size(0);
                builder.append_link(&mut header, path, target)?;
            }
        }
    }
    builder.into_inner()
}

/// Gzips a layer, as registries ship them.
pub fn gzip(bytes: &[u8]) -> std::io::Result<Vec<u8>> {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes)?;
    encoder.finish()
}

fn put_blob(dir: &Path, bytes: &[u8]) -> std::io::Result<(String, u64)> {
    let hex = hex::encode(Sha256::digest(bytes));
    std::fs::write(dir.join("blobs/sha256").join(&hex), bytes)?;
    Ok((format!("sha256:{hex}"), bytes.len() as u64))
}

/// Writes an image layout into `dir`: `layers` (tar, maybe gzipped) bottom first, and a
/// config whose `config` object is `run` (Entrypoint, Cmd, Env, WorkingDir, User).
pub fn write(dir: &Path, layers: &[Vec<u8>], run: serde_json::Value) -> std::io::Result<()> {
    std::fs::create_dir_all(dir.join("blobs/sha256"))?;
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": run,
        "rootfs": {"type": "layers", "diff_ids": []},
    });
    let (config_digest, config_size) = put_blob(dir, config.to_string().as_bytes())?;
    let layer_descriptors = layers
        .iter()
        .map(|bytes| {
            let gzipped = bytes.starts_with(&[0x1f, 0x8b]);
            put_blob(dir, bytes).map(|(digest, size)| {
                serde_json::json!({
                    "mediaType": if gzipped {
                        "application/vnd.oci.image.layer.v1.tar+gzip"
                    } else {
                        "application/vnd.oci.image.layer.v1.tar"
                    },
                    "digest": digest,
                    "size": size,
                })
            })
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": layer_descriptors,
    });
    let (manifest_digest, manifest_size) = put_blob(dir, manifest.to_string().as_bytes())?;
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest,
            "size": manifest_size,
            "platform": {"architecture": "amd64", "os": "linux"},
        }],
    });
    std::fs::write(dir.join("index.json"), index.to_string())
}
