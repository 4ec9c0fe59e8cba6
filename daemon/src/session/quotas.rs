//! The session host's side of the projects' quotas (`crate::quota` decides): what a
//! project holds (its sessions and log bytes from the journal, its VMs on this node from the
//! live table and from starts under way) and what each request asks, checked before the
//! request writes or starts anything. A VM start holds its place in the count from the check
//! until its compute is live, so two turns racing for a project's last VM slot cannot both
//! take it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tonic::Status;

use super::{Placement, SessionHost};
use crate::api::status::journal_status;
use crate::journal::SessionRow;
use crate::quota::{Ask, Quotas, Usage};

/// VM starts admitted and not yet live, by a number of their own: (project, guest MiB).
#[derive(Debug, Default)]
pub(super) struct Starting {
    next: u64,
    starts: HashMap<u64, (String, u64)>,
}

/// A VM start's place in its project's count; given back when dropped (by then the VM is
/// in the live table, or it never started).
pub(super) struct StartHeld {
    starting: Arc<Mutex<Starting>>,
    id: u64,
}

impl Drop for StartHeld {
    fn drop(&mut self) {
        self.starting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .starts
            .remove(&self.id);
    }
}

/// Fork children counted into a project's last minute; given back when dropped unless the
/// fork made them.
pub(super) struct ForksCharged {
    quotas: Arc<Quotas>,
    project: String,
    children: u64,
    kept: bool,
}

impl ForksCharged {
    pub(super) fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for ForksCharged {
    fn drop(&mut self) {
        if !self.kept {
            self.quotas.forks_undone(&self.project, self.children);
        }
    }
}

/// What a quota check holds until the request's compute is live (or it failed).
#[derive(Default)]
pub(super) struct QuotaHold {
    _vms: Option<StartHeld>,
    forks: Option<ForksCharged>,
}

impl QuotaHold {
    /// The fork made its children: they stay counted in the minute.
    pub(super) fn forks_made(&mut self) {
        if let Some(forks) = self.forks.take() {
            forks.keep();
        }
    }
}

impl SessionHost {
    /// What `project` holds now: from the journal (sessions, log bytes) and from this node
    /// (VMs live or starting).
    fn usage(&self, project: &str) -> Result<Usage, Status> {
        let journal = self
            .journal
            .project_usage(project)
            .map_err(|e| journal_status(&e))?;
        let mut usage = Usage {
            sessions: journal.sessions,
            log_bytes: journal.log_bytes,
            ..Default::default()
        };
        for live in self.live.lock().unwrap_or_else(|p| p.into_inner()).values() {
            if let (true, Some(mib)) = (live.project == project, live.vm_mib) {
                usage.live_vms += 1;
                usage.live_memory_mib += mib;
            }
        }
        for (of, mib) in self
            .starting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .starts
            .values()
        {
            if of == project {
                usage.live_vms += 1;
                usage.live_memory_mib += mib;
            }
        }
        Ok(usage)
    }

    /// Refuses `ask` of `project` over a quota; else holds what it takes of the VM count
    /// (`vm_mib` per VM) and of the fork window until the returned hold is dropped.
    pub(super) fn admit_quota(
        &self,
        project: &str,
        ask: Ask,
        vm_mib: Option<u64>,
    ) -> Result<QuotaHold, Status> {
        let Some(quotas) = self.quotas.as_ref().filter(|q| !q.is_empty()) else {
            return Ok(QuotaHold::default());
        };
        let ask = match vm_mib {
            Some(mib) => Ask {
                memory_mib: ask.vms.saturating_mul(mib),
                ..ask
            },
            None => Ask {
                vms: 0,
                memory_mib: 0,
                ..ask
            },
        };
        // One admission at a time, from the count to the hold: a racing request counts
        // what this one takes.
        let _one_at_a_time = self.admitting.lock().unwrap_or_else(|p| p.into_inner());
        let usage = self.usage(project)?;
        quotas.admit(project, usage, ask)?;
        let vms = (ask.vms > 0).then(|| {
            let mut starting = self.starting.lock().unwrap_or_else(|p| p.into_inner());
            let id = starting.next;
            starting.next += 1;
            starting
                .starts
                .insert(id, (project.to_owned(), ask.memory_mib));
            StartHeld {
                starting: self.starting.clone(),
                id,
            }
        });
        let forks = (ask.fork_children > 0).then(|| ForksCharged {
            quotas: quotas.clone(),
            project: project.to_owned(),
            children: ask.fork_children,
            kept: false,
        });
        Ok(QuotaHold { _vms: vms, forks })
    }

    /// A new session of `project` (its row only).
    pub(super) fn admit_new_session(&self, project: &str) -> Result<(), Status> {
        self.admit_quota(
            project,
            Ask {
                sessions: 1,
                log_bytes: Some(0),
                ..Default::default()
            },
            None,
        )
        .map(drop)
    }

    /// A turn of `row` on `placement` writing `input_bytes` of inputs (`None`: an Exec
    /// that only reports): a VM more if its compute is not live for that harness.
    pub(super) fn admit_turn(
        &self,
        row: &SessionRow,
        placement: &Placement,
        input_bytes: Option<u64>,
    ) -> Result<QuotaHold, Status> {
        let live = self.live_harness(&row.uid).as_deref() == Some(placement.harness.as_str());
        self.admit_quota(
            &row.project,
            Ask {
                log_bytes: input_bytes,
                vms: u64::from(!live),
                ..Default::default()
            },
            placement.runtime.vm_memory_mib(&placement.harness),
        )
    }

    /// `children` fork children of `parent` on `placement` (memory tier: each a VM).
    pub(super) fn admit_fork(
        &self,
        parent: &SessionRow,
        placement: &Placement,
        children: u64,
    ) -> Result<QuotaHold, Status> {
        self.admit_quota(
            &parent.project,
            Ask {
                sessions: children,
                // Each child's log starts as a copy of the parent's (at most all of it).
                log_bytes: Some(children.saturating_mul(parent.log_bytes)),
                vms: if placement.memory_tier() { children } else { 0 },
                fork_children: children,
                ..Default::default()
            },
            placement.runtime.vm_memory_mib(&placement.harness),
        )
    }
}
