//! Per-project quotas: a node is shared by projects that do not trust each other, and
//! without a bound one of them takes every VM slot, all guest memory, the journal's disk
//! (a fork copies its parent's log into every child) or the node's start-up capacity (a
//! wide fork every second). The operator sets them in the auth file, node-wide defaults in
//! `[quota]` and a project's own in `[[project]]`:
//!
//! ```toml
//! [quota]                 # every project without its own entry, field by field
//! sessions = 1000         # sessions not deleted (the journal's, fleet-wide)
//! live_vms = 32           # microVMs running on this node
//! live_memory_mib = 8192  # their guest memory, together
//! fork_children = 32      # children one Fork may make
//! forks_per_minute = 128  # children made in any 60 s
//! journal_mib = 4096      # what its sessions' logs hold (a forked prefix in every copy)
//!
//! [[project]]
//! name = "team-a"
//! live_vms = 64
//! ```
//!
//! A request over a quota is refused RESOURCE_EXHAUSTED naming the limit and the project,
//! before anything is written or started. This module decides; the session host counts.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Deserialize;
use tonic::Status;

/// The window `forks_per_minute` counts in.
const FORK_WINDOW: Duration = Duration::from_secs(60);

/// One set of limits; a missing field is unlimited (or, in a project's entry, the
/// default's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    pub sessions: Option<u64>,
    pub live_vms: Option<u64>,
    pub live_memory_mib: Option<u64>,
    pub fork_children: Option<u64>,
    pub forks_per_minute: Option<u64>,
    pub journal_mib: Option<u64>,
}

impl Limits {
    /// Each field of `self`, else `fallback`'s.
    fn or(self, fallback: Limits) -> Limits {
        Limits {
            sessions: self.sessions.or(fallback.sessions),
            live_vms: self.live_vms.or(fallback.live_vms),
            live_memory_mib: self.live_memory_mib.or(fallback.live_memory_mib),
            fork_children: self.fork_children.or(fallback.fork_children),
            forks_per_minute: self.forks_per_minute.or(fallback.forks_per_minute),
            journal_mib: self.journal_mib.or(fallback.journal_mib),
        }
    }

    fn is_unlimited(&self) -> bool {
        *self == Limits::default()
    }
}

/// A `[[project]]` entry of the auth file: a name and [`Limits`]' fields (spelled out:
/// serde's `flatten` would let a misspelt limit through unnoticed).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProjectEntry {
    pub name: String,
    sessions: Option<u64>,
    live_vms: Option<u64>,
    live_memory_mib: Option<u64>,
    fork_children: Option<u64>,
    forks_per_minute: Option<u64>,
    journal_mib: Option<u64>,
}

impl ProjectEntry {
    pub fn limits(&self) -> Limits {
        Limits {
            sessions: self.sessions,
            live_vms: self.live_vms,
            live_memory_mib: self.live_memory_mib,
            fork_children: self.fork_children,
            forks_per_minute: self.forks_per_minute,
            journal_mib: self.journal_mib,
        }
    }
}

/// What a project holds, as the host counted it, with what a request would add.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub sessions: u64,
    pub log_bytes: u64,
    pub live_vms: u64,
    pub live_memory_mib: u64,
}

/// What a request asks for, checked against what the project holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ask {
    pub sessions: u64,
    /// Whether it writes to the journal, and at least how much (a turn's output is not
    /// known ahead).
    pub log_bytes: Option<u64>,
    pub vms: u64,
    pub memory_mib: u64,
    /// Fork children (checked against `fork_children` and `forks_per_minute`).
    pub fork_children: u64,
}

/// The node's quotas.
#[derive(Debug, Default)]
pub struct Quotas {
    defaults: Limits,
    projects: HashMap<String, Limits>,
    /// When each project's recent fork children were made, with how many.
    forks: Mutex<HashMap<String, VecDeque<(Instant, u64)>>>,
}

impl Clone for Quotas {
    /// The same limits; the fork window starts empty.
    fn clone(&self) -> Self {
        Self::new(self.defaults, self.projects.clone())
    }
}

