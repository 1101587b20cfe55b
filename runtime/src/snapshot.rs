//! KV snapshots: a sequence's exported state with what it represents (prefix key) and who can
//! consume it (compatibility tag), kept in a bounded exact-match cache of complete prefixes.

use crate::cache::{BoundedCache, Weighted};
use crate::prefix::{CompatTag, PrefixKey};

pub struct Snapshot {
    pub key: PrefixKey,
    pub tag: CompatTag,
    /// `llama_state_seq_get_data` output.
    pub bytes: Vec<u8>,
    /// First free position after the prefix.
    pub end: i32,
}

impl Weighted for Snapshot {
    fn bytes(&self) -> usize {
        self.bytes.len()
    }
}

/// Exact-match cache of complete prefixes: a stream whose history so far equals a cached one
/// imports its KV instead of prefilling.
pub type PrefixCache = BoundedCache<(PrefixKey, CompatTag), Snapshot>;
