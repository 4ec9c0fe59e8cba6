//! The harness registry: STATIC harnesses built into this daemon plus REGISTERED ones stored in
//! the journal database (semantics.md §3, HarnessRegistry). Registrations are content-addressed
//! by `spec_digest` and immutable: a name holds one spec for life.

pub mod store;

use agentvm_proto::canon;
use agentvm_proto::v1::{
    Capabilities, HarnessRegistration, HarnessSource, HarnessSpec, HarnessState, RegisterOutcome,
    ResourceMetadata, Resumability, harness_spec::Placement,
};
use rand::Rng;

use crate::clock::{now_nanos, timestamp};
use store::{RegistryStore, StoreError, StoredHarness};

/// A harness this daemon provides without registration.
#[derive(Debug, Clone)]
pub struct StaticHarness {
    pub name: String,
    pub capabilities: Capabilities,
    /// Why this host cannot run it now (empty when it can).
    pub unservable_reason: String,
}

/// The names reserved for built-in harnesses (ARCHITECTURE.md, fixed contracts).
/// `unservable` says why this host cannot run one of them (None when it can).
pub fn builtin_harnesses(
    unservable: impl Fn(&str, &Capabilities) -> Option<String>,
) -> Vec<StaticHarness> {
    let caps = |resumability: Resumability, fork_safe: bool| Capabilities {
        resumability: resumability as i32,
        fork_safe,
        ..Default::default()
    };
    [
        ("chat", caps(Resumability::StatelessReplay, true)),
        ("counter", caps(Resumability::RequiresMemorySnapshot, false)),
        ("echo", caps(Resumability::StatelessReplay, true)),
        (
            "testguest",
            caps(Resumability::RequiresMemorySnapshot, false),
        ),
        ("testguest-echo", caps(Resumability::StatelessReplay, true)),
    ]
    .into_iter()
    .map(|(name, capabilities)| StaticHarness {
        name: name.to_owned(),
        unservable_reason: unservable(name, &capabilities).unwrap_or_default(),
        capabilities,
    })
    .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("{field}: {reason}")]
    InvalidArgument { field: &'static str, reason: String },
    #[error("harness {name:?} {reason}")]
    AlreadyExists { name: String, reason: String },
    #[error("harness {name:?}: {reason}")]
    FailedPrecondition { name: String, reason: String },
    #[error("harness {0:?} is neither built in nor registered")]
    NotFound(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("spec of harness {name:?} has no canonical form: {source}")]
    Canon {
        name: String,
        #[source]
        source: canon::CanonError,
    },
}

impl RegistryError {
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            RegistryError::InvalidArgument { .. } => Code::InvalidArgument,
            RegistryError::AlreadyExists { .. } => Code::AlreadyExists,
            RegistryError::FailedPrecondition { .. } => Code::FailedPrecondition,
            RegistryError::NotFound(_) => Code::NotFound,
            RegistryError::Store(_) | RegistryError::Canon { .. } => Code::Internal,
        }
    }
}

impl From<RegistryError> for tonic::Status {
    fn from(e: RegistryError) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

/// An RFC 1123 DNS label: 1–63 of `[a-z0-9-]`, starting and ending alphanumeric.
pub fn validate_name(name: &str) -> Result<(), RegistryError> {
    let bad = |reason: &str| {
        Err(RegistryError::InvalidArgument {
            field: "name",
            reason: format!("{name:?} {reason}"),
        })
    };
    if name.is_empty() || name.len() > 63 {
        return bad("must be 1 to 63 characters");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return bad("may hold only lowercase letters, digits and '-'");
    }
    if name.starts_with('-') || name.ends_with('-') {
        return bad("must start and end with a letter or digit");
    }
    Ok(())
}

/// Checks a remote placement address: `unix:///abs`, `unix://rel` or `host:port`. As
/// upstream has it, an empty address is a bad request, while a form this host cannot dial is
/// a failed precondition of this host (another host might serve it); either way nothing is
/// stored.
fn validate_address(name: &str, address: &str) -> Result<(), RegistryError> {
    if address.is_empty() {
        return Err(RegistryError::InvalidArgument {
            field: "spec.remote.address",
            reason: "is required".into(),
        });
    }
    let bad = |reason: String| {
        Err(RegistryError::FailedPrecondition {
            name: name.to_owned(),
            reason: format!("remote address {address:?}: {reason}"),
        })
    };
    if let Some(path) = address.strip_prefix("unix://") {
        if path.is_empty() {
            return bad("has an empty socket path".into());
        }
        return Ok(());
    }
    if let Some((scheme, _)) = address.split_once("://") {
        return bad(format!(
            "unsupported scheme {scheme:?}; this host dials unix://PATH or HOST:PORT"
        ));
    }
    match address.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {
            Ok(())
        }
        _ => bad("is neither unix://PATH nor HOST:PORT".into()),
    }
}