fn exhausted(project: &str, limit: &str, quota: u64, have: u64, ask: u64, unit: &str) -> Status {
    Status::resource_exhausted(format!(
        "QuotaExceeded: project {project:?} holds {have}{unit} and this request needs {ask}{unit} \
         more, over its quota `{limit}` = {quota}{unit} (the auth file's [[project]] or [quota])"
    ))
}

impl Quotas {
    pub fn new(defaults: Limits, projects: HashMap<String, Limits>) -> Self {
        Self {
            defaults,
            projects,
            forks: Mutex::default(),
        }
    }

    /// Whether any project has any limit (else nothing needs counting).
    pub fn is_empty(&self) -> bool {
        self.defaults.is_unlimited() && self.projects.values().all(Limits::is_unlimited)
    }

    /// `project`'s limits: its own entry's fields, else the defaults'.
    pub fn limits(&self, project: &str) -> Limits {
        self.projects
            .get(project)
            .copied()
            .unwrap_or_default()
            .or(self.defaults)
    }

    /// Refuses `ask` if it would take `project` over a limit given what it holds. A fork's
    /// children are counted into the per-minute window only once admitted.
    pub fn admit(&self, project: &str, have: Usage, ask: Ask) -> Result<(), Status> {
        let limits = self.limits(project);
        let over = |limit: Option<u64>, have: u64, ask: u64| {
            limit.filter(|&quota| ask > 0 && have.saturating_add(ask) > quota)
        };
        if let Some(quota) = over(limits.sessions, have.sessions, ask.sessions) {
            return Err(exhausted(
                project,
                "sessions",
                quota,
                have.sessions,
                ask.sessions,
                "",
            ));
        }
        if let Some(quota) = limits.journal_mib
            && let Some(asked) = ask.log_bytes
        {
            let quota_bytes = quota.saturating_mul(1 << 20);
            // A log grows by turns whose size nobody knows ahead: a project already at its
            // quota writes nothing more, and a request whose own bytes would cross it neither.
            if have.log_bytes >= quota_bytes || have.log_bytes.saturating_add(asked) > quota_bytes {
                return Err(exhausted(
                    project,
                    "journal_mib",
                    quota,
                    have.log_bytes >> 20,
                    asked.div_ceil(1 << 20),
                    " MiB",
                ));
            }
        }
        if let Some(quota) = over(limits.live_vms, have.live_vms, ask.vms) {
            return Err(exhausted(
                project,
                "live_vms",
                quota,
                have.live_vms,
                ask.vms,
                "",
            ));
        }
        if let Some(quota) = over(limits.live_memory_mib, have.live_memory_mib, ask.memory_mib) {
            return Err(exhausted(
                project,
                "live_memory_mib",
                quota,
                have.live_memory_mib,
                ask.memory_mib,
                " MiB",
            ));
        }
        if let Some(quota) = limits.fork_children
            && ask.fork_children > quota
        {
            return Err(Status::resource_exhausted(format!(
                "QuotaExceeded: a Fork of project {project:?} may make {quota} children (its \
                 quota `fork_children`), this one asks for {}",
                ask.fork_children
            )));
        }
        self.admit_forks(project, limits, ask.fork_children)
    }

