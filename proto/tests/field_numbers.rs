//! Checks every message, field number, type and label of our .proto files against a table
//! written from shared/spec/wire.md §2, so a renumbering or a changed type cannot slip in.

use std::collections::BTreeMap;

use prost::Message;
use prost_types::{FileDescriptorSet, field_descriptor_proto::Label, field_descriptor_proto::Type};

// One line per field: `Message field number type`, where type is a scalar name, a message or
// enum name (package-relative), `repeated T`, `map`, `optional T`, or `oneof:<name> T`.
const FIELDS: &str = "
ResourceMetadata project 1 string
ResourceMetadata name 2 string
ResourceMetadata uid 3 string
ResourceMetadata version 4 int64
ResourceMetadata create_time 5 google.protobuf.Timestamp
ResourceMetadata update_time 6 google.protobuf.Timestamp
Part text 1 oneof:part TextPart
Part file 2 oneof:part FilePart
Part data 3 oneof:part DataPart
Part reasoning 4 oneof:part ReasoningPart
Part tool_call 5 oneof:part ToolCall
Part tool_result 6 oneof:part ToolResult
TextPart text 1 string
FilePart mime 1 string
FilePart bytes 2 oneof:source bytes
FilePart uri 3 oneof:source string
FilePart name 4 string
FilePart digest 5 string
DataPart data 1 google.protobuf.Struct
ReasoningPart provider 1 string
ReasoningPart model_id 2 string
ReasoningPart opaque_bytes 3 oneof:opaque bytes
ReasoningPart opaque_uri 4 oneof:opaque string
ReasoningPart summary 5 repeated Part
ReasoningPart item_id 6 string
ReasoningPart ordinal 7 int32
ReasoningPart validity_scope 8 string
ReasoningPart opaque_digest 9 string
Message role 1 string
Message parts 2 repeated Part
IdentityRef principal 1 string
IdentityRef issuer 2 string
IdentityRef subject 3 string
Origin source 1 string
Origin subject 2 string
Origin uri 3 string
Origin attributes 4 map
ModelCall model 1 string
ModelCall params 2 map
ModelCall input_hash 3 string
ModelCall id 4 string
ModelCall messages 5 repeated Message
ModelCall tools 6 repeated ToolDefinition
ModelCall tool_choice 7 ToolChoice
ToolDefinition name 1 string
ToolDefinition description 2 string
ToolDefinition input_schema 3 google.protobuf.Struct
ToolChoice mode 1 ToolChoice.Mode
ToolChoice name 2 string
Usage model 1 string
Usage input_tokens 2 int64
Usage output_tokens 3 int64
Usage reasoning_tokens 4 int64
ToolCall id 1 string
ToolCall tool 2 string
ToolCall args 3 google.protobuf.Struct
ToolCall mediation 4 Mediation
ToolCall idempotency_key 5 string
ToolResult id 1 string
ToolResult output 2 google.protobuf.Struct
ToolResult output_uri 3 string
ToolResult is_error 4 bool
ToolResult error 5 string
ToolResult output_digest 6 string
ToolResult content 7 repeated Part
ToolResult code 8 ToolResult.Code
ToolResult approval_request_seq 9 int64
ToolResult approval_decision_seq 10 int64
ApprovalRequest tool_call_id 1 string
ApprovalRequest reason 2 string
ApprovalResult tool_call_id 1 string
ApprovalResult approved 2 bool
ApprovalResult reason 3 string
ApprovalResult request_seq 4 int64
ApprovalRef execution_id 1 string
ApprovalRef tool_call_id 2 string
ApprovalRef request_seq 3 int64
Error code 1 int32
Error description 2 string
HarnessEnd state 1 string
HarnessEnd error 2 Error
Lifecycle kind 1 Lifecycle.Kind
Lifecycle detail 2 string
Lifecycle snapshot_local 3 string
Lifecycle snapshot_external_uri 4 string
Lifecycle snapshot_memory 5 bool
Lifecycle snapshot_sealed 6 bool
ExecutionStart config 1 bytes
ExecutionStart resume_from_seq 2 int64
ExecutionStart input_count 3 optional int64
ExecutionStart harness 4 string
ExecutionStart harness_version 5 string
Event execution_id 2 string
Event ts 3 google.protobuf.Timestamp
Event schema_version 4 int32
Event kind 7 EventKind
Event message 8 oneof:body Message
Event model 9 oneof:body ModelCall
Event tool 10 oneof:body ToolCall
Event result 11 oneof:body ToolResult
Event approval 12 oneof:body ApprovalRequest
Event approval_result 13 oneof:body ApprovalResult
Event usage 14 oneof:body Usage
Event lifecycle 15 oneof:body Lifecycle
Event end 16 oneof:body HarnessEnd
Event error 17 oneof:body Error
Event actor 18 IdentityRef
Event execution_start 19 oneof:body ExecutionStart
Event parked 20 oneof:body ApprovalRef
LogRecord seq 1 int64
LogRecord prev_hash 2 string
LogRecord content_hash 3 string
LogRecord fence 4 int64
LogRecord event 5 Event
SnapshotRef local 1 string
SnapshotRef external_uri 2 string
SnapshotRef memory 3 bool
SnapshotRef sealed 4 bool
RuntimeCapabilities memory_snapshot 1 bool
RuntimeCapabilities cow_fork 2 bool
RuntimeCapabilities attest 3 bool
RuntimeCapabilities gpu_state 4 bool
ComputeRef runtime 1 string
ComputeRef worker 2 string
ComputeRef snapshot 3 SnapshotRef
ComputeRef capabilities 4 RuntimeCapabilities
ComputeRef attributes 5 map
ComputeRef fence_token 6 int64
Session metadata 1 ResourceMetadata
Session harness 2 string
Session model 3 string
Session last_seq 5 int64
Session parent_uid 6 string
Session fork_seq 7 int64
Session identity 8 IdentityRef
Session compute 9 ComputeRef
Session origin 10 Origin
Session labels 11 map
Session annotations 12 map
Session exec_state 13 ExecState
Session compute_state 14 ComputeState
Session pending_approval 15 ApprovalRef
CreateSessionRequest session 1 Session
GetSessionRequest uid 1 string
DeleteSessionRequest uid 1 string
ListSessionsRequest project 1 string
ListSessionsRequest page_size 2 int32
ListSessionsRequest page_token 3 string
ListSessionsResponse sessions 1 repeated Session
ListSessionsResponse next_page_token 2 string
ExecRequest session 1 string
ExecRequest inputs 2 repeated Message
ExecRequest resume_from_seq 3 int64
ExecRequest harness 4 string
ExecRequest config 5 bytes
ExecRequest expected_last_seq 6 optional int64
ExecRequest deadline_unix 7 int64
ReplayRequest session 1 string
ReplayRequest from_seq 2 int64
ReplayRequest to_seq 3 int64
ApproveRequest session 1 string
ApproveRequest execution_id 2 string
ApproveRequest tool_call_id 3 string
ApproveRequest request_seq 4 int64
ApproveRequest approved 5 optional bool
ApproveRequest reason 6 string
ApproveRequest identity 7 IdentityRef
ApproveResponse session 1 Session
ApproveResponse decision 2 LogRecord
SuspendRequest session 1 string
ResumeRequest session 1 string
ResumeRequest boot 2 bool
ForkRequest session 1 string
ForkRequest at_seq 2 int64
ForkRequest count 3 int32
ForkRequest identity 4 IdentityRef
ForkRequest labels 5 map
ForkRequest child_names 6 repeated string
ForkResponse children 1 repeated Session
CancelRequest session 1 string
CancelRequest execution_id 2 string
CancelRequest reason 3 string
ExecUpdate record 1 oneof:update LogRecord
ExecUpdate delta 2 oneof:update Delta
ExecUpdate session 3 oneof:update Session
Delta execution_id 1 string
Delta part_index 2 int32
Delta chunk 3 string
Delta done 4 bool
Capabilities resumability 1 Resumability
Capabilities fork_safe 2 bool
Capabilities requires_gpu 3 bool
Capabilities streaming 4 bool
Capabilities reasoning_replay 5 bool
ToolSpec name 1 string
ToolSpec description 2 string
ToolSpec mediation 3 Mediation
HarnessDescriptor id 1 string
HarnessDescriptor models 2 repeated string
HarnessDescriptor tools 3 repeated ToolSpec
HarnessDescriptor capabilities 4 Capabilities
HarnessDescriptor version 5 string
IdentityContext principal 1 IdentityRef
IdentityContext can_mint_tokens 2 bool
Start config 1 bytes
Start history 2 repeated Event
Start inputs 3 repeated Message
Start identity 4 IdentityContext
Start resume_from_seq 5 int64
Cancel reason 1 string
ControllerFrame session 1 string
ControllerFrame execution_id 2 string
ControllerFrame start 3 oneof:frame Start
ControllerFrame cancel 4 oneof:frame Cancel
ControllerFrame approval 5 oneof:frame ApprovalResult
ControllerFrame tool 6 oneof:frame ToolResult
ControllerFrame model 7 oneof:frame ModelResult
ControllerFrame park 8 oneof:frame ApprovalRef
ModelResult message 1 Message
ModelResult usage 2 Usage
ModelResult model_call_id 3 string
RemotePlacement address 1 string
SubstratePlacement atespace 1 string
SubstratePlacement template 2 string
HarnessSpec remote 1 oneof:placement RemotePlacement
HarnessSpec substrate 2 oneof:placement SubstratePlacement
HarnessSpec capabilities 3 Capabilities
HarnessSpec descriptor_id 4 string
HarnessRegistration metadata 1 ResourceMetadata
HarnessRegistration spec 2 HarnessSpec
HarnessRegistration spec_digest 3 string
HarnessRegistration state 4 HarnessState
HarnessRegistration source 5 HarnessSource
HarnessRegistration retire_time 6 google.protobuf.Timestamp
HarnessRegistration retire_reason 7 string
HarnessRegistration observed 8 HarnessDescriptor
HarnessRegistration observe_error 9 string
HarnessRegistration unservable_reason 10 string
RegisterHarnessRequest name 1 string
RegisterHarnessRequest spec 2 HarnessSpec
RegisterHarnessResponse harness 1 HarnessRegistration
RegisterHarnessResponse outcome 2 RegisterOutcome
GetHarnessRequest name 1 string
GetHarnessRequest observe 2 bool
ListHarnessesRequest page_size 1 int32
ListHarnessesRequest page_token 2 string
ListHarnessesRequest include_retired 3 bool
ListHarnessesResponse harnesses 1 repeated HarnessRegistration
ListHarnessesResponse next_page_token 2 string
RetireHarnessRequest name 1 string
RetireHarnessRequest reason 2 string
";

