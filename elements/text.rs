//! Question text from the `query` pad: pure string handling with no GStreamer or runtime types,
//! so `fuzz/` includes this file as it is.

/// The question a `query` pad buffer carries, trimmed (empty: no question), or `Err` when the
/// bytes are not UTF-8. NUL bytes (C terminators some producers leave in text buffers) are
/// dropped: GLib strings cannot hold them. With `markup` (caps `format=pango-markup`), tags are
/// removed and entities decoded.
pub fn question_text(bytes: &[u8], markup: bool) -> Result<String, std::str::Utf8Error> {
    let raw = without_nul(std::str::from_utf8(bytes)?);
    Ok(if markup { strip_markup(&raw).trim().to_owned() } else { raw.trim().to_owned() })
}

/// `s` without NUL characters, fit for a GLib string (a message field): GLib would cut the
/// string at the first NUL (and glib-rs asserts against it in debug builds).
pub fn without_nul(s: &str) -> std::borrow::Cow<'_, str> {
    if s.contains('\0') { s.replace('\0', "").into() } else { s.into() }
}

/// Text of a `pango-markup` buffer: tags removed, entities decoded.
pub fn strip_markup(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut in_tag = false;
    for c in s.chars() {
        match c {
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            c if !in_tag => out.push(c),
            _ => (),
        }
    }
    out.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&apos;", "'").replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::{question_text, strip_markup};

    #[test]
    fn markup_is_stripped() {
        assert_eq!(strip_markup("<i>Where is</i> the <b>ball</b> &amp; box?"), "Where is the ball & box?");
    }

    #[test]
    fn query_buffers_become_questions() {
        assert_eq!(question_text(b"  What?\n", false).unwrap(), "What?");
        assert_eq!(question_text(b"\0And \0now?\0", false).unwrap(), "And now?");
        assert_eq!(question_text(b"<b>Bold</b> &amp; sure?", true).unwrap(), "Bold & sure?");
        assert_eq!(question_text(b"<b>Bold</b>", false).unwrap(), "<b>Bold</b>");
        assert!(question_text(b"caf\xc3", false).is_err());
    }
}