    /// Counts `children` into `project`'s last minute, unless that takes it over
    /// `forks_per_minute`.
    fn admit_forks(&self, project: &str, limits: Limits, children: u64) -> Result<(), Status> {
        let Some(quota) = limits.forks_per_minute.filter(|_| children > 0) else {
            return Ok(());
        };
        let now = Instant::now();
        let mut forks = self.forks.lock().unwrap_or_else(|p| p.into_inner());
        let window = forks.entry(project.to_owned()).or_default();
        while window
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) >= FORK_WINDOW)
        {
            window.pop_front();
        }
        let recent: u64 = window.iter().map(|(_, n)| n).sum();
        if recent.saturating_add(children) > quota {
            let retry = window
                .front()
                .map(|(at, _)| FORK_WINDOW.saturating_sub(now.duration_since(*at)))
                .unwrap_or_default();
            return Err(Status::resource_exhausted(format!(
                "QuotaExceeded: project {project:?} made {recent} fork children in the last \
                 minute and this Fork asks for {children}, over its quota `forks_per_minute` = \
                 {quota}; retry in {} s",
                retry.as_secs().max(1)
            )));
        }
        window.push_back((now, children));
        Ok(())
    }

    /// Takes back `children` counted for `project` by a fork that then made none.
    pub fn forks_undone(&self, project: &str, children: u64) {
        let mut forks = self.forks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(window) = forks.get_mut(project)
            && let Some(at) = window.iter().rposition(|(_, n)| *n == children)
        {
            window.remove(at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quotas() -> Quotas {
        Quotas::new(
            Limits {
                sessions: Some(3),
                live_vms: Some(2),
                live_memory_mib: Some(512),
                fork_children: Some(4),
                forks_per_minute: Some(6),
                journal_mib: Some(1),
            },
            HashMap::from([(
                "big".to_owned(),
                Limits {
                    live_vms: Some(10),
                    ..Default::default()
                },
            )]),
        )
    }

    fn refused(r: Result<(), Status>, limit: &str) {
        let e = r.expect_err(limit);
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        assert!(e.message().contains(limit), "{}", e.message());
    }

    #[test]
    fn each_limit_refuses_what_would_cross_it_and_names_itself() {
        let q = quotas();
        let have = Usage {
            sessions: 3,
            log_bytes: 1 << 20,
            live_vms: 2,
            live_memory_mib: 512,
        };
        // Asking nothing of a limit passes it, however full.
        q.admit("p", have, Ask::default()).unwrap();
        let one = |f: fn(&mut Ask)| {
            let mut ask = Ask::default();
            f(&mut ask);
            ask
        };
        refused(
            q.admit("p", have, one(|a| a.sessions = 1)),
            "`sessions` = 3",
        );
        refused(
            q.admit("p", Usage::default(), one(|a| a.log_bytes = Some(2 << 20))),
            "`journal_mib` = 1",
        );
        // Full already: even a turn of unknown size is refused.
        refused(
            q.admit("p", have, one(|a| a.log_bytes = Some(0))),
            "`journal_mib`",
        );
        refused(q.admit("p", have, one(|a| a.vms = 1)), "`live_vms` = 2");
        refused(
            q.admit("p", Usage::default(), one(|a| a.memory_mib = 513)),
            "`live_memory_mib` = 512",
        );
        refused(
            q.admit("p", Usage::default(), one(|a| a.fork_children = 5)),
            "`fork_children`",
        );
        // A project's own entry overrides the default field by field.
        assert_eq!(q.limits("big").live_vms, Some(10));
        assert_eq!(q.limits("big").sessions, Some(3));
        q.admit(
            "big",
            Usage {
                live_vms: 5,
                ..Default::default()
            },
            one(|a| a.vms = 1),
        )
        .unwrap();
        assert!(Quotas::default().is_empty());
        assert!(!q.is_empty());
    }

    #[test]
    fn forks_per_minute_counts_what_was_admitted_in_the_window() {
        let q = quotas();
        let fork = |n| Ask {
            fork_children: n,
            ..Default::default()
        };
        q.admit("p", Usage::default(), fork(4)).unwrap();
        refused(
            q.admit("p", Usage::default(), fork(3)),
            "`forks_per_minute` = 6",
        );
        // Another project has its own window; an undone fork gives its children back.
        q.admit("other", Usage::default(), fork(4)).unwrap();
        q.admit("p", Usage::default(), fork(2)).unwrap();
        q.forks_undone("p", 2);
        q.admit("p", Usage::default(), fork(2)).unwrap();
        // Old entries leave the window.
        q.forks
            .lock()
            .unwrap()
            .get_mut("p")
            .unwrap()
            .iter_mut()
            .for_each(|(at, _)| *at = at.checked_sub(FORK_WINDOW).unwrap());
        q.admit("p", Usage::default(), fork(4)).unwrap();
    }
}