// `Enum VALUE number`.
const ENUMS: &str = "
Mediation MEDIATION_UNSPECIFIED 0
Mediation MEDIATION_IN_HARNESS_REPORTED 1
Mediation MEDIATION_CONTROLLER_MEDIATED 2
Mediation MEDIATION_REQUIRES_APPROVAL 3
ToolChoice.Mode MODE_UNSPECIFIED 0
ToolChoice.Mode MODE_AUTO 1
ToolChoice.Mode MODE_NONE 2
ToolChoice.Mode MODE_REQUIRED 3
ToolResult.Code CODE_UNSPECIFIED 0
ToolResult.Code APPROVAL_DENIED 1
ToolResult.Code EXECUTOR_ERROR 2
Lifecycle.Kind LIFECYCLE_UNSPECIFIED 0
Lifecycle.Kind LIFECYCLE_SUSPEND 1
Lifecycle.Kind LIFECYCLE_RESUME 2
Lifecycle.Kind LIFECYCLE_FORK 3
Lifecycle.Kind LIFECYCLE_BASELINE 4
Lifecycle.Kind LIFECYCLE_CANCEL 5
EventKind EVENT_KIND_UNSPECIFIED 0
EventKind EVENT_INPUT 1
EventKind EVENT_MODEL_CALL 2
EventKind EVENT_OUTPUT 3
EventKind EVENT_TOOL_CALL 4
EventKind EVENT_TOOL_RESULT 5
EventKind EVENT_APPROVAL_REQUEST 6
EventKind EVENT_APPROVAL_RESULT 7
EventKind EVENT_USAGE 8
EventKind EVENT_LIFECYCLE 9
EventKind EVENT_END 10
EventKind EVENT_ERROR 11
EventKind EVENT_EXECUTION_START 12
EventKind EVENT_PARKED 13
ExecState EXEC_STATE_UNSPECIFIED 0
ExecState EXEC_PENDING 1
ExecState EXEC_RUNNING 2
ExecState EXEC_AWAITING 3
ExecState EXEC_COMPLETED 4
ExecState EXEC_FAILED 5
ExecState EXEC_CANCELED 6
ComputeState COMPUTE_STATE_UNSPECIFIED 0
ComputeState COMPUTE_NONE 1
ComputeState COMPUTE_LIVE 2
ComputeState COMPUTE_WARM 3
ComputeState COMPUTE_COLD 4
ComputeState COMPUTE_TERMINATED 5
Resumability RESUMABILITY_UNSPECIFIED 0
Resumability RESUMABILITY_STATELESS_REPLAY 1
Resumability RESUMABILITY_REQUIRES_MEMORY_SNAPSHOT 2
HarnessState HARNESS_STATE_UNSPECIFIED 0
HarnessState HARNESS_STATE_ACTIVE 1
HarnessState HARNESS_STATE_RETIRED 2
HarnessSource HARNESS_SOURCE_UNSPECIFIED 0
HarnessSource HARNESS_SOURCE_STATIC 1
HarnessSource HARNESS_SOURCE_REGISTERED 2
RegisterOutcome REGISTER_OUTCOME_UNSPECIFIED 0
RegisterOutcome REGISTER_OUTCOME_CREATED 1
RegisterOutcome REGISTER_OUTCOME_UNCHANGED 2
RegisterOutcome REGISTER_OUTCOME_REACTIVATED 3
";

