//! Translation between the agentsessions.v1 API and the daemon's internals: status codes,
//! page tokens and the Session projection. The tonic services themselves live beside these
//! pieces as the session host lands.

pub mod auth;
pub mod metadata_limits;
pub mod node_service;
pub mod page_token;
pub mod registry_service;
pub mod request_id;
pub mod session_view;
pub mod sessions_service;
pub mod status;
pub mod status_limit;
