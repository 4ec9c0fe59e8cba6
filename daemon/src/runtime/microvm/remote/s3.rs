//! Snapshot archives in an S3-compatible bucket, through the `object_store` client: uploads
//! in parts streamed from a file (the object appears whole when the upload completes, or
//! not at all), downloads streamed to a file, and a size check after each upload.

use std::path::Path;
use std::sync::Arc;

use futures_util::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as Key;
use object_store::{ObjectStore, WriteMultipart};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Parts of a multipart upload (S3's minimum is 5 MiB, the last part aside).
const PART_SIZE: usize = 8 << 20;
/// Parts in flight at once.
const PARTS_IN_FLIGHT: usize = 4;
/// How long a request is retried before the store counts as unreachable: a suspend waits
/// for its upload with the VM paused, so it must fail in bounded time (and the VM go on).
const RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(20);
const RETRIES: usize = 4;

#[derive(Clone)]
pub struct S3Remote {
    bucket: String,
    /// Key prefix, without leading or trailing slash (may be empty).
    prefix: String,
    store: Arc<AmazonS3>,
}

impl std::fmt::Debug for S3Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl S3Remote {
    /// `BUCKET/PREFIX` (after `s3://`), with the endpoint, region and credentials of the
    /// standard `AWS_*` environment. An `http://` endpoint is allowed only when given
    /// explicitly.
    pub fn from_env(rest: &str) -> Result<Self, String> {
        Self::with_vars(rest, std::env::vars())
    }

    /// As [`Self::from_env`], with `vars` (`AWS_*` names and values) for the environment.
    pub fn with_vars(
        rest: &str,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, String> {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(format!(
                "snapshot_url s3://{rest}: the bucket is missing (s3://BUCKET/PREFIX)"
            ));
        }
        let prefix = prefix.trim_matches('/').to_owned();
        let mut builder = AmazonS3Builder::new().with_bucket_name(bucket);
        let mut endpoint = String::new();
        for (key, value) in vars {
            if !key.starts_with("AWS_") {
                continue;
            }
            if key == "AWS_ENDPOINT_URL" || key == "AWS_ENDPOINT" {
                endpoint = value.clone();
            }
            if let Ok(config) = key.to_ascii_lowercase().parse() {
                builder = builder.with_config(config, value);
            }
        }
        if endpoint.starts_with("http://") {
            builder = builder.with_allow_http(true);
        }
        builder = builder.with_retry(object_store::RetryConfig {
            backoff: Default::default(),
            max_retries: RETRIES,
            retry_timeout: RETRY_FOR,
        });
        let store = builder
            .build()
            .map_err(|e| format!("snapshot_url s3://{rest}: {e}"))?;
        Ok(Self {
            bucket: bucket.to_owned(),
            prefix,
            store: Arc::new(store),
        })
    }

    /// The object of `name` (a path below the prefix).
    fn key(&self, name: &str) -> Key {
        match self.prefix.is_empty() {
            true => Key::from(name),
            false => Key::from(format!("{}/{name}", self.prefix)),
        }
    }

    pub fn uri(&self, name: &str) -> String {
        format!("s3://{}/{}", self.bucket, self.key(name))
    }

    /// The path below the prefix that `uri` names, if it is an object of this remote.
    pub fn key_of(&self, uri: &str) -> Option<String> {
        let rest = uri.strip_prefix("s3://")?;
        let (bucket, key) = rest.split_once('/')?;
        if bucket != self.bucket {
            return None;
        }
        let name = match self.prefix.is_empty() {
            true => key,
            false => key.strip_prefix(&self.prefix)?.strip_prefix('/')?,
        };
        Some(name.to_owned())
    }

    pub fn describe(&self) -> String {
        format!("s3://{}/{}", self.bucket, self.prefix)
    }

    pub async fn exists(&self, name: &str) -> Result<bool, String> {
        match self.store.head(&self.key(name)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(format!("looking up {}: {e}", self.uri(name))),
        }
    }

    /// The objects below the prefix (below `dir` in it, if given) as paths below the
    /// prefix, with when each was written.
    pub async fn list(
        &self,
        dir: Option<&str>,
    ) -> Result<Vec<(String, std::time::SystemTime)>, String> {
        let under = match dir {
            Some(dir) => self.key(dir),
            None if self.prefix.is_empty() => Key::default(),
            None => Key::from(self.prefix.as_str()),
        };
        let root = match self.prefix.is_empty() {
            true => String::new(),
            false => format!("{}/", self.prefix),
        };
        let mut listing = self.store.list(Some(&under));
        let mut found = Vec::new();
        while let Some(object) = listing.next().await {
            let object =
                object.map_err(|e| format!("listing {}: {e}", self.uri(dir.unwrap_or(""))))?;
            if let Some(name) = object.location.as_ref().strip_prefix(&root) {
                found.push((name.to_owned(), object.last_modified.into()));
            }
        }
        Ok(found)
    }

    /// Uploads the archive at `file` as object `name`.
    pub async fn upload(&self, file: &Path, name: &str) -> Result<(), String> {
        let key = self.key(name);
        let what = |e: &dyn std::fmt::Display| format!("uploading {}: {e}", self.uri(name));
        let mut source = tokio::fs::File::open(file)
            .await
            .map_err(|e| format!("opening {}: {e}", file.display()))?;
        let size = source
            .metadata()
            .await
            .map_err(|e| format!("{}: {e}", file.display()))?
            .len();
        let upload = self.store.put_multipart(&key).await.map_err(|e| what(&e))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_SIZE);
        let mut buf = vec![0u8; PART_SIZE];
        let streamed = async {
            loop {
                let n = source.read(&mut buf).await.map_err(|e| what(&e))?;
                if n == 0 {
                    return Ok(());
                }
                writer
                    .wait_for_capacity(PARTS_IN_FLIGHT)
                    .await
                    .map_err(|e| what(&e))?;
                writer.write(&buf[..n]);
            }
        }
        .await;
        if let Err(e) = streamed {
            let _ = writer.abort().await;
            return Err(e);
        }
        writer.finish().await.map_err(|e| what(&e))?;
        let stored = self.store.head(&key).await.map_err(|e| what(&e))?;
        if stored.size != size {
            return Err(format!(
                "uploading {}: the store holds {} bytes of {size}",
                self.uri(name),
                stored.size
            ));
        }
        Ok(())
    }

    /// Downloads object `name` into `file` (synced), refusing an object of more than `max_bytes`
    /// (checked as it streams: a store's declared length is no promise).
    pub async fn download(&self, name: &str, file: &Path, max_bytes: u64) -> Result<(), String> {
        let what = |e: &dyn std::fmt::Display| format!("downloading {}: {e}", self.uri(name));
        let got = self
            .store
            .get(&self.key(name))
            .await
            .map_err(|e| what(&e))?;
        let mut out = tokio::fs::File::create(file)
            .await
            .map_err(|e| format!("creating {}: {e}", file.display()))?;
        if got.meta.size > max_bytes {
            return Err(format!(
                "{} is {} bytes, over the {max_bytes} this fetch may write",
                self.uri(name),
                got.meta.size
            ));
        }
        let mut stream = got.into_stream();
        let mut downloaded = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| what(&e))?;
            downloaded = downloaded.saturating_add(chunk.len() as u64);
            if downloaded > max_bytes {
                return Err(format!(
                    "{} streams more than the {max_bytes} bytes this fetch may write",
                    self.uri(name)
                ));
            }
            out.write_all(&chunk)
                .await
                .map_err(|e| format!("writing {}: {e}", file.display()))?;
        }
        out.sync_all()
            .await
            .map_err(|e| format!("syncing {}: {e}", file.display()))
    }

    /// Deletes object `name` (gone already is fine).
    pub async fn remove(&self, name: &str) -> Result<(), String> {
        match self.store.delete(&self.key(name)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(format!("deleting {}: {e}", self.uri(name))),
        }
    }
}
