//! `agentsessions.v1.Sessions` over tonic: field-by-field validation (INVALID_ARGUMENT naming
//! the field), then the session host. Every RPC of wire.md is served; none answers
//! UNIMPLEMENTED.

use std::pin::Pin;
use std::sync::Arc;

use agentvm_proto::v1::sessions_server::{Sessions, SessionsServer};
use agentvm_proto::v1::{
    ApproveRequest, ApproveResponse, CancelRequest, CreateSessionRequest, DeleteSessionRequest,
    ExecRequest, ExecUpdate, ForkRequest, ForkResponse, GetSessionRequest, ListSessionsRequest,
    ListSessionsResponse, LogRecord, Message, ReplayRequest, ResumeRequest, Session,
    SuspendRequest,
};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::auth::{self, Principal, principal_of};
use super::metadata_limits as limits;
use super::{page_token, request_id};
use crate::session::{NewSession, SessionHost};

/// Fork fan-out bound (upstream's MaxForkChildren).
pub const MAX_FORK_CHILDREN: i32 = 128;
const DEFAULT_PAGE_SIZE: usize = 50;
const MAX_PAGE_SIZE: usize = 500;
/// Records and deltas buffered per Exec stream before the turn waits for the client.
const EXEC_BUFFER: usize = 64;
const MESSAGE_ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

pub struct SessionsService {
    host: Arc<SessionHost>,
}

/// Runs `f` with the principal (if any) as the actor of the events it appends.
async fn as_actor<F: std::future::Future>(principal: Option<&Principal>, f: F) -> F::Output {
    match principal {
        Some(p) => auth::ACTOR.scope(p.actor(), f).await,
        None => f.await,
    }
}

impl SessionsService {
    /// The session's project must be the principal's (PERMISSION_DENIED otherwise).
    fn authorize_session(&self, principal: Option<&Principal>, uid: &str) -> Result<(), Status> {
        if principal.is_none() {
            return Ok(());
        }
        let session = self.host.view(uid)?;
        let project = session.metadata.map(|m| m.project).unwrap_or_default();
        auth::authorize(principal, &project)
    }
}

impl SessionsService {
    pub fn new(host: Arc<SessionHost>) -> Self {
        Self { host }
    }

    pub fn into_server(self) -> SessionsServer<Self> {
        SessionsServer::new(self)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20)
    }
}

/// Upstream's refusal of `ForkRequest.identity`, word for word.
pub const FORK_IDENTITY_UNSUPPORTED: &str =
    "ForkRequest.identity is unsupported: per-child principals are not enforced";

fn invalid(field: &str, why: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {why}"))
}

fn required(field: &str, value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(invalid(field, "is required"));
    }
    Ok(())
}

fn check_messages(field: &str, messages: &[Message]) -> Result<(), Status> {
    for (i, m) in messages.iter().enumerate() {
        if !MESSAGE_ROLES.contains(&m.role.as_str()) {
            return Err(invalid(
                &format!("{field}[{i}].role"),
                format!("{:?} is not one of {}", m.role, MESSAGE_ROLES.join(", ")),
            ));
        }
        if let Some(j) = m.parts.iter().position(|p| p.part.is_none()) {
            return Err(invalid(
                &format!("{field}[{i}].parts[{j}]"),
                "has no content",
            ));
        }
    }
    Ok(())
}

/// The per-session egress list must parse (whether the session's image covers it is known
/// only where its compute starts, and checked there).
fn check_egress_annotation(
    annotations: &std::collections::HashMap<String, String>,
) -> Result<(), Status> {
    use crate::runtime::microvm::network::EGRESS_ANNOTATION;
    let Some(value) = annotations.get(EGRESS_ANNOTATION) else {
        return Ok(());
    };
    for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        agentvm_guest::egress::AllowEntry::parse(entry).map_err(|why| {
            invalid(
                &format!("session.annotations[{EGRESS_ANNOTATION:?}]"),
                format!("{entry:?}: {why}"),
            )
        })?;
    }
    Ok(())
}

