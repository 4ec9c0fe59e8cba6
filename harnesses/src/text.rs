//! Small helpers for text-only messages.

use agentvm_proto::v1::{Message, Part, TextPart, part};

pub fn text_of(message: &Message) -> String {
    message
        .parts
        .iter()
        .filter_map(|p| match &p.part {
            Some(part::Part::Text(t)) => Some(t.text.as_str()),
            _ => None,
        })
        .collect()
}

pub fn text_message(role: &str, text: impl Into<String>) -> Message {
    Message {
        role: role.to_owned(),
        parts: vec![Part {
            part: Some(part::Part::Text(TextPart { text: text.into() })),
        }],
    }
}