// `Service Method Request Response [client-stream] [server-stream]`.
const RPCS: &str = "
Sessions CreateSession CreateSessionRequest Session
Sessions GetSession GetSessionRequest Session
Sessions ListSessions ListSessionsRequest ListSessionsResponse
Sessions DeleteSession DeleteSessionRequest Session
Sessions Exec ExecRequest ExecUpdate server-stream
Sessions Replay ReplayRequest LogRecord server-stream
Sessions Approve ApproveRequest ApproveResponse
Sessions Cancel CancelRequest Session
Sessions Suspend SuspendRequest Session
Sessions Resume ResumeRequest Session
Sessions Fork ForkRequest ForkResponse
Harness Describe DescribeRequest HarnessDescriptor
Harness Connect ControllerFrame Event client-stream server-stream
HarnessRegistry RegisterHarness RegisterHarnessRequest RegisterHarnessResponse
HarnessRegistry GetHarness GetHarnessRequest HarnessRegistration
HarnessRegistry ListHarnesses ListHarnessesRequest ListHarnessesResponse
HarnessRegistry RetireHarness RetireHarnessRequest HarnessRegistration
";

const PACKAGE: &str = "agentsessions.v1";

fn descriptor_set() -> FileDescriptorSet {
    FileDescriptorSet::decode(agentvm_proto::FILE_DESCRIPTOR_SET).expect("descriptor set decodes")
}

