//! Templates shared by a fleet: a node that made its image's template publishes it to the
//! fleet's snapshot store, and a node whose image has the same key (image digest, kernel,
//! agent, VMM version, VM shape, host CPU) fetches it instead of booting one of its own.
//!
//! Where a template's archive is, and the digest that pins it, is read from the fleet's
//! shared journal, from the node status each node writes there with its heartbeats: the
//! store itself is never trusted to say what a template is (the same rule as a suspend's
//! snapshot, whose pinned URI is in the session's log).

use std::sync::Arc;

use super::remote::{Archive, FetchLimits};
use super::{GuestImage, MicrovmRuntime};
use crate::journal::Journal;

impl MicrovmRuntime {
    /// From now on, templates are looked for among those the fleet sharing `journal`
    /// published (when the node also has a fleet snapshot store).
    pub fn join_fleet(&self, journal: Arc<dyn Journal>) {
        let _ = self.fleet_journal.set(journal);
    }

    /// The pinned URI of template `id` in the fleet's store, if this node published it.
    pub(super) fn published_template_uri(&self, id: &str) -> Option<String> {
        let remote = self.config.snapshot_remote.as_ref()?;
        let pins = self.store.pins(id).ok()??;
        let archive = Archive {
            id: id.to_owned(),
            base: None,
        };
        Some(remote.pinned_uri(&archive, &pins))
    }

    /// Publishes this node's current templates that the fleet's store lacks (at each
    /// periodic sweep: off every session's path and off start-up).
    pub(super) async fn publish_templates(&self) {
        if self.config.snapshot_remote.is_none() || self.fleet_journal.get().is_none() {
            return;
        }
        let unpublished = self
            .template_status()
            .into_iter()
            .filter(|t| t.current && t.published.is_empty());
        for template in unpublished {
            let Ok(dir) = self.store.dir(&template.id) else {
                continue;
            };
            match self.publish(&template.id, &dir).await {
                Ok(uri) => {
                    tracing::info!(template = %template.id, %uri, "template published to the fleet")
                }
                Err(e) => tracing::warn!(template = %template.id, error = %e,
                    "the template was not published; the next sweep tries again"),
            }
        }
    }

    /// Fetches template `key` from the fleet's store if another node published it; false
    /// if none did, or it could not be fetched (this node then makes its own).
    pub(super) async fn fetch_fleet_template(
        &self,
        image: &GuestImage,
        key: &super::templates::TemplateKey,
    ) -> bool {
        let (Some(remote), Some(journal)) =
            (&self.config.snapshot_remote, self.fleet_journal.get())
        else {
            return false;
        };
        let (journal, id) = (journal.clone(), key.id.clone());
        let uri = tokio::task::spawn_blocking(move || published_by_the_fleet(&*journal, &id))
            .await
            .ok()
            .flatten();
        let Some(uri) = uri else {
            return false;
        };
        let memory = image.memory_mib.unwrap_or(self.config.memory_mib);
        let limits = FetchLimits {
            max_file_bytes: memory.max(image.workspace_mib) << 20,
            min_free_bytes: self.config.min_free_disk_bytes,
        };
        let started = std::time::Instant::now();
        let _one_at_a_time = self.fetching.lock().await;
        match remote.fetch(&uri, &self.store, limits).await {
            Ok(_) => {
                tracing::info!(template = %key.id, %uri,
                    took_ms = started.elapsed().as_millis() as u64,
                    "template fetched from the fleet");
                true
            }
            Err(e) => {
                tracing::warn!(template = %key.id, %uri, error = %e,
                    "the fleet's template could not be fetched: this node makes its own");
                false
            }
        }
    }
}

impl MicrovmRuntime {
    /// The templates some live node of the fleet (this one included) has as an image's
    /// current one; `None` if the fleet's journal cannot tell (then none is swept).
    pub(super) async fn templates_the_fleet_wants(
        &self,
    ) -> Option<std::collections::HashSet<String>> {
        let mut wanted: std::collections::HashSet<String> = self
            .template_status()
            .into_iter()
            .filter(|t| t.current)
            .map(|t| t.id)
            .collect();
        let Some(journal) = self.fleet_journal.get() else {
            return Some(wanted);
        };
        let journal = journal.clone();
        let nodes = tokio::task::spawn_blocking(move || journal.nodes())
            .await
            .ok()?
            .ok()?;
        wanted.extend(
            nodes
                .iter()
                .filter(|n| n.alive)
                .flat_map(|n| current_templates(&n.status)),
        );
        Some(wanted)
    }
}

/// The templates a node's status JSON reports as current.
fn current_templates(status: &str) -> Vec<String> {
    let Ok(status) = serde_json::from_str::<serde_json::Value>(status) else {
        return Vec::new();
    };
    status["templates"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["current"].as_bool().unwrap_or(false))
        .filter_map(|t| t["id"].as_str().map(str::to_owned))
        .collect()
}

/// Where a node of the fleet says it published template `id` (any node's archive of one
/// key holds the same template).
fn published_by_the_fleet(journal: &dyn Journal, id: &str) -> Option<String> {
    journal
        .nodes()
        .ok()?
        .into_iter()
        .find_map(|node| published_in(&node.status, id))
}

/// Where a node's status JSON says it published template `id`. Read loosely: a node of
/// another version may report fields this one does not know.
fn published_in(status: &str, id: &str) -> Option<String> {
    let status: serde_json::Value = serde_json::from_str(status).ok()?;
    status["templates"].as_array()?.iter().find_map(|t| {
        let published = t["published"].as_str().filter(|p| !p.is_empty())?;
        (t["id"].as_str() == Some(id)).then(|| published.to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_s_status_tells_its_current_and_published_templates() {
        let status = r#"{"hostname": "n", "templates": [
            {"harness": "a", "id": "template.a.1", "current": true,
             "published": "file:///fleet/_/template.a.1.agvmsnap#sha256=ab"},
            {"harness": "a", "id": "template.a.0", "published": ""},
            {"harness": "b", "id": "template.b.1", "current": true, "futureField": 7}
        ]}"#;
        assert_eq!(current_templates(status), ["template.a.1", "template.b.1"]);
        assert_eq!(
            published_in(status, "template.a.1").as_deref(),
            Some("file:///fleet/_/template.a.1.agvmsnap#sha256=ab")
        );
        assert_eq!(published_in(status, "template.a.0"), None, "not published");
        assert_eq!(published_in(status, "template.b.1"), None);
        assert_eq!(published_in(status, "template.c.1"), None);
        assert!(current_templates("not json").is_empty());
        assert_eq!(published_in("{}", "template.a.1"), None);
    }
}
