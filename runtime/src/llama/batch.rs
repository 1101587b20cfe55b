//! A llama.cpp batch of tokens or embedding rows.

use llama_cpp_sys_2 as sys;

use super::Token;

/// A llama.cpp batch this side owns: either tokens or embedding rows, each entry with its
/// position, its sequences (one, or up to `seqs` for [`Batch::push_shared_token`]) and whether
/// its logits are kept. Invariant: the first `n` entries of every array are filled,
/// `n <= capacity`, and rows are `width` floats.
pub struct Batch {
    pub(super) raw: sys::llama_batch,
    capacity: usize,
    /// Floats per row (0: a token batch).
    pub(super) width: usize,
    /// Sequence ids an entry has room for.
    seqs: usize,
    n: usize,
}

impl Batch {
    /// A batch of at most `capacity` tokens.
    pub fn tokens(capacity: usize) -> Batch {
        Batch::init(capacity, 0, 1)
    }

    /// A batch of at most `capacity` tokens, each in up to `seqs` sequences.
    pub fn shared_tokens(capacity: usize, seqs: usize) -> Batch {
        Batch::init(capacity, 0, seqs)
    }

    /// A batch of at most `capacity` embedding rows of `width` floats.
    pub fn embeddings(capacity: usize, width: usize) -> Batch {
        Batch::init(capacity, width, 1)
    }

    /// A batch of at most `capacity` embedding rows of `width` floats: `spare` emptied where it
    /// is one with room for them, else a new one with room for `room` rows (an engine keeps one
    /// for its frames' rows instead of allocating MiBs for every chunk).
    pub fn reusing(spare: Option<Batch>, capacity: usize, room: usize, width: usize) -> Batch {
        match spare {
            Some(mut b) if b.width == width && b.seqs == 1 && b.capacity >= capacity => {
                b.n = 0;
                b.raw.n_tokens = 0;
                b
            }
            _ => Batch::embeddings(capacity.max(room), width),
        }
    }

    fn init(capacity: usize, width: usize, seqs: usize) -> Batch {
        let (capacity, seqs) = (capacity.max(1), seqs.max(1));
        // SAFETY: llama_batch_init allocates arrays for `capacity` entries with room for `seqs`
        // sequence ids each (and `width` floats per entry when width > 0); freed in Drop.
        let raw = unsafe { sys::llama_batch_init(capacity as i32, width as i32, seqs as i32) };
        Batch { raw, capacity, width, seqs, n: 0 }
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// (position, sequence) of the first entry.
    pub(super) fn first(&self) -> (i32, i32) {
        if self.n == 0 {
            return (0, 0);
        }
        // SAFETY: entry 0 is filled (n > 0).
        unsafe { (*self.raw.pos, **self.raw.seq_id) }
    }

    fn push_meta(&mut self, pos: i32, seqs: &[i32], logits: bool) {
        assert!(!seqs.is_empty() && seqs.len() <= self.seqs, "an entry has 1 to {} sequences", self.seqs);
        let j = self.n;
        // SAFETY: j < capacity (checked by the callers' asserts); the arrays have `capacity`
        // entries and seq_id[j] points at room for `self.seqs` ids (checked above).
        unsafe {
            *self.raw.pos.add(j) = pos;
            *self.raw.n_seq_id.add(j) = seqs.len() as i32;
            std::ptr::copy_nonoverlapping(seqs.as_ptr(), *self.raw.seq_id.add(j), seqs.len());
            *self.raw.logits.add(j) = logits as i8;
        }
        self.n += 1;
        self.raw.n_tokens = self.n as i32;
    }

    pub fn push_token(&mut self, token: Token, pos: i32, seq: i32, logits: bool) {
        self.push_shared_token(token, pos, &[seq], logits);
    }

    /// A token that goes into every sequence of `seqs` (one cell they all hold, in a unified
    /// KV pool): sequences that agree up to here decode it once.
    pub fn push_shared_token(&mut self, token: Token, pos: i32, seqs: &[i32], logits: bool) {
        assert!(self.width == 0 && self.n < self.capacity, "token batch full or not a token batch");
        // SAFETY: token batch with n < capacity entries.
        unsafe { *self.raw.token.add(self.n) = token };
        self.push_meta(pos, seqs, logits);
    }

    pub fn push_row(&mut self, row: &[f32], pos: i32, seq: i32, logits: bool) {
        assert!(self.width > 0 && row.len() == self.width && self.n < self.capacity, "bad embedding row");
        // SAFETY: the embd array holds capacity*width floats; row n starts at n*width and the
        // source has exactly width floats.
        unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), self.raw.embd.add(self.n * self.width), self.width) };
        self.push_meta(pos, &[seq], logits);
    }
}

// SAFETY: a batch owns its arrays alone (llama_batch_init allocated them, Drop frees them, no
// other handle points at them) and llama.cpp keeps no thread-local state about them: it may move
// to the engine thread that keeps it.
unsafe impl Send for Batch {}

impl Drop for Batch {
    fn drop(&mut self) {
        // SAFETY: allocated by llama_batch_init, freed once.
        unsafe { sys::llama_batch_free(self.raw) }
    }
}

#[cfg(test)]
mod tests {
    use super::Batch;

    /// A spare batch with room is emptied and kept (its rows' memory is not allocated again);
    /// one too small, of another width or of tokens is not.
    #[test]
    fn a_spare_batch_with_room_is_reused_and_another_is_not() {
        let mut spare = Batch::reusing(None, 2, 8, 4);
        assert_eq!(spare.capacity, 8, "room for the rows a chunk may take");
        spare.push_row(&[1.0; 4], 0, 0, false);
        let embd = spare.raw.embd;
        let reused = Batch::reusing(Some(spare), 8, 8, 4);
        assert!(reused.is_empty() && reused.raw.n_tokens == 0 && reused.raw.embd == embd);
        let larger = Batch::reusing(Some(reused), 9, 8, 4);
        assert_eq!(larger.capacity, 9);
        let wider = Batch::reusing(Some(larger), 2, 8, 5);
        assert_eq!(wider.width, 5);
        assert_eq!(Batch::reusing(Some(Batch::tokens(8)), 2, 8, 4).width, 4);
    }
}
