//! The `vlm-question` event as an application or gst-launch writes it: any text, parsed by
//! GStreamer as a structure (`vlm-question, text=..., id=..., max-tokens=...`), then by
//! `QuestionEvent::parse` (elements/events.rs, included as it is). Must never panic; what it
//! accepts must be a question vlmquery can take.

#![no_main]

use std::str::FromStr;
use std::sync::Once;

use libfuzzer_sys::fuzz_target;

#[path = "../../elements/events.rs"]
#[allow(dead_code)]
mod events;

use events::QuestionEvent;

fn check(s: gst::Structure) {
    let is_question = s.name() == events::QUESTION;
    let event = gst::event::CustomDownstream::new(s);
    match QuestionEvent::parse(&event) {
        None => assert!(!is_question, "a vlm-question event was not recognised"),
        Some(Ok(q)) => {
            assert!(is_question);
            assert!(!q.text.trim().is_empty(), "an empty question was accepted");
            assert!(q.max_tokens.is_none_or(|n| n > 0), "max-tokens 0 was accepted");
        }
        Some(Err(why)) => {
            assert!(is_question);
            assert!(why.contains("vlm-question"), "the warning does not say what was refused: {why}");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    static INIT: Once = Once::new();
    INIT.call_once(|| gst::init().unwrap());
    // A C string (what gst-launch and applications pass) ends at its first NUL; glib-rs asserts
    // against one inside (a finding of this target, in the binding, not in the plugin).
    let Ok(text) = std::str::from_utf8(data.split(|&b| b == 0).next().unwrap_or_default()) else { return };
    // As written, and with the name in front (most inputs then reach the field checks).
    for candidate in [text.to_owned(), format!("{}, {text}", events::QUESTION)] {
        if let Ok(s) = gst::Structure::from_str(&candidate) {
            check(s);
        }
    }
});
