//! A buffer on vlmquery's `query` pad, read as its chain function reads it: `question_text`
//! (elements/text.rs, included as it is): UTF-8 or refused, NULs dropped, pango markup stripped
//! when the caps say `pango-markup`, trimmed. Must never panic; the question is fit for a GLib
//! string; stripping only removes and decodes.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../elements/text.rs"]
#[allow(dead_code)]
mod text;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, bytes)) = data.split_first() else { return };
    let markup = flags & 1 == 1;
    let Ok(question) = text::question_text(bytes, markup) else {
        assert!(std::str::from_utf8(bytes).is_err(), "valid UTF-8 refused");
        return;
    };
    let raw = std::str::from_utf8(bytes).expect("accepted text is UTF-8");
    assert!(!question.contains('\0'), "a NUL reached the question: {question:?}");
    assert_eq!(question.trim(), question);
    assert!(question.len() <= raw.len());
    let stripped = text::strip_markup(raw);
    assert!(stripped.chars().count() <= raw.chars().count(), "stripping made {raw:?} longer: {stripped:?}");
    if !raw.contains(['<', '&']) {
        assert_eq!(stripped, raw, "text without markup was changed");
    }
    if !raw.contains('&') {
        // Without entities, nothing between '<' and '>' survives.
        assert!(!stripped.contains('<'), "a tag survived: {raw:?} -> {stripped:?}");
    }
    if !markup && !raw.contains('\0') {
        assert_eq!(question, raw.trim());
    }
});
