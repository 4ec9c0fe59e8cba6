//! The `remote` runtime: a registered harness already serving at an address. It provisions
//! nothing, so Create/Restore only hand out the address, Stop is a no-op, and it can keep no
//! memory (`memory_snapshot: false`).

use std::sync::Arc;

use agentvm_proto::v1::{RuntimeCapabilities, SnapshotRef};

use super::{
    ForkOpts, Incarnation, ObservedState, Result, Runtime, RuntimeError, SessionSpec, SnapshotKind,
};
use crate::client::connect_address;
use crate::controller::endpoint::{GrpcEndpoint, HarnessEndpoint};

pub const NAME: &str = "remote";

pub struct RemoteRuntime {
    address: String,
}

impl RemoteRuntime {
    pub fn new(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
        }
    }

    fn incarnation(&self, uid: &str) -> Incarnation {
        Incarnation {
            id: uid.to_owned(),
            worker: String::new(),
            address: self.address.clone(),
            runtime: NAME.into(),
            fence_token: 0,
        }
    }
}

#[async_trait::async_trait]
impl Runtime for RemoteRuntime {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> RuntimeCapabilities {
        RuntimeCapabilities::default()
    }

    async fn create(&self, spec: &SessionSpec) -> Result<Incarnation> {
        Ok(self.incarnation(&spec.session_uid))
    }

    async fn snapshot(&self, incarnation: &Incarnation, kind: SnapshotKind) -> Result<SnapshotRef> {
        if kind == SnapshotKind::Local {
            return Err(RuntimeError::Unsupported {
                runtime: NAME,
                operation: "LOCAL (warm) snapshot",
            });
        }
        Ok(SnapshotRef {
            local: incarnation.id.clone(),
            ..Default::default()
        })
    }

    async fn restore(&self, _snapshot: &SnapshotRef, spec: &SessionSpec) -> Result<Incarnation> {
        Ok(self.incarnation(&spec.session_uid))
    }

    async fn fork(&self, _snapshot: &SnapshotRef, _opts: &ForkOpts) -> Result<Option<Incarnation>> {
        Ok(None)
    }

    async fn stop(&self, _incarnation: &Incarnation) -> Result<()> {
        Ok(())
    }

    async fn status(&self, _incarnation: &Incarnation) -> Result<ObservedState> {
        Ok(ObservedState::Live)
    }

    async fn dial(&self, incarnation: &Incarnation) -> Result<Arc<dyn HarnessEndpoint>> {
        let channel =
            connect_address(&incarnation.address)
                .await
                .map_err(|e| RuntimeError::Failed {
                    runtime: NAME,
                    session: incarnation.id.clone(),
                    reason: format!("{e:#}"),
                })?;
        Ok(Arc::new(GrpcEndpoint::new(channel)))
    }
}
