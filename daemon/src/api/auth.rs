//! Who is calling, and which projects they may touch (upstream has no authentication).
//!
//! `--auth-file FILE` names the principals:
//!
//! ```toml
//! [[principal]]
//! name = "ci-bot"
//! projects = ["team-a", "team-b"]   # or ["*"] for every project
//! token_sha256 = ["9f86d081…"]      # `Authorization: Bearer <token>`; only its SHA-256 is kept
//! client_cert_sha256 = ["ab12…"]    # or an mTLS client certificate, by the SHA-256 of its DER
//! operator = true                   # may drain the node, list the fleet, read node-wide
//!                                   # status and /metrics (default false)
//! ```
//!
//! The same file sets the projects' quotas (`[quota]`, `[[project]]`; see `crate::quota`).
//!
//! With a file every Sessions and Node RPC, and reflection, must present one of those
//! credentials (UNAUTHENTICATED otherwise); the node-wide RPCs also need an operator
//! (PERMISSION_DENIED otherwise): a tenant's token reaches its own projects and nothing that
//! acts on, or tells about, the whole node. Without a file the API trusts whoever can reach
//! it, which is why it then listens on a unix socket, loopback, or TLS with client
//! certificates only. The principal is recorded as the actor of the events its requests cause.

use std::path::Path;

use agentvm_proto::v1::IdentityRef;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tonic::{Request, Status};

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    projects: Vec<String>,
    /// How it proved itself: "token" or "client-certificate".
    pub method: &'static str,
    /// May act on the whole node (drain, fleet listing, node-wide status, metrics).
    pub operator: bool,
}

impl Principal {
    pub fn allows(&self, project: &str) -> bool {
        self.projects.iter().any(|p| p == "*" || p == project)
    }

