//! Streaming UTF-8 decoding of token pieces: a piece may end inside a character, so bytes are
//! held back until the character is complete and nothing is ever split or lost.

#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Add bytes, returning the text that is complete so far.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(s) => s.len(),
            // An invalid sequence (not merely an incomplete tail) is replaced, not held forever.
            Err(e) if e.error_len().is_some() => {
                let text = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                return text;
            }
            Err(e) => e.valid_up_to(),
        };
        let rest = self.pending.split_off(valid);
        String::from_utf8(std::mem::replace(&mut self.pending, rest)).expect("validated above")
    }

    /// Whatever is left at the end of the answer (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_character_is_held_until_complete() {
        let mut s = Utf8Stream::default();
        let bytes = "né €".as_bytes();
        let mut out = String::new();
        for b in bytes {
            out += &s.push(std::slice::from_ref(b));
        }
        out += &s.finish();
        assert_eq!(out, "né €");
        let mut s = Utf8Stream::default();
        assert_eq!(s.push(&bytes[..2]), "n");
        assert_eq!(s.push(&bytes[2..3]), "é");
    }

    #[test]
    fn invalid_bytes_are_replaced_not_held() {
        let mut s = Utf8Stream::default();
        assert_eq!(s.push(b"a\xffb"), "a\u{fffd}b");
        assert_eq!(s.finish(), "");
    }
}
