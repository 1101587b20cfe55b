//! The `vlm-question` event's fields with any GLib type an application may put there, parsed by
//! `QuestionEvent::parse` (elements/events.rs, included as it is) and checked against what the
//! contract says: `text` a non-blank string, `id` a string if present, `max-tokens` an integer
//! of any integer type in 1..=u32::MAX if present; anything else is refused with a warning
//! naming the field, and extra fields are ignored.

#![no_main]

use std::sync::Once;

use arbitrary::Arbitrary;
use gst::glib::prelude::*;
use libfuzzer_sys::fuzz_target;

#[path = "../../elements/events.rs"]
#[allow(dead_code)]
mod events;

use events::QuestionEvent;

#[derive(Arbitrary, Debug, Clone)]
enum Value {
    Str(String),
    I32(i32),
    U32(u32),
    I64(i64),
    U64(u64),
    F64(f64),
    Bool(bool),
    Fraction(i16, i16),
}

impl Value {
    fn send_value(&self) -> gst::glib::SendValue {
        match self {
            // GLib strings end at a NUL: the event carries what is before it.
            Value::Str(s) => s.replace('\0', "").to_send_value(),
            Value::I32(v) => v.to_send_value(),
            Value::U32(v) => v.to_send_value(),
            Value::I64(v) => v.to_send_value(),
            Value::U64(v) => v.to_send_value(),
            Value::F64(v) => v.to_send_value(),
            Value::Bool(v) => v.to_send_value(),
            Value::Fraction(n, d) => gst::Fraction::new(i32::from(*n), i32::from(*d).max(1)).to_send_value(),
        }
    }

    fn integer(&self) -> Option<i128> {
        match *self {
            Value::I32(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::I64(v) => Some(v.into()),
            Value::U64(v) => Some(v.into()),
            _ => None,
        }
    }
}

#[derive(Arbitrary, Debug)]
struct Input {
    text: Option<Value>,
    id: Option<Value>,
    max_tokens: Option<Value>,
    extra: Vec<(u8, Value)>,
}

const EXTRA: [&str; 4] = ["stream", "max_tokens", "Text", "question"];

fuzz_target!(|input: Input| {
    static INIT: Once = Once::new();
    INIT.call_once(|| gst::init().unwrap());
    let mut s = gst::Structure::new_empty(events::QUESTION);
    for (i, v) in &input.extra {
        s.set_value(EXTRA[*i as usize % EXTRA.len()], v.send_value());
    }
    for (field, v) in [("text", &input.text), ("id", &input.id), ("max-tokens", &input.max_tokens)] {
        if let Some(v) = v {
            s.set_value(field, v.send_value());
        }
    }
    let parsed = QuestionEvent::parse(&gst::event::CustomDownstream::new(s)).expect("a vlm-question event");

    // What the contract says, field by field in the order the parser checks them.
    let text = match &input.text {
        Some(Value::Str(t)) => Some(t.replace('\0', "")),
        _ => None,
    };
    let expected: Result<(), &str> = match (&text, &input.id, &input.max_tokens) {
        (None, _, _) => Err("'text'"),
        (Some(t), _, _) if t.trim().is_empty() => Err("empty"),
        (_, Some(id), _) if !matches!(id, Value::Str(_)) => Err("'id'"),
        (_, _, Some(n)) if !n.integer().is_some_and(|n| (1..=u32::MAX as i128).contains(&n)) => Err("'max-tokens'"),
        _ => Ok(()),
    };
    match (parsed, expected) {
        (Ok(q), Ok(())) => {
            assert_eq!(Some(&q.text), text.as_ref());
            let id = match &input.id {
                Some(Value::Str(id)) => Some(id.replace('\0', "")),
                _ => None,
            };
            assert_eq!(q.id, id);
            assert_eq!(q.max_tokens.map(i128::from), input.max_tokens.as_ref().and_then(Value::integer));
        }
        (Err(why), Err(field)) => assert!(why.contains(field), "refused without naming {field}: {why}"),
        (parsed, expected) => panic!("parsed {parsed:?}, the contract says {expected:?} for {input:?}"),
    }
});