    /// The actor recorded on the events this principal causes.
    pub fn actor(&self) -> IdentityRef {
        IdentityRef {
            principal: self.name.clone(),
            issuer: "agentvmd".into(),
            subject: self.method.into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct PrincipalEntry {
    name: String,
    projects: Vec<String>,
    #[serde(default)]
    token_sha256: Vec<String>,
    #[serde(default)]
    client_cert_sha256: Vec<String>,
    #[serde(default)]
    operator: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuthFile {
    #[serde(default)]
    principal: Vec<PrincipalEntry>,
    #[serde(default)]
    quota: crate::quota::Limits,
    #[serde(default)]
    project: Vec<crate::quota::ProjectEntry>,
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {key}: {message}")]
    Invalid {
        path: String,
        key: String,
        message: String,
    },
}

/// The principals of an auth file.
#[derive(Debug, Clone)]
pub struct Authenticator {
    principals: Vec<PrincipalEntry>,
    quotas: crate::quota::Quotas,
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

impl Authenticator {
    pub fn load(path: &Path) -> Result<Self, AuthError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| AuthError::Read {
            path: origin.clone(),
            source,
        })?;
        let invalid = |key: String, message: String| AuthError::Invalid {
            path: origin.clone(),
            key,
            message,
        };
        let file: AuthFile =
            crate::toml_file::parse(&text).map_err(|(key, message)| invalid(key, message))?;
        let mut names = std::collections::HashSet::new();
        for (i, p) in file.principal.iter().enumerate() {
            let at = |field: &str| format!("principal[{i}].{field}");
            if p.name.is_empty() || !names.insert(p.name.clone()) {
                return Err(invalid(at("name"), "empty or used twice".into()));
            }
            if p.projects.is_empty() || p.projects.iter().any(String::is_empty) {
                return Err(invalid(
                    at("projects"),
                    "name at least one project, or \"*\"".into(),
                ));
            }
            if p.token_sha256.is_empty() && p.client_cert_sha256.is_empty() {
                return Err(invalid(
                    at("token_sha256"),
                    "a principal needs a token or a client certificate".into(),
                ));
            }
            for (field, list) in [
                ("token_sha256", &p.token_sha256),
                ("client_cert_sha256", &p.client_cert_sha256),
            ] {
                if let Some(bad) = list.iter().find(|h| !is_sha256_hex(h)) {
                    return Err(invalid(at(field), format!("{bad:?} is not 64 hex digits")));
                }
            }
        }
        let mut projects = std::collections::HashMap::new();
        for (i, p) in file.project.iter().enumerate() {
            if p.name.is_empty() || projects.insert(p.name.clone(), p.limits()).is_some() {
                return Err(invalid(
                    format!("project[{i}].name"),
                    "empty or used twice".into(),
                ));
            }
        }
        let quotas = crate::quota::Quotas::new(file.quota, projects);
        let mut principals = file.principal;
        for p in &mut principals {
            for h in p
                .token_sha256
                .iter_mut()
                .chain(p.client_cert_sha256.iter_mut())
            {
                *h = h.to_ascii_lowercase();
            }
        }
        Ok(Self { principals, quotas })
    }

    /// The projects' quotas the file sets.
    pub fn quotas(&self) -> &crate::quota::Quotas {
        &self.quotas
    }

    fn principal(p: &PrincipalEntry, method: &'static str) -> Principal {
        Principal {
            name: p.name.clone(),
            projects: p.projects.clone(),
            method,
            operator: p.operator,
        }
    }

    /// The principal of an `authorization` header's value (`Bearer <token>`); the error says
    /// what was wrong with it, for a gRPC status or an HTTP 401 alike.
    pub fn bearer(&self, value: Option<&str>) -> Result<Principal, &'static str> {
        let token = value
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or("authorization: expected `Bearer <token>`")?;
        let digest = sha256_hex(token.as_bytes());
        self.principals
            .iter()
            .find(|p| p.token_sha256.contains(&digest))
            .map(|p| Self::principal(p, "token"))
            .ok_or("the bearer token is not known here")
    }

    /// The caller of `req`, by its bearer token or else its TLS client certificate.
    pub fn authenticate<T>(&self, req: &Request<T>) -> Result<Principal, Status> {
        if let Some(value) = req.metadata().get("authorization") {
            return self
                .bearer(Some(value.to_str().unwrap_or("")))
                .map_err(Status::unauthenticated);
        }
        if let Some(certs) = req.peer_certs()
            && let Some(leaf) = certs.first()
        {
            let digest = sha256_hex(leaf.as_ref());
            return self
                .principals
                .iter()
                .find(|p| p.client_cert_sha256.contains(&digest))
                .map(|p| Self::principal(p, "client-certificate"))
                .ok_or_else(|| {
                    Status::unauthenticated(format!(
                        "client certificate sha256:{digest} names no principal"
                    ))
                });
        }
        Err(Status::unauthenticated(
            "this node requires a credential: `authorization: Bearer <token>` or a TLS client certificate",
        ))
    }
}

tokio::task_local! {
    /// The actor the current request's events are recorded with.
    pub static ACTOR: IdentityRef;
}

/// The principal a request was authenticated as (None when the node has no auth file).
pub fn principal_of<T>(req: &Request<T>) -> Option<Principal> {
    req.extensions().get::<Principal>().cloned()
}

/// Refuses a principal that is not an operator: `what` acts on, or tells about, the whole
/// node. Without an auth file there are no principals and whoever reaches the API may.
pub fn require_operator(principal: Option<&Principal>, what: &str) -> Result<(), Status> {
    match principal {
        Some(p) if !p.operator => Err(Status::permission_denied(format!(
            "{what} acts on the whole node: principal {:?} is not an operator (`operator = true` \
             in the auth file)",
            p.name
        ))),
        _ => Ok(()),
    }
}

/// The actor of what the node does on its own or for an unauthenticated caller (a drain or a
/// shutdown's suspends), so no lifecycle record is left without one.
pub fn node_actor(principal: Option<&Principal>, what: &str) -> IdentityRef {
    match principal {
        Some(p) => p.actor(),
        None => IdentityRef {
            principal: "agentvmd".into(),
            issuer: "agentvmd".into(),
            subject: what.into(),
        },
    }
}

/// Refuses a principal that may not touch `project`.
pub fn authorize(principal: Option<&Principal>, project: &str) -> Result<(), Status> {
    match principal {
        Some(p) if !p.allows(project) => Err(Status::permission_denied(format!(
            "principal {:?} has no access to project {project:?}",
            p.name
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> Result<Authenticator, AuthError> {
        crate::toml_file::load_written("auth.toml", text, Authenticator::load)
    }

    #[test]
    fn tokens_map_to_principals_and_their_projects() {
        let token_hash = sha256_hex(b"s3cret");
        let a = file(&format!(
            "[[principal]]\nname = \"alice\"\nprojects = [\"team-a\"]\ntoken_sha256 = [\"{}\"]\n",
            token_hash.to_uppercase()
        ))
        .unwrap();
        let mut req = Request::new(());
        req.metadata_mut()
            .insert("authorization", "Bearer s3cret".parse().unwrap());
        let p = a.authenticate(&req).unwrap();
        assert_eq!((p.name.as_str(), p.method), ("alice", "token"));
        assert!(p.allows("team-a") && !p.allows("team-b"));
        assert!(!p.operator);
        assert_eq!(
            require_operator(Some(&p), "Drain").unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        assert_eq!(
            authorize(Some(&p), "team-b").unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        for bad in ["Bearer wrong", "Basic abc", "Bearer "] {
            let mut req = Request::new(());
            req.metadata_mut()
                .insert("authorization", bad.parse().unwrap());
            assert_eq!(
                a.authenticate(&req).unwrap_err().code(),
                tonic::Code::Unauthenticated,
                "{bad}"
            );
        }
        assert_eq!(
            a.authenticate(&Request::new(())).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
    }

    #[test]
    fn bad_files_name_the_key() {
        let h = "a".repeat(64);
        for (text, key) in [
            (
                format!("[[principal]]\nname = \"\"\nprojects = [\"*\"]\ntoken_sha256 = [\"{h}\"]"),
                "principal[0].name",
            ),
            (
                format!("[[principal]]\nname = \"a\"\nprojects = []\ntoken_sha256 = [\"{h}\"]"),
                "principal[0].projects",
            ),
            (
                "[[principal]]\nname = \"a\"\nprojects = [\"*\"]".to_owned(),
                "principal[0].token_sha256",
            ),
            (
                "[[principal]]\nname = \"a\"\nprojects = [\"*\"]\ntoken_sha256 = [\"xyz\"]"
                    .to_owned(),
                "principal[0].token_sha256",
            ),
            (
                format!("[[principal]]\nname = \"a\"\nprojects = [\"*\"]\ntoken = [\"{h}\"]"),
                "token",
            ),
            (
                format!(
                    "[[principal]]\nname = \"a\"\nprojects = [\"*\"]\ntoken_sha256 = [\"{h}\"]\n[[principal]]\nname = \"a\"\nprojects = [\"*\"]\ntoken_sha256 = [\"{h}\"]"
                ),
                "principal[1].name",
            ),
        ] {
            let err = file(&text).unwrap_err().to_string();
            assert!(err.contains(key), "{text}: {err}");
        }
    }
}

#[cfg(test)]
mod operator_tests {
    use super::*;

    #[test]
    fn only_operators_act_on_the_whole_node() {
        let a = crate::toml_file::load_written(
            "auth.toml",
            &format!(
                "[[principal]]\nname = \"ops\"\nprojects = [\"*\"]\noperator = true\n\
                 token_sha256 = [\"{}\"]\n",
                sha256_hex(b"root-ish")
            ),
            Authenticator::load,
        )
        .unwrap();
        let ops = a.bearer(Some("Bearer root-ish")).unwrap();
        assert!(ops.operator);
        require_operator(Some(&ops), "Drain").unwrap();
        require_operator(None, "Drain").unwrap();
        assert_eq!(node_actor(Some(&ops), "drain").principal, "ops");
        assert_eq!(node_actor(None, "drain").subject, "drain");
        assert!(a.bearer(Some("Bearer other")).is_err());
        assert!(a.bearer(None).is_err());
    }

    #[test]
    fn the_auth_file_sets_quotas_per_project_over_node_wide_defaults() {
        let load =
            |text: &str| crate::toml_file::load_written("auth.toml", text, Authenticator::load);
        let a = load(
            "[quota]\nsessions = 10\nlive_vms = 2\n\
             [[project]]\nname = \"team-a\"\nlive_vms = 8\njournal_mib = 64\n",
        )
        .unwrap();
        let team_a = a.quotas().limits("team-a");
        assert_eq!(
            (team_a.sessions, team_a.live_vms, team_a.journal_mib),
            (Some(10), Some(8), Some(64))
        );
        assert_eq!(a.quotas().limits("other").live_vms, Some(2));
        // A misspelt limit, a project named twice or not at all: the file is refused,
        // naming where.
        for (text, key) in [
            ("[[project]]\nname = \"a\"\nlive_vm = 1\n", "project"),
            ("[quota]\nsesions = 1\n", "quota"),
            (
                "[[project]]\nname = \"a\"\n[[project]]\nname = \"a\"\n",
                "project[1].name",
            ),
            ("[[project]]\nname = \"\"\n", "project[0].name"),
        ] {
            let err = load(text).unwrap_err().to_string();
            assert!(err.contains(key), "{text}: {err}");
        }
    }
}
