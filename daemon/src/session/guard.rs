//! The per-process session guard (W3): at most one operation holds a session. A turn can be
//! preempted by a checkpoint (Suspend, memory Fork, Delete) or by Cancel — the checkpoint
//! variant of semantics.md §4.8 — while any other overlap is refused at once, never queued.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::controller::Interrupt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Exec, Resume, Approve: an execution may be running.
    Turn,
    /// Suspend, Fork, Cancel, Delete: compute or the log is being reshaped.
    Checkpoint,
}

struct Slot {
    hold: Hold,
    interrupt: watch::Sender<Option<Interrupt>>,
    released: watch::Receiver<bool>,
}

#[derive(Default)]
pub struct Guards {
    slots: Mutex<HashMap<String, Slot>>,
}

/// Holding a session; dropping it releases the session and wakes whoever preempted it.
pub struct Held {
    guards: Arc<Guards>,
    uid: String,
    released: watch::Sender<bool>,
    pub interrupt: watch::Receiver<Option<Interrupt>>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.guards
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.uid);
        let _ = self.released.send(true);
    }
}

/// How long a preempting operation waits for the preempted turn to stop.
const PREEMPT_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy(pub Hold);

impl Guards {
    pub fn try_hold(self: &Arc<Self>, uid: &str, hold: Hold) -> Result<Held, Busy> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = slots.get(uid) {
            return Err(Busy(slot.hold));
        }
        let (interrupt_tx, interrupt_rx) = watch::channel(None);
        let (released_tx, released_rx) = watch::channel(false);
        slots.insert(
            uid.to_owned(),
            Slot {
                hold,
                interrupt: interrupt_tx,
                released: released_rx,
            },
        );
        Ok(Held {
            guards: Arc::clone(self),
            uid: uid.to_owned(),
            released: released_tx,
            interrupt: interrupt_rx,
        })
    }

    /// Holds the session, first interrupting a running turn with `why` and waiting for it to
    /// let go. A checkpoint already in progress is never preempted.
    pub async fn preempt_and_hold(
        self: &Arc<Self>,
        uid: &str,
        hold: Hold,
        why: Interrupt,
    ) -> Result<Held, Busy> {
        loop {
            let mut released = {
                let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
                match slots.get(uid) {
                    None => None,
                    Some(slot) if slot.hold == Hold::Turn => {
                        let _ = slot.interrupt.send(Some(why.clone()));
                        Some(slot.released.clone())
                    }
                    Some(slot) => return Err(Busy(slot.hold)),
                }
            };
            match released.as_mut() {
                None => match self.try_hold(uid, hold) {
                    Ok(h) => return Ok(h),
                    Err(Busy(Hold::Checkpoint)) => return Err(Busy(Hold::Checkpoint)),
                    // A new turn slipped in: interrupt that one too.
                    Err(Busy(Hold::Turn)) => continue,
                },
                Some(rx) => {
                    let stopped = tokio::time::timeout(PREEMPT_TIMEOUT, rx.wait_for(|r| *r)).await;
                    if stopped.is_err() {
                        return Err(Busy(Hold::Turn));
                    }
                }
            }
        }
    }

    pub fn is_held(&self, uid: &str) -> bool {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(uid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn overlap_is_refused_and_released_on_drop() {
        let g = Arc::new(Guards::default());
        let held = g.try_hold("s", Hold::Turn).unwrap();
        assert_eq!(g.try_hold("s", Hold::Turn).err(), Some(Busy(Hold::Turn)));
        assert!(
            g.try_hold("other", Hold::Turn).is_ok(),
            "independent sessions proceed"
        );
        drop(held);
        assert!(g.try_hold("s", Hold::Checkpoint).is_ok());
    }

    #[tokio::test]
    async fn a_checkpoint_preempts_a_turn_but_not_another_checkpoint() {
        let g = Arc::new(Guards::default());
        let mut turn = g.try_hold("s", Hold::Turn).unwrap();
        let waiter = {
            let g = Arc::clone(&g);
            tokio::spawn(async move {
                g.preempt_and_hold(
                    "s",
                    Hold::Checkpoint,
                    Interrupt::Supersede("suspend".into()),
                )
                .await
                .map(|_| ())
            })
        };
        turn.interrupt.changed().await.unwrap();
        assert_eq!(
            *turn.interrupt.borrow(),
            Some(Interrupt::Supersede("suspend".into()))
        );
        drop(turn);
        waiter.await.unwrap().unwrap();

        let _cp = g.try_hold("t", Hold::Checkpoint).unwrap();
        let r = g
            .preempt_and_hold("t", Hold::Checkpoint, Interrupt::Supersede("x".into()))
            .await;
        assert_eq!(r.err(), Some(Busy(Hold::Checkpoint)));
    }
}
