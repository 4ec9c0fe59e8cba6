//! `agentsessions.v1.HarnessRegistry` over gRPC, on the admin listener only.

use std::sync::Arc;
use std::time::Duration;

use agentvm_proto::v1::harness_client::HarnessClient;
use agentvm_proto::v1::harness_registry_server::HarnessRegistry;
use agentvm_proto::v1::{
    DescribeRequest, GetHarnessRequest, HarnessRegistration, ListHarnessesRequest,
    ListHarnessesResponse, RegisterHarnessRequest, RegisterHarnessResponse, RetireHarnessRequest,
    harness_spec::Placement,
};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use tonic::{Request, Response, Status};

use crate::client::connect_address;
use crate::registry::{Entry, Registry, RegistryError, entry_view};

/// Upstream bounds Describe at admission to 10 s; observation uses the same bound.
pub const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(10);

const DEFAULT_PAGE: usize = 50;
const MAX_PAGE: usize = 500;

pub struct RegistryService {
    registry: Arc<Registry>,
    describe_timeout: Duration,
}

impl RegistryService {
    pub fn new(registry: Arc<Registry>) -> Self {
        Self {
            registry,
            describe_timeout: DESCRIBE_TIMEOUT,
        }
    }

    pub fn with_describe_timeout(mut self, timeout: Duration) -> Self {
        self.describe_timeout = timeout;
        self
    }

    /// Runs blocking registry work off the async threads.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Registry) -> Result<T, RegistryError> + Send + 'static,
    ) -> Result<T, Status> {
        let registry = Arc::clone(&self.registry);
        tokio::task::spawn_blocking(move || f(&registry))
            .await
            .map_err(|e| Status::internal(format!("registry task failed: {e}")))?
            .map_err(Status::from)
    }
}

/// Calls Describe on a registered remote harness, within `timeout`.
async fn describe(
    address: &str,
    timeout: Duration,
) -> Result<agentvm_proto::v1::HarnessDescriptor, String> {
    let call = async {
        let channel = connect_address(address)
            .await
            .map_err(|e| format!("{e:#}"))?;
        HarnessClient::new(channel)
            .describe(DescribeRequest {})
            .await
            .map(Response::into_inner)
            .map_err(|s| format!("Describe failed: {}: {}", s.code(), s.message()))
    };
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or_else(|_| Err(format!("Describe did not answer within {timeout:?}")))
}

#[tonic::async_trait]
impl HarnessRegistry for RegistryService {
    async fn register_harness(
        &self,
        request: Request<RegisterHarnessRequest>,
    ) -> Result<Response<RegisterHarnessResponse>, Status> {
        let req = request.into_inner();
        let (harness, outcome) = self
            .blocking(move |r| r.register(&req.name, req.spec))
            .await?;
        Ok(Response::new(RegisterHarnessResponse {
            harness: Some(harness),
            outcome: outcome as i32,
        }))
    }

    async fn get_harness(
        &self,
        request: Request<GetHarnessRequest>,
    ) -> Result<Response<HarnessRegistration>, Status> {
        let req = request.into_inner();
        if req.name.is_empty() {
            return Err(Status::invalid_argument("name: is required"));
        }
        let name = req.name.clone();
        let (mut view, address) = self
            .blocking(move |r| {
                let entry = r.get(&name)?;
                let address = match &entry {
                    Entry::Registered(h) => h.spec.as_ref().and_then(|s| match &s.placement {
                        Some(Placement::Remote(remote)) => Some(remote.address.clone()),
                        _ => None,
                    }),
                    Entry::Static(_) => None,
                };
                Ok((entry_view(&entry), address))
            })
            .await?;
        if req.observe {
            // Observation never fails the call: its outcome rides on the response.
            match address {
                Some(address) => match describe(&address, self.describe_timeout).await {
                    Ok(d) => view.observed = Some(d),
                    Err(e) => view.observe_error = e,
                },
                None => {
                    view.observe_error = if view.unservable_reason.is_empty() {
                        "this harness has no address to describe".into()
                    } else {
                        view.unservable_reason.clone()
                    }
                }
            }
        }
        Ok(Response::new(view))
    }

    async fn list_harnesses(
        &self,
        request: Request<ListHarnessesRequest>,
    ) -> Result<Response<ListHarnessesResponse>, Status> {
        let req = request.into_inner();
        let size = match req.page_size {
            n if n < 0 => {
                return Err(Status::invalid_argument(format!(
                    "page_size: {n} is negative"
                )));
            }
            0 => DEFAULT_PAGE,
            n => (n as usize).min(MAX_PAGE),
        };
        let after = if req.page_token.is_empty() {
            String::new()
        } else {
            URL_SAFE_NO_PAD
                .decode(&req.page_token)
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
                .filter(|s| !s.is_empty())
                .ok_or_else(|| {
                    Status::invalid_argument("page_token: not a token this server issued")
                })?
        };
        let include_retired = req.include_retired;
        let mut page = self
            .blocking(move |r| {
                Ok(r.list(&after, size + 1, include_retired)?
                    .iter()
                    .map(entry_view)
                    .collect::<Vec<_>>())
            })
            .await?;
        let next_page_token = if page.len() > size {
            page.truncate(size);
            let last = page
                .last()
                .and_then(|h| h.metadata.as_ref())
                .map(|m| m.name.clone())
                .unwrap_or_default();
            URL_SAFE_NO_PAD.encode(last)
        } else {
            String::new()
        };
        Ok(Response::new(ListHarnessesResponse {
            harnesses: page,
            next_page_token,
        }))
    }

    async fn retire_harness(
        &self,
        request: Request<RetireHarnessRequest>,
    ) -> Result<Response<HarnessRegistration>, Status> {
        let req = request.into_inner();
        if req.name.is_empty() {
            return Err(Status::invalid_argument("name: is required"));
        }
        let view = self
            .blocking(move |r| r.retire(&req.name, &req.reason))
            .await?;
        Ok(Response::new(view))
    }
}
