//! A session's log read as executions (semantics.md §1.6): each execution's EXECUTION_START,
//! INPUTs, effect stream and end, found by execution id in first-seen order. Lifecycle records
//! belong to no execution. A legacy (v0.1.2) prefix without execution ids forms turns that end
//! at END or ERROR.

use agentvm_proto::v1::{
    Event, EventKind, ExecutionStart, HarnessEnd, LogRecord, Message, event::Body,
};

use super::error::ControllerError;

/// One record of an execution's effect stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    pub seq: i64,
    pub event: Event,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ExecutionLog {
    /// Empty for a legacy turn.
    pub id: String,
    /// Seq of the execution's first record.
    pub first_seq: i64,
    /// Index of that record in the session's records.
    pub first_index: usize,
    /// None for a legacy turn or a modern execution whose first record is not EXECUTION_START.
    pub start: Option<ExecutionStart>,
    pub inputs: Vec<Message>,
    /// Number of INPUT records (an INPUT without a message counts but has no entry in `inputs`).
    pub input_records: usize,
    /// MODEL_CALL/OUTPUT/TOOL_CALL/TOOL_RESULT/USAGE/APPROVAL_* in order; ERRORs excluded.
    pub effects: Vec<Recorded>,
    pub errors: usize,
    pub end: Option<(i64, HarnessEnd)>,
    /// A legacy turn that ended with ERROR (modern ERRORs are audit only and end nothing).
    pub legacy_error_end: bool,
}

impl ExecutionLog {
    pub fn is_legacy(&self) -> bool {
        self.id.is_empty()
    }

    /// Finished: END recorded (or, for a legacy turn, END or ERROR).
    pub fn is_finished(&self) -> bool {
        self.end.is_some() || self.legacy_error_end
    }

    pub fn is_completed(&self) -> bool {
        self.end
            .as_ref()
            .is_some_and(|(_, e)| e.state == "COMPLETED")
    }

    /// R5: the start promises exactly the INPUTs that follow it, each with a message.
    pub fn check_inputs(&self) -> Result<(), String> {
        if self.is_legacy() {
            return Ok(());
        }
        let start = self
            .start
            .as_ref()
            .ok_or_else(|| format!("execution {} does not begin with EXECUTION_START", self.id))?;
        let count = start
            .input_count
            .ok_or_else(|| format!("execution {} has no input_count", self.id))?;
        if count < 0 {
            return Err(format!("execution {} has input_count {count}", self.id));
        }
        if self.input_records != self.inputs.len() {
            return Err(format!(
                "execution {} has an INPUT without a message",
                self.id
            ));
        }
        if self.inputs.len() as i64 != count {
            return Err(format!(
                "execution {} promised {count} inputs and recorded {}",
                self.id,
                self.inputs.len()
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default)]
pub struct SessionLog {
    pub records: Vec<LogRecord>,
    pub executions: Vec<ExecutionLog>,
}

fn kind_of(e: &Event) -> EventKind {
    EventKind::try_from(e.kind).unwrap_or(EventKind::Unspecified)
}

impl SessionLog {
    pub fn parse(records: Vec<LogRecord>) -> Result<Self, ControllerError> {
        let invalid = |seq: i64, why: &str| {
            Err(ControllerError::InvalidExecutionLog(format!(
                "seq {seq}: {why}"
            )))
        };
        let mut executions: Vec<ExecutionLog> = Vec::new();
        let mut modern_seen = false;
        for (index, record) in records.iter().enumerate() {
            let Some(event) = record.event.as_ref() else {
                return invalid(record.seq, "record has no event");
            };
            let kind = kind_of(event);
            match kind {
                EventKind::EventLifecycle => continue,
                EventKind::Unspecified | EventKind::EventParked => {
                    return invalid(record.seq, "event kind is not journaled");
                }
                _ => {}
            }
            let pos = if event.execution_id.is_empty() {
                if modern_seen {
                    return invalid(
                        record.seq,
                        "event without execution_id after a modern start",
                    );
                }
                // Legacy turns: a new one starts after the previous finished.
                match executions.last() {
                    Some(last) if !last.is_finished() => executions.len() - 1,
                    _ => {
                        executions.push(new_execution(String::new(), record.seq, index));
                        executions.len() - 1
                    }
                }
            } else {
                if !modern_seen && executions.last().is_some_and(|l| !l.is_finished()) {
                    return invalid(
                        record.seq,
                        "an unfinished legacy turn is followed by a modern execution",
                    );
                }
                modern_seen = true;
                match executions.iter().position(|x| x.id == event.execution_id) {
                    Some(p) => p,
                    None => {
                        executions.push(new_execution(
                            event.execution_id.clone(),
                            record.seq,
                            index,
                        ));
                        executions.len() - 1
                    }
                }
            };
            let x = &mut executions[pos];
            if x.is_finished() {
                return invalid(record.seq, "record after the execution's END");
            }
            let first = x.first_index == index;
            match (kind, &event.body) {
                (EventKind::EventExecutionStart, Some(Body::ExecutionStart(s))) if first => {
                    x.start = Some(s.clone());
                }
                (EventKind::EventExecutionStart, _) => {
                    return invalid(
                        record.seq,
                        "EXECUTION_START is not the execution's first record",
                    );
                }
                (EventKind::EventInput, body) => {
                    if !x.effects.is_empty() || x.errors > 0 {
                        return invalid(record.seq, "INPUT after the execution's effects began");
                    }
                    x.input_records += 1;
                    if let Some(Body::Message(m)) = body {
                        x.inputs.push(m.clone());
                    }
                }
                (EventKind::EventEnd, Some(Body::End(end))) => {
                    x.end = Some((record.seq, end.clone()));
                }
                (EventKind::EventEnd, _) => {
                    x.end = Some((record.seq, HarnessEnd::default()));
                }
                (EventKind::EventError, _) => {
                    x.errors += 1;
                    if x.is_legacy() {
                        x.legacy_error_end = true;
                    }
                }
                _ => x.effects.push(Recorded {
                    seq: record.seq,
                    event: event.clone(),
                }),
            }
        }
        Ok(SessionLog {
            records,
            executions,
        })
    }

    pub fn head(&self) -> i64 {
        self.records.last().map_or(0, |r| r.seq)
    }

    /// Every event before record index `index` (an execution's History).
    pub fn history_before(&self, index: usize) -> Vec<Event> {
        self.records[..index]
            .iter()
            .filter_map(|r| r.event.clone())
            .collect()
    }

    /// The trailing execution when it has not finished.
    pub fn pending(&self) -> Option<&ExecutionLog> {
        self.executions.last().filter(|x| !x.is_finished())
    }
}

fn new_execution(id: String, seq: i64, index: usize) -> ExecutionLog {
    ExecutionLog {
        id,
        first_seq: seq,
        first_index: index,
        start: None,
        inputs: Vec::new(),
        input_records: 0,
        effects: Vec::new(),
        errors: 0,
        end: None,
        legacy_error_end: false,
    }
}
