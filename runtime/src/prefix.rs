//! Prefix identity: which history a piece of KV represents, and who can consume it.
//!
//! A [`PrefixKey`] chains through the whole history, like vLLM's block hashes chain their parent:
//! model identity, the prompt's tokens, the attention and position rules, then every frame in
//! order (its content hash, which includes the encoder and its preprocessing, and the positions
//! it occupies). The same frame after a different history is a different prefix.
//!
//! A [`CompatTag`] is separate: it says which engines can consume a stored representation of a
//! prefix (backend, KV dtype, layout).

use std::fmt;

use xxhash_rust::xxh3::Xxh3;

use crate::llama::Token;

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrefixKey(u128);

impl fmt::Debug for PrefixKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PrefixKey({:032x})", self.0)
    }
}

impl fmt::Display for PrefixKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// How attention and positions are applied to the history.
pub const ATTENTION_RULE: &str = "causal/1d-positions";

impl PrefixKey {
    /// The key of a history's prompt prefix (version 0).
    pub fn root(model_identity: &str, prompt: &[Token]) -> PrefixKey {
        let mut h = Xxh3::new();
        h.update(b"gst-vlm prefix v1\0");
        h.update(model_identity.as_bytes());
        h.update(b"\0");
        h.update(ATTENTION_RULE.as_bytes());
        h.update(b"\0");
        for t in prompt {
            h.update(&t.to_le_bytes());
        }
        PrefixKey(h.digest128())
    }

    /// The key of this history followed by committed text.
    pub fn then_text(self, tokens: &[Token]) -> PrefixKey {
        let mut h = Xxh3::new();
        h.update(&self.0.to_le_bytes());
        h.update(b"text");
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        PrefixKey(h.digest128())
    }

    /// The key of this history followed by a frame.
    pub fn then_frame(self, content_hash: u64, n_pos: i32) -> PrefixKey {
        let mut h = Xxh3::new();
        h.update(&self.0.to_le_bytes());
        h.update(b"frame");
        h.update(&content_hash.to_le_bytes());
        h.update(&n_pos.to_le_bytes());
        PrefixKey(h.digest128())
    }
}

/// Which engines can consume a stored representation of a prefix.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CompatTag {
    /// The model whose KV it is.
    pub model: String,
    /// `cpu`, `gpu`: llama.cpp serialises a sequence's state in a backend-neutral form, so the
    /// backend is recorded but does not decide compatibility.
    pub backend: String,
    pub kv_dtype: &'static str,
    /// KV layout: V transposed or not (flash attention off or on), and the number of per-sequence
    /// KV streams (llama.cpp refuses a snapshot from a context with another count).
    pub layout: String,
}

impl CompatTag {
    /// Why a snapshot tagged `self` cannot be imported by an engine tagged `target`.
    pub fn incompatibility(&self, target: &CompatTag) -> Option<String> {
        if self.model != target.model {
            return Some(format!("snapshot of model {} cannot feed model {}", self.model, target.model));
        }
        if self.kv_dtype != target.kv_dtype {
            return Some(format!("KV dtype {} differs from the target's {}", self.kv_dtype, target.kv_dtype));
        }
        if self.layout != target.layout {
            return Some(format!("KV layout \"{}\" differs from the target's \"{}\"", self.layout, target.layout));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_frame_after_a_different_history_is_a_different_prefix() {
        let root = PrefixKey::root("model", &[1, 2, 3]);
        let (a, b, c) = (11, 22, 33);
        let sys_a_b = root.then_frame(a, 36).then_frame(b, 36);
        let sys_c_b = root.then_frame(c, 36).then_frame(b, 36);
        assert_ne!(sys_a_b, sys_c_b);
        assert_eq!(sys_a_b, PrefixKey::root("model", &[1, 2, 3]).then_frame(a, 36).then_frame(b, 36));
        assert_ne!(root.then_frame(a, 36), root.then_frame(a, 64), "positions are part of identity");
        assert_ne!(
            PrefixKey::root("model", &[1, 2]).then_frame(a, 36),
            root.then_frame(a, 36),
            "the prompt is part of identity"
        );
        assert_ne!(PrefixKey::root("other", &[1, 2, 3]), root, "the model is part of identity");
    }
}