type Stream_<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Sessions for SessionsService {
    async fn create_session(
        &self,
        request: Request<CreateSessionRequest>,
    ) -> Result<Response<Session>, Status> {
        let principal = principal_of(&request);
        let s = request.into_inner().session.unwrap_or_default();
        let meta = s.metadata.unwrap_or_default();
        let project = if meta.project.is_empty() {
            crate::session::DEFAULT_PROJECT
        } else {
            meta.project.as_str()
        };
        auth::authorize(principal.as_ref(), project)?;
        if !meta.uid.is_empty() {
            return Err(invalid("session.metadata.uid", "is assigned by the server"));
        }
        if !s.parent_uid.is_empty() || s.fork_seq != 0 {
            return Err(invalid("session.parent_uid", "is set only by Fork"));
        }
        limits::check_map("session.labels", &s.labels, limits::MAX_LABELS_BYTES)?;
        limits::check_map(
            "session.annotations",
            &s.annotations,
            limits::MAX_ANNOTATIONS_BYTES,
        )?;
        limits::check_origin("session.origin", s.origin.as_ref())?;
        limits::check_name("session.metadata.name", &meta.name)?;
        limits::check_name("session.model", &s.model)?;
        check_egress_annotation(&s.annotations)?;
        let created = self.host.create(NewSession {
            project: meta.project.clone(),
            name: meta.name,
            harness: s.harness,
            model: s.model,
            labels: s.labels.into_iter().collect(),
            annotations: s.annotations.into_iter().collect(),
            origin: s.origin,
            identity: s.identity,
        })?;
        Ok(Response::new(created))
    }

    async fn get_session(
        &self,
        request: Request<GetSessionRequest>,
    ) -> Result<Response<Session>, Status> {
        let principal = principal_of(&request);
        let uid = request.into_inner().uid;
        required("uid", &uid)?;
        self.authorize_session(principal.as_ref(), &uid)?;
        Ok(Response::new(self.host.view(&uid)?))
    }

    async fn list_sessions(
        &self,
        request: Request<ListSessionsRequest>,
    ) -> Result<Response<ListSessionsResponse>, Status> {
        let principal = principal_of(&request);
        let req = request.into_inner();
        let project = if req.project.is_empty() {
            crate::session::DEFAULT_PROJECT
        } else {
            req.project.as_str()
        };
        // Another project's sessions are not there, as far as this principal can tell.
        if principal.as_ref().is_some_and(|p| !p.allows(project)) {
            return Err(Status::not_found(format!("project {project:?} not found")));
        }
        let page_size = match req.page_size {
            n if n <= 0 => DEFAULT_PAGE_SIZE,
            n => (n as usize).min(MAX_PAGE_SIZE),
        };
        let after = if req.page_token.is_empty() {
            None
        } else {
            Some(page_token::decode(&req.page_token).map_err(|e| invalid("page_token", e))?)
        };
        let (sessions, next) = self.host.list(&req.project, page_size, after.as_ref())?;
        Ok(Response::new(ListSessionsResponse {
            sessions,
            next_page_token: next.as_ref().map(page_token::encode).unwrap_or_default(),
        }))
    }

    async fn delete_session(
        &self,
        request: Request<DeleteSessionRequest>,
    ) -> Result<Response<Session>, Status> {
        let principal = principal_of(&request);
        let uid = request.into_inner().uid;
        required("uid", &uid)?;
        self.authorize_session(principal.as_ref(), &uid)?;
        Ok(Response::new(
            as_actor(principal.as_ref(), self.host.delete(&uid)).await?,
        ))
    }

    type ExecStream = Stream_<ExecUpdate>;

    async fn exec(
        &self,
        request: Request<ExecRequest>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        let principal = principal_of(&request);
        let req = request.into_inner();
        if req.session.is_empty() {
            auth::authorize(principal.as_ref(), crate::session::DEFAULT_PROJECT)?;
        } else {
            self.authorize_session(principal.as_ref(), &req.session)?;
        }
        check_messages("inputs", &req.inputs)?;
        limits::check_config("config", &req.config)?;
        if req.resume_from_seq < 0 {
            return Err(invalid("resume_from_seq", "may not be negative"));
        }
        if req.expected_last_seq.is_some_and(|s| s < 0) {
            return Err(invalid("expected_last_seq", "may not be negative"));
        }
        if req.deadline_unix < 0 {
            return Err(invalid("deadline_unix", "may not be negative"));
        }
        let (tx, rx) = mpsc::channel(EXEC_BUFFER);
        let host = Arc::clone(&self.host);
        // The turn outlives this call; it stays in the RPC's span (its request id).
        let actor = principal.map(|p| p.actor());
        tokio::spawn(
            async move {
                let run = host.exec(req, &tx);
                let result = match actor {
                    Some(actor) => auth::ACTOR.scope(actor, run).await,
                    None => run.await,
                };
                if let Err(status) = result {
                    if request_id::caused_by_caller(status.code()) {
                        tracing::info!(code = ?status.code(), "exec refused");
                    } else {
                        tracing::warn!(code = ?status.code(), error = %status.message(), "exec failed");
                    }
                    let _ = tx.send(Err(status)).await;
                }
            }
            .in_current_span(),
        );
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type ReplayStream = Stream_<LogRecord>;

    async fn replay(
        &self,
        request: Request<ReplayRequest>,
    ) -> Result<Response<Self::ReplayStream>, Status> {
        let principal = principal_of(&request);
        let req = request.into_inner();
        required("session", &req.session)?;
        self.authorize_session(principal.as_ref(), &req.session)?;
        if req.to_seq < 0 {
            return Err(invalid("to_seq", "may not be negative"));
        }
        if req.to_seq != 0 && req.to_seq < req.from_seq {
            return Err(invalid(
                "to_seq",
                format!("{} is below from_seq {}", req.to_seq, req.from_seq),
            ));
        }
        let records = self.host.replay(&req.session, req.from_seq, req.to_seq)?;
        Ok(Response::new(Box::pin(tokio_stream::iter(
            records.into_iter().map(Ok),
        ))))
    }

    async fn approve(
        &self,
        request: Request<ApproveRequest>,
    ) -> Result<Response<ApproveResponse>, Status> {
        let principal = principal_of(&request);
        let req = request.into_inner();
        required("session", &req.session)?;
        required("execution_id", &req.execution_id)?;
        required("tool_call_id", &req.tool_call_id)?;
        if req.request_seq <= 0 {
            return Err(invalid("request_seq", "must be positive"));
        }
        if req.approved.is_none() {
            return Err(invalid("approved", "is required (true or false)"));
        }
        self.authorize_session(principal.as_ref(), &req.session)?;
        let (session, decision) = as_actor(principal.as_ref(), self.host.approve(req)).await?;
        Ok(Response::new(ApproveResponse {
            session: Some(session),
            decision: Some(decision),
        }))
    }

    async fn cancel(&self, request: Request<CancelRequest>) -> Result<Response<Session>, Status> {
        let principal = principal_of(&request);
        let req = request.into_inner();
        required("session", &req.session)?;
        self.authorize_session(principal.as_ref(), &req.session)?;
        Ok(Response::new(
            as_actor(principal.as_ref(), self.host.cancel(req)).await?,
        ))
    }

    async fn suspend(&self, request: Request<SuspendRequest>) -> Result<Response<Session>, Status> {
        let principal = principal_of(&request);
        let req = request.into_inner();
        required("session", &req.session)?;
        self.authorize_session(principal.as_ref(), &req.session)?;
        Ok(Response::new(
            as_actor(principal.as_ref(), self.host.suspend(&req.session)).await?,
        ))
    }

    async fn resume(&self, request: Request<ResumeRequest>) -> Result<Response<Session>, Status> {
        // `boot` is deprecated upstream and ignored.
        let principal = principal_of(&request);
        let req = request.into_inner();
        required("session", &req.session)?;
        self.authorize_session(principal.as_ref(), &req.session)?;
        Ok(Response::new(
            as_actor(principal.as_ref(), self.host.resume(&req.session)).await?,
        ))
    }

    async fn fork(&self, request: Request<ForkRequest>) -> Result<Response<ForkResponse>, Status> {
        let principal = principal_of(&request);
        let mut req = request.into_inner();
        // Checked before anything else, with upstream's exact message (its clients match it),
        // and without echoing what was supplied.
        if req.identity.is_some() {
            return Err(Status::invalid_argument(FORK_IDENTITY_UNSUPPORTED));
        }
        // Unset is one child, as upstream's server takes it: its Go SDK sends
        // `ForkOptions{}` with no count for a single fork.
        if req.count == 0 {
            req.count = 1;
        }
        required("session", &req.session)?;
        self.authorize_session(principal.as_ref(), &req.session)?;
        if !(1..=MAX_FORK_CHILDREN).contains(&req.count) {
            return Err(invalid(
                "count",
                format!("{} is outside 1..={MAX_FORK_CHILDREN}", req.count),
            ));
        }
        if !req.child_names.is_empty() && req.child_names.len() != req.count as usize {
            return Err(invalid(
                "child_names",
                format!(
                    "has {} names for {} children",
                    req.child_names.len(),
                    req.count
                ),
            ));
        }
        if req.at_seq < 0 {
            return Err(invalid("at_seq", "may not be negative"));
        }
        limits::check_map("labels", &req.labels, limits::MAX_LABELS_BYTES)?;
        for name in &req.child_names {
            limits::check_name("child_names", name)?;
        }
        let children = as_actor(principal.as_ref(), self.host.fork(req)).await?;
        Ok(Response::new(ForkResponse { children }))
    }
}