pub struct Registry {
    statics: Vec<StaticHarness>,
    store: RegistryStore,
}

/// One entry of the merged view, in name order.
pub enum Entry<'a> {
    Static(&'a StaticHarness),
    Registered(Box<StoredHarness>),
}

impl Registry {
    pub fn new(statics: Vec<StaticHarness>, store: RegistryStore) -> Self {
        let mut statics = statics;
        statics.sort_by(|a, b| a.name.cmp(&b.name));
        Self { statics, store }
    }

    fn static_named(&self, name: &str) -> Option<&StaticHarness> {
        self.statics.iter().find(|s| s.name == name)
    }

    pub fn register(
        &self,
        name: &str,
        spec: Option<HarnessSpec>,
    ) -> Result<(HarnessRegistration, RegisterOutcome), RegistryError> {
        validate_name(name)?;
        let spec = spec.ok_or(RegistryError::InvalidArgument {
            field: "spec",
            reason: "is required".into(),
        })?;
        let resumability = spec
            .capabilities
            .as_ref()
            .map(|c| c.resumability)
            .unwrap_or_default();
        if resumability == Resumability::Unspecified as i32
            || Resumability::try_from(resumability).is_err()
        {
            return Err(RegistryError::InvalidArgument {
                field: "spec.capabilities.resumability",
                reason: "is required (STATELESS_REPLAY or REQUIRES_MEMORY_SNAPSHOT)".into(),
            });
        }
        match &spec.placement {
            None => {
                return Err(RegistryError::InvalidArgument {
                    field: "spec.placement",
                    reason: "exactly one of remote or substrate is required".into(),
                });
            }
            Some(Placement::Remote(r)) => validate_address(name, &r.address)?,
            Some(Placement::Substrate(_)) => {
                return Err(RegistryError::FailedPrecondition {
                    name: name.to_owned(),
                    reason: "substrate placement is not built into agentvmd".into(),
                });
            }
        }
        if self.static_named(name).is_some() {
            return Err(RegistryError::AlreadyExists {
                name: name.to_owned(),
                reason: "is reserved for a built-in harness".into(),
            });
        }
        let digest = canon::spec_digest(&spec).map_err(|source| RegistryError::Canon {
            name: name.to_owned(),
            source,
        })?;
        let now = now_nanos();
        let (stored, outcome) = match self.store.get(name)? {
            Some(existing) if existing.spec_digest != digest => {
                return Err(RegistryError::AlreadyExists {
                    name: name.to_owned(),
                    reason: format!("holds a different spec ({})", existing.spec_digest),
                });
            }
            Some(existing) if existing.state == HarnessState::Retired => {
                let revived = StoredHarness {
                    state: HarnessState::Active,
                    retire_time: None,
                    retire_reason: String::new(),
                    updated_at: now,
                    ..existing
                };
                self.store.put(&revived, &spec)?;
                (revived, RegisterOutcome::Reactivated)
            }
            Some(existing) => (existing, RegisterOutcome::Unchanged),
            None => {
                let created = StoredHarness {
                    name: name.to_owned(),
                    uid: format!("harness-{:024x}", rand::rng().random::<u128>() >> 32),
                    spec: Some(spec.clone()),
                    spec_digest: digest,
                    state: HarnessState::Active,
                    retire_time: None,
                    retire_reason: String::new(),
                    created_at: now,
                    updated_at: now,
                };
                self.store.put(&created, &spec)?;
                (created, RegisterOutcome::Created)
            }
        };
        Ok((registered_view(&stored), outcome))
    }