fn scalar(t: Type) -> Option<&'static str> {
    Some(match t {
        Type::String => "string",
        Type::Int64 => "int64",
        Type::Int32 => "int32",
        Type::Bool => "bool",
        Type::Bytes => "bytes",
        Type::Uint32 => "uint32",
        Type::Uint64 => "uint64",
        Type::Double => "double",
        _ => return None,
    })
}

/// Renders each field of the agentsessions.v1 package in the table's notation.
fn actual_fields() -> BTreeMap<(String, String), String> {
    let mut out = BTreeMap::new();
    for file in descriptor_set().file {
        if file.package() != PACKAGE {
            continue;
        }
        let mut stack: Vec<(String, &prost_types::DescriptorProto)> = file
            .message_type
            .iter()
            .map(|m| (m.name().to_owned(), m))
            .collect();
        while let Some((name, msg)) = stack.pop() {
            if msg.options.as_ref().is_some_and(|o| o.map_entry()) {
                continue;
            }
            for nested in &msg.nested_type {
                stack.push((format!("{name}.{}", nested.name()), nested));
            }
            for f in &msg.field {
                let base = match scalar(f.r#type()) {
                    Some(s) => s.to_owned(),
                    None => {
                        let tn = f.type_name();
                        tn.strip_prefix(&format!(".{PACKAGE}."))
                            .or_else(|| tn.strip_prefix('.'))
                            .unwrap_or(tn)
                            .to_owned()
                    }
                };
                let is_map = base.ends_with("Entry") && f.label() == Label::Repeated;
                let rendered = if is_map {
                    "map".to_owned()
                } else if f.proto3_optional() {
                    format!("optional {base}")
                } else if let Some(i) = f.oneof_index {
                    format!("oneof:{} {base}", msg.oneof_decl[i as usize].name())
                } else if f.label() == Label::Repeated {
                    format!("repeated {base}")
                } else {
                    base
                };
                out.insert(
                    (name.clone(), f.name().to_owned()),
                    format!("{} {rendered}", f.number()),
                );
            }
        }
    }
    out
}

// agentvm's own fields on upstream messages, which upstream peers skip as unknown fields.
// Numbered from 100, far above upstream's, so a field upstream adds later never collides.
const EXTENSIONS: &str = "
Start history_after_seq 100 int64
Start history_continues 101 bool
Capabilities incremental_history 100 bool
HistoryChunk events 1 repeated Event
HistoryChunk more 2 bool
ControllerFrame history 100 oneof:frame HistoryChunk
";

