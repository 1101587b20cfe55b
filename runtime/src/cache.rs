//! A bounded cache: an entry limit and a byte limit; the least recently used entry that nobody
//! else holds is evicted first, an entry a reader holds never is; storage lives until its last
//! reader drops it (entries are `Arc`s).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;

use parking_lot::Mutex;

/// Something whose size counts against a cache's byte limit.
pub trait Weighted {
    fn bytes(&self) -> usize;
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub entries: usize,
    pub bytes: usize,
    pub hits: u64,
    /// Every lookup that found nothing, the first one of a session included.
    pub misses: u64,
    pub evictions: u64,
    /// Insertions refused because the entry could not fit without evicting held entries.
    pub refused: u64,
}

struct Inner<K, V> {
    map: HashMap<K, (Arc<V>, u64)>,
    clock: u64,
    stats: CacheStats,
}

pub struct BoundedCache<K, V> {
    max_entries: usize,
    max_bytes: usize,
    inner: Mutex<Inner<K, V>>,
}

impl<K, V> std::fmt::Debug for BoundedCache<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundedCache")
            .field("max_entries", &self.max_entries)
            .field("max_bytes", &self.max_bytes)
            .field("stats", &self.inner.lock().stats)
            .finish()
    }
}

impl<K: Eq + Hash + Clone, V: Weighted> BoundedCache<K, V> {
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        BoundedCache {
            max_entries,
            max_bytes,
            inner: Mutex::new(Inner { map: HashMap::new(), clock: 0, stats: CacheStats::default() }),
        }
    }

    /// (entry limit, byte limit)
    pub fn limits(&self) -> (usize, usize) {
        (self.max_entries, self.max_bytes)
    }

    pub fn enabled(&self) -> bool {
        self.max_entries > 0 && self.max_bytes > 0
    }

    /// The entry of `key` (now the most recently used), counted as a hit or a miss.
    pub fn get(&self, key: &K) -> Option<Arc<V>> {
        let found = self.peek(key);
        let mut inner = self.inner.lock();
        match found {
            Some(_) => inner.stats.hits += 1,
            None => inner.stats.misses += 1,
        }
        found
    }

    /// [`BoundedCache::get`] without counting it: a lookup that is not what the statistics
    /// count (a question's, where they count frames).
    pub fn peek(&self, key: &K) -> Option<Arc<V>> {
        let mut inner = self.inner.lock();
        inner.clock += 1;
        let clock = inner.clock;
        let (v, used) = inner.map.get_mut(key)?;
        *used = clock;
        Some(Arc::clone(v))
    }

    /// Whether an entry of `size` bytes can be cached at all; `false` counts as a refused
    /// insert. (For a caller whose entry is dear to build: a KV export checks its size first.)
    pub fn admits(&self, size: usize) -> bool {
        let admits = size <= self.max_bytes && self.max_entries > 0;
        if !admits {
            self.inner.lock().stats.refused += 1;
        }
        admits
    }

    /// Insert `value` (replacing an entry of the same key), evicting unheld entries, least
    /// recently used first, until both limits hold. Returns false, caching nothing, when that is
    /// impossible without evicting an entry somebody holds.
    pub fn insert(&self, key: K, value: Arc<V>) -> bool {
        let size = value.bytes();
        let mut inner = self.inner.lock();
        if size > self.max_bytes || self.max_entries == 0 {
            inner.stats.refused += 1;
            return false;
        }
        // An entry under the same key is replaced, but only once the new one is known to fit:
        // a refused insert leaves it.
        let replaced = inner.map.get(&key).map(|(old, _)| old.bytes());
        // Unheld entries, least recently used first.
        let mut candidates: Vec<(u64, K)> = inner
            .map
            .iter()
            .filter(|(k, (v, _))| Arc::strong_count(v) == 1 && **k != key)
            .map(|(k, (_, used))| (*used, k.clone()))
            .collect();
        candidates.sort_by_key(|(used, _)| *used);
        let over = |s: &CacheStats| s.entries + 1 > self.max_entries || s.bytes + size > self.max_bytes;
        let (mut entries, mut bytes) = (inner.stats.entries, inner.stats.bytes);
        if let Some(old) = replaced {
            entries -= 1;
            bytes -= old;
        }
        let mut evict = vec![];
        for (_, k) in candidates {
            if !over(&CacheStats { entries, bytes, ..CacheStats::default() }) {
                break;
            }
            bytes -= inner.map[&k].0.bytes();
            entries -= 1;
            evict.push(k);
        }
        if over(&CacheStats { entries, bytes, ..CacheStats::default() }) {
            inner.stats.refused += 1;
            return false;
        }
        for k in evict {
            inner.map.remove(&k);
            inner.stats.evictions += 1;
        }
        inner.clock += 1;
        let clock = inner.clock;
        inner.map.insert(key, (value, clock));
        inner.stats.entries = entries + 1;
        inner.stats.bytes = bytes + size;
        true
    }

    pub fn stats(&self) -> CacheStats {
        self.inner.lock().stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Blob(usize);
    impl Weighted for Blob {
        fn bytes(&self) -> usize {
            self.0
        }
    }

    #[test]
    fn both_limits_hold_and_the_least_recently_used_goes_first() {
        let cache = BoundedCache::new(3, 100);
        for k in 0..3 {
            assert!(cache.insert(k, Arc::new(Blob(10))));
        }
        assert!(cache.get(&0).is_some()); // 1 is now the least recently used
        assert!(cache.insert(3, Arc::new(Blob(10))));
        assert!(cache.get(&1).is_none(), "entry limit: the LRU entry is evicted");
        assert!(cache.get(&0).is_some() && cache.get(&2).is_some() && cache.get(&3).is_some());
        assert!(cache.insert(4, Arc::new(Blob(75))));
        let s = cache.stats();
        assert!(s.entries <= 3 && s.bytes <= 100, "{s:?}");
        assert!(!cache.insert(5, Arc::new(Blob(101))), "larger than the byte limit");
        assert_eq!(s.misses, 1);
    }

    /// An entry too large to cache is told before it is built, and counted as refused.
    #[test]
    fn an_entry_over_the_byte_limit_is_not_admitted() {
        let cache: BoundedCache<u32, Blob> = BoundedCache::new(3, 100);
        assert!(cache.admits(100));
        assert!(!cache.admits(101));
        assert_eq!(cache.stats().refused, 1);
        assert!(!BoundedCache::<u32, Blob>::new(0, 100).admits(1), "no entries at all");
    }

    /// A new value for a key that does not fit (only held entries could make room) is refused
    /// and the key's old value stays (it was dropped first); one that fits replaces it.
    #[test]
    fn a_refused_replacement_keeps_the_old_value() {
        let cache = BoundedCache::new(2, 100);
        assert!(cache.insert("a", Arc::new(Blob(40))));
        assert!(cache.insert("b", Arc::new(Blob(50))));
        let _held = cache.get(&"b").unwrap();
        assert!(!cache.insert("a", Arc::new(Blob(60))));
        assert_eq!(cache.get(&"a").map(|a| a.0), Some(40));
        assert_eq!((cache.stats().entries, cache.stats().bytes), (2, 90));
        assert!(cache.insert("a", Arc::new(Blob(45))));
        assert_eq!(cache.get(&"a").map(|a| a.0), Some(45));
        assert_eq!((cache.stats().entries, cache.stats().bytes), (2, 95));
    }

    #[test]
    fn an_entry_a_reader_holds_is_never_evicted_and_lives_until_released() {
        let cache = BoundedCache::new(2, 100);
        assert!(cache.insert("a", Arc::new(Blob(60))));
        let held = cache.get(&"a").unwrap();
        assert!(!cache.insert("b", Arc::new(Blob(60))), "only the held entry could make room: refuse");
        assert!(cache.get(&"a").is_some());
        assert_eq!(cache.stats().refused, 1);
        drop(held);
        assert!(cache.insert("b", Arc::new(Blob(60))), "released: now it can go");
        assert!(cache.get(&"a").is_none());
        // Evicted storage stays alive for a reader that still holds it.
        let b = cache.get(&"b").unwrap();
        let weak = Arc::downgrade(&b);
        drop(b);
        assert!(cache.insert("c", Arc::new(Blob(60))));
        assert!(weak.upgrade().is_none(), "unheld evicted storage is freed");
        let c = cache.get(&"c").unwrap();
        let weak = Arc::downgrade(&c);
        assert!(!cache.insert("d", Arc::new(Blob(60))));
        assert!(weak.upgrade().is_some());
        drop(c);
    }
}
