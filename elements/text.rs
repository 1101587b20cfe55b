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

/// Characters that end a line for a line reader: `\n`, `\r`, and the other separators that
/// line-splitting readers (Python's `str.splitlines`, Unicode) break on.
fn is_line_break(c: char) -> bool {
    matches!(c, '\n' | '\r' | '\u{0b}' | '\u{0c}' | '\u{1c}'..='\u{1e}' | '\u{85}' | '\u{2028}' | '\u{2029}')
}

/// `s` as one line (`output-format=text`: one line per answer): line breaks are folded, each
/// run of them (with the spaces and tabs around it) becoming a single space, and the result
/// trimmed. Text without line breaks is returned as it is (only trimmed).
pub fn one_line(s: &str) -> std::borrow::Cow<'_, str> {
    let s = s.trim();
    if !s.contains(is_line_break) {
        return s.into();
    }
    let mut out = String::with_capacity(s.len());
    let mut pending_break = false;
    for c in s.chars() {
        if is_line_break(c) {
            pending_break = true;
            // The horizontal space before the break goes with it.
            out.truncate(out.trim_end_matches([' ', '\t']).len());
        } else if pending_break && (c == ' ' || c == '\t') {
            // ... and the horizontal space after it.
        } else {
            if pending_break {
                out.push(' ');
                pending_break = false;
            }
            out.push(c);
        }
    }
    out.into()
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
    use super::{one_line, question_text, strip_markup};

    #[test]
    fn text_lines_fold_line_breaks() {
        assert_eq!(one_line("The ball is red."), "The ball is red.");
        assert_eq!(one_line(" The ball \n"), "The ball");
        assert_eq!(one_line("A red ball.\n\nIt moves\r\nleft."), "A red ball. It moves left.");
        assert_eq!(one_line("One:\n  - two\n\t- three"), "One: - two - three");
        assert_eq!(one_line("a \r\r\n\n b"), "a b");
        assert_eq!(one_line("a\u{2028}b\u{85}c\u{0b}d"), "a b c d");
        assert_eq!(one_line("\n\n"), "");
        assert_eq!(one_line("tab\tstays"), "tab\tstays");
        for s in ["x\ny", "\r", "α\r\nβ  \n γ", "end\n"] {
            assert!(!one_line(s).contains(['\n', '\r']), "{s:?}");
        }
    }

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