#[test]
fn extensions_stay_clear_of_upstream_numbers() {
    for line in EXTENSIONS.lines().filter(|l| !l.trim().is_empty()) {
        let (message, number) = (line.split(' ').next().unwrap(), line.split(' ').nth(2));
        let number: u32 = number.unwrap().parse().unwrap();
        // A message of our own (not upstream's) numbers its fields as it likes.
        let ours = !FIELDS
            .lines()
            .any(|l| l.starts_with(&format!("{message} ")));
        assert!(
            ours || number >= 100,
            "{line}: an extension is numbered from 100"
        );
    }
}

#[test]
fn every_field_matches_the_wire_table() {
    let actual = actual_fields();
    let mut expected = BTreeMap::new();
    for line in FIELDS
        .lines()
        .chain(EXTENSIONS.lines())
        .filter(|l| !l.trim().is_empty())
    {
        let mut parts = line.splitn(3, ' ');
        let (msg, field, rest) = (
            parts.next().unwrap(),
            parts.next().unwrap(),
            parts.next().unwrap(),
        );
        expected.insert((msg.to_owned(), field.to_owned()), rest.to_owned());
    }
    let mut problems = Vec::new();
    for (key, want) in &expected {
        match actual.get(key) {
            Some(got) if got == want => {}
            Some(got) => problems.push(format!("{}.{}: want `{want}`, have `{got}`", key.0, key.1)),
            None => problems.push(format!("{}.{}: missing", key.0, key.1)),
        }
    }
    for key in actual.keys() {
        if !expected.contains_key(key) {
            problems.push(format!("{}.{}: not in the wire table", key.0, key.1));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn map_fields_are_string_to_string() {
    for file in descriptor_set()
        .file
        .iter()
        .filter(|f| f.package() == PACKAGE)
    {
        for msg in &file.message_type {
            for entry in msg
                .nested_type
                .iter()
                .filter(|n| n.options.as_ref().is_some_and(|o| o.map_entry()))
            {
                for f in &entry.field {
                    assert_eq!(f.r#type(), Type::String, "{}.{}", msg.name(), entry.name());
                }
            }
        }
    }
}

#[test]
fn every_enum_value_matches_the_wire_table() {
    let mut actual = BTreeMap::new();
    for file in descriptor_set()
        .file
        .iter()
        .filter(|f| f.package() == PACKAGE)
    {
        for e in &file.enum_type {
            for v in &e.value {
                actual.insert((e.name().to_owned(), v.name().to_owned()), v.number());
            }
        }
        for msg in &file.message_type {
            for e in &msg.enum_type {
                for v in &e.value {
                    actual.insert(
                        (format!("{}.{}", msg.name(), e.name()), v.name().to_owned()),
                        v.number(),
                    );
                }
            }
        }
    }
    let mut expected = BTreeMap::new();
    for line in ENUMS.lines().filter(|l| !l.trim().is_empty()) {
        let p: Vec<&str> = line.split(' ').collect();
        expected.insert(
            (p[0].to_owned(), p[1].to_owned()),
            p[2].parse::<i32>().unwrap(),
        );
    }
    assert_eq!(actual, expected);
}

#[test]
fn every_rpc_matches_the_wire_table() {
    let mut actual = BTreeMap::new();
    for file in descriptor_set()
        .file
        .iter()
        .filter(|f| f.package() == PACKAGE)
    {
        for s in &file.service {
            for m in &s.method {
                let mut shape = vec![
                    m.input_type()
                        .trim_start_matches(&format!(".{PACKAGE}."))
                        .to_owned(),
                    m.output_type()
                        .trim_start_matches(&format!(".{PACKAGE}."))
                        .to_owned(),
                ];
                if m.client_streaming() {
                    shape.push("client-stream".into());
                }
                if m.server_streaming() {
                    shape.push("server-stream".into());
                }
                actual.insert((s.name().to_owned(), m.name().to_owned()), shape.join(" "));
            }
        }
    }
    let mut expected = BTreeMap::new();
    for line in RPCS.lines().filter(|l| !l.trim().is_empty()) {
        let p: Vec<&str> = line.splitn(3, ' ').collect();
        expected.insert((p[0].to_owned(), p[1].to_owned()), p[2].to_owned());
    }
    assert_eq!(actual, expected);
}

#[test]
fn reserved_numbers_stay_reserved() {
    let set = descriptor_set();
    let find = |name: &str| {
        set.file
            .iter()
            .flat_map(|f| f.message_type.iter())
            .find(|m| m.name() == name)
            .unwrap()
            .reserved_range
            .iter()
            .flat_map(|r| r.start()..r.end())
            .collect::<Vec<_>>()
    };
    assert_eq!(find("Event"), vec![1, 5, 6]);
    assert_eq!(find("Session"), vec![4]);
}
