//! One `Harness.Connect` stream from the host side: send Start (and, to a harness that
//! takes it in pieces, the rest of the history), answer each harness event
//! through the [`EffectSink`], and end at END, at a clean close after a park acknowledgement,
//! or at the first violation (semantics.md §5).

use std::time::Duration;

use agentvm_proto::v1::{
    ApprovalRef, ControllerFrame, EventKind, controller_frame::Frame, event::Body,
};
use tokio_stream::StreamExt;

use super::endpoint::HarnessStream;
use super::error::ControllerError;
use super::sink::{EffectSink, Reply};

/// After a park the harness must acknowledge and close promptly; a stuck one is cut off.
const PARK_ACK_TIMEOUT: Duration = Duration::from_secs(10);

pub enum RunEnd {
    Completed,
    Parked(ApprovalRef),
}

fn protocol<T>(why: impl Into<String>) -> Result<T, ControllerError> {
    Err(ControllerError::HarnessProtocol(why.into()))
}

/// Drives one stream to its end. `idle` bounds each wait for the harness's next event (the
/// host's own work between events, a model or tool call, is not counted): a harness that
/// never answers fails the turn instead of holding the session.
pub async fn run_stream(
    sink: &mut EffectSink<'_>,
    stream: HarnessStream,
    opening: Vec<ControllerFrame>,
    idle: Duration,
) -> Result<RunEnd, ControllerError> {
    let HarnessStream { frames, mut events } = stream;
    let Some(first) = opening.first() else {
        return protocol("an execution opens with its Start");
    };
    let session = first.session.clone();
    let execution_id = first.execution_id.clone();
    let send = |frame: Frame| {
        let frames = frames.clone();
        let msg = ControllerFrame {
            session: session.clone(),
            execution_id: execution_id.clone(),
            frame: Some(frame),
        };
        async move {
            frames
                .send(msg)
                .await
                .map_err(|_| ControllerError::HarnessFailed("the harness closed its stream".into()))
        }
    };
    for frame in opening {
        frames
            .send(frame)
            .await
            .map_err(|_| ControllerError::HarnessFailed("the harness closed its stream".into()))?;
    }

    // Set once the host has answered a gated call with a park; true after the harness acked.
    let mut parked: Option<(ApprovalRef, bool)> = None;
    let mut heard = false;
    loop {
        let next = match parked {
            Some(_) => match tokio::time::timeout(PARK_ACK_TIMEOUT, events.next()).await {
                Ok(n) => n,
                Err(_) => return protocol("the harness neither acknowledged the park nor closed"),
            },
            None => match tokio::time::timeout(idle, events.next()).await {
                Ok(n) => n,
                Err(_) => return Err(ControllerError::HarnessSilent(idle)),
            },
        };
        let event = match next {
            None => {
                return match parked {
                    Some((park, true)) => Ok(RunEnd::Parked(park)),
                    Some((_, false)) => {
                        protocol("the harness closed without acknowledging the park")
                    }
                    None => protocol("the harness closed the stream without END"),
                };
            }
            // The call never got going: the harness is not there to take it.
            Some(Err(status)) if !heard && status.code() == tonic::Code::Unavailable => {
                return Err(ControllerError::HarnessUnavailable(
                    status.message().to_owned(),
                ));
            }
            Some(Err(status)) => {
                return Err(ControllerError::HarnessFailed(format!(
                    "{:?}: {}",
                    status.code(),
                    status.message()
                )));
            }
            Some(Ok(event)) => event,
        };
        heard = true;
        if event.execution_id != execution_id {
            return protocol(format!(
                "event for execution {:?} on the stream of {execution_id:?}",
                event.execution_id
            ));
        }
        let kind = EventKind::try_from(event.kind).unwrap_or(EventKind::Unspecified);
        if let Some((park, acked)) = &mut parked {
            match (&event.body, kind, *acked) {
                (Some(Body::Parked(ack)), EventKind::EventParked, false) if ack == park => {
                    *acked = true;
                    continue;
                }
                (Some(Body::Parked(ack)), EventKind::EventParked, false) => {
                    return protocol(format!(
                        "park acknowledged for call {:?} request {}, expected {:?} request {}",
                        ack.tool_call_id, ack.request_seq, park.tool_call_id, park.request_seq
                    ));
                }
                _ => {
                    return protocol(format!(
                        "{} after the park; the harness may only acknowledge it and close",
                        kind.as_str_name()
                    ));
                }
            }
        }
        let reply = match (kind, event.body) {
            (EventKind::EventModelCall, Some(Body::Model(call))) => sink.model(call).await?,
            (EventKind::EventOutput, Some(Body::Message(m))) => sink.output(m).await?,
            (EventKind::EventUsage, Some(Body::Usage(u))) => sink.usage(u).await?,
            (EventKind::EventToolCall, Some(Body::Tool(call))) => sink.tool_call(call).await?,
            (EventKind::EventToolResult, Some(Body::Result(r))) => sink.report(r).await?,
            (EventKind::EventEnd, body) => {
                let end = match body {
                    Some(Body::End(end)) => end,
                    _ => return protocol("END without a body"),
                };
                if end.state == "COMPLETED" {
                    sink.finish()?;
                    return Ok(RunEnd::Completed);
                }
                let why = end
                    .error
                    .map(|e| e.description)
                    .filter(|d| !d.is_empty())
                    .unwrap_or_else(|| format!("the harness ended with state {:?}", end.state));
                return Err(ControllerError::HarnessFailed(why));
            }
            (
                EventKind::EventModelCall
                | EventKind::EventOutput
                | EventKind::EventUsage
                | EventKind::EventToolCall
                | EventKind::EventToolResult,
                _,
            ) => return protocol(format!("{} without its body", kind.as_str_name())),
            (other, _) => {
                return protocol(format!("a harness may not send {}", other.as_str_name()));
            }
        };
        match reply {
            Reply::Nothing => {}
            Reply::Frames(list) => {
                for f in list {
                    send(f).await?;
                }
            }
            Reply::Park(park) => {
                send(Frame::Park(park.clone())).await?;
                parked = Some((park, false));
            }
        }
    }
}
