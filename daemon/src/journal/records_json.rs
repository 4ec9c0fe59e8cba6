//! The interchange format of `agentvm journal export` / `verify`: `LogRecord`s in proto3 JSON
//! with the proto's own field names, one per line (JSON lines) or as one JSON array.

use std::io::Write;

use agentvm_proto::canon;
use agentvm_proto::v1::LogRecord;

#[derive(Debug, thiserror::Error)]
pub enum RecordsJsonError {
    #[error("line {line}, column {column}: malformed JSON: {reason}")]
    Syntax {
        line: usize,
        column: usize,
        reason: String,
    },
    #[error("{position}: not a LogRecord: {reason}")]
    Record { position: String, reason: String },
    #[error("writing records: {0}")]
    Io(#[from] std::io::Error),
    #[error("seq {seq}: {source}")]
    Canon {
        seq: i64,
        #[source]
        source: canon::CanonError,
    },
}

/// Parses a whole input, deciding between a JSON array and JSON lines by its first character.
pub fn parse_records(input: &str) -> Result<Vec<LogRecord>, RecordsJsonError> {
    let trimmed = input.trim_start();
    if trimmed.starts_with('[') {
        let offset_lines = input[..input.len() - trimmed.len()].matches('\n').count();
        let values: Vec<serde_json::Value> =
            serde_json::from_str(trimmed).map_err(|e| RecordsJsonError::Syntax {
                line: e.line() + offset_lines,
                column: e.column(),
                reason: e.to_string(),
            })?;
        values
            .iter()
            .enumerate()
            .map(|(i, v)| to_record(v, format!("array element {i}")))
            .collect()
    } else {
        let mut out = Vec::new();
        for (i, line) in input.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let value: serde_json::Value =
                serde_json::from_str(line).map_err(|e| RecordsJsonError::Syntax {
                    line: i + 1,
                    column: e.column(),
                    reason: e.to_string(),
                })?;
            out.push(to_record(&value, format!("line {}", i + 1))?);
        }
        Ok(out)
    }
}

fn to_record(value: &serde_json::Value, position: String) -> Result<LogRecord, RecordsJsonError> {
    if !value.is_object() {
        return Err(RecordsJsonError::Record {
            position,
            reason: "expected a JSON object".into(),
        });
    }
    canon::from_proto_json::<LogRecord>(value).map_err(|e| RecordsJsonError::Record {
        position,
        reason: e.to_string(),
    })
}

/// Writes records as JSON lines.
pub fn write_records<'a>(
    records: impl IntoIterator<Item = &'a LogRecord>,
    out: &mut impl Write,
) -> Result<(), RecordsJsonError> {
    for r in records {
        let value = canon::to_proto_json(r)
            .map_err(|source| RecordsJsonError::Canon { seq: r.seq, source })?;
        serde_json::to_writer(&mut *out, &value).map_err(std::io::Error::from)?;
        out.write_all(b"\n")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEGACY: &str = r#"[
      {"seq":"1","content_hash":"62daf59c5c1e5062b1b0d47d5665b34aa52bf7ed0ca8a0b016af2c9827b5d8f6","fence":"1",
       "event":{"kind":"EVENT_INPUT","message":{"role":"user","parts":[{"text":{"text":"hello"}}]}}},
      {"seq":"2","prev_hash":"62daf59c5c1e5062b1b0d47d5665b34aa52bf7ed0ca8a0b016af2c9827b5d8f6",
       "content_hash":"699f567f01dcee2cd3bcf8a6dd4eb4c14400a4b85f5cfd0d285dbb99687dd868","fence":"1",
       "event":{"kind":"EVENT_MODEL_CALL","model":{"id":"49072a2a845249ea","input_hash":"2611c24a1a665deca46265ed96d1e1efc699260c9cba9c07f22cda7939232c30","model":"echo"}}}
    ]"#;

    #[test]
    fn upstream_style_array_parses_and_verifies() {
        let records = parse_records(LEGACY).unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!(super::super::verify::verify_chain(&records), Ok(2));
    }

    #[test]
    fn export_then_parse_round_trips() {
        let records = parse_records(LEGACY).unwrap();
        let mut out = Vec::new();
        write_records(&records, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().count(), 2);
        assert!(text.contains(r#""content_hash":"#), "{text}");
        assert_eq!(parse_records(&text).unwrap(), records);
    }

    #[test]
    fn bad_inputs_report_their_position() {
        let truncated = &LEGACY[..LEGACY.len() / 2];
        match parse_records(truncated) {
            Err(RecordsJsonError::Syntax { line, .. }) => assert!(line >= 1),
            other => panic!("{other:?}"),
        }
        let wrong_type = "{\"seq\":\"1\"}\n{\"seq\":true}\n";
        let err = parse_records(wrong_type).unwrap_err().to_string();
        assert!(err.starts_with("line 2:"), "{err}");
        let unknown_enum = r#"[{"seq":"1","event":{"kind":"EVENT_BOGUS"}}]"#;
        let err = parse_records(unknown_enum).unwrap_err().to_string();
        assert!(
            err.contains("array element 0") && err.contains("EVENT_BOGUS"),
            "{err}"
        );
        let not_object = "[1]";
        assert!(matches!(
            parse_records(not_object),
            Err(RecordsJsonError::Record { .. })
        ));
        let unknown_field = r#"{"seq":"1","hash":"x"}"#;
        assert!(parse_records(unknown_field).is_err());
    }

    #[test]
    fn empty_input_is_an_empty_log() {
        assert!(parse_records("").unwrap().is_empty());
        assert!(parse_records("  \n\n").unwrap().is_empty());
        assert!(parse_records("[]").unwrap().is_empty());
    }
}