    pub fn get(&self, name: &str) -> Result<Entry<'_>, RegistryError> {
        if let Some(s) = self.static_named(name) {
            return Ok(Entry::Static(s));
        }
        self.store
            .get(name)?
            .map(|h| Entry::Registered(Box::new(h)))
            .ok_or_else(|| RegistryError::NotFound(name.to_owned()))
    }

    /// Up to `limit` entries with names after `after`, static and registered merged in name
    /// order; retired ones only when asked.
    pub fn list(
        &self,
        after: &str,
        limit: usize,
        include_retired: bool,
    ) -> Result<Vec<Entry<'_>>, RegistryError> {
        let mut registered = Vec::new();
        let mut cursor = after.to_owned();
        // Retired rows are filtered after reading, so read until the page is full.
        while registered.len() < limit {
            let batch = self.store.list_after(&cursor, limit)?;
            let Some(last) = batch.last() else { break };
            cursor = last.name.clone();
            registered.extend(
                batch
                    .into_iter()
                    .filter(|h| include_retired || h.state != HarnessState::Retired),
            );
        }
        let mut out: Vec<Entry<'_>> = self
            .statics
            .iter()
            .filter(|s| s.name.as_str() > after)
            .map(Entry::Static)
            .chain(
                registered
                    .into_iter()
                    .map(|h| Entry::Registered(Box::new(h))),
            )
            .collect();
        out.sort_by(|a, b| entry_name(a).cmp(entry_name(b)));
        out.truncate(limit);
        Ok(out)
    }

    pub fn retire(&self, name: &str, reason: &str) -> Result<HarnessRegistration, RegistryError> {
        if self.static_named(name).is_some() {
            return Err(RegistryError::FailedPrecondition {
                name: name.to_owned(),
                reason: "is built in and cannot be retired".into(),
            });
        }
        let existing = self
            .store
            .get(name)?
            .ok_or_else(|| RegistryError::NotFound(name.to_owned()))?;
        if existing.state == HarnessState::Retired {
            return Ok(registered_view(&existing));
        }
        let Some(spec) = existing.spec.clone() else {
            return Err(RegistryError::FailedPrecondition {
                name: name.to_owned(),
                reason: "its stored spec does not decode on this host".into(),
            });
        };
        let now = now_nanos();
        let retired = StoredHarness {
            state: HarnessState::Retired,
            retire_time: Some(now),
            retire_reason: reason.to_owned(),
            updated_at: now,
            ..existing
        };
        self.store.put(&retired, &spec)?;
        Ok(registered_view(&retired))
    }
}

pub fn entry_name<'a>(e: &'a Entry<'_>) -> &'a str {
    match e {
        Entry::Static(s) => &s.name,
        Entry::Registered(h) => &h.name,
    }
}

pub fn static_view(s: &StaticHarness) -> HarnessRegistration {
    HarnessRegistration {
        metadata: Some(ResourceMetadata {
            name: s.name.clone(),
            ..Default::default()
        }),
        state: HarnessState::Active as i32,
        source: HarnessSource::Static as i32,
        unservable_reason: s.unservable_reason.clone(),
        ..Default::default()
    }
}

pub fn registered_view(h: &StoredHarness) -> HarnessRegistration {
    HarnessRegistration {
        metadata: Some(ResourceMetadata {
            name: h.name.clone(),
            uid: h.uid.clone(),
            create_time: Some(timestamp(h.created_at)),
            update_time: Some(timestamp(h.updated_at)),
            ..Default::default()
        }),
        spec: h.spec.clone(),
        spec_digest: h.spec_digest.clone(),
        state: h.state as i32,
        source: HarnessSource::Registered as i32,
        retire_time: h.retire_time.map(timestamp),
        retire_reason: h.retire_reason.clone(),
        unservable_reason: if h.spec.is_none() {
            "stored spec does not decode on this host".into()
        } else {
            String::new()
        },
        ..Default::default()
    }
}

pub fn entry_view(e: &Entry<'_>) -> HarnessRegistration {
    match e {
        Entry::Static(s) => static_view(s),
        Entry::Registered(h) => registered_view(h),
    }
}

#[cfg(test)]
mod tests;
