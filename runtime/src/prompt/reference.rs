//! The plain-libmtmd reference of the family checks ([`Reference`], feature `reference`) on the
//! runtime's own prompt: the reference renders whatever system prompt it is given
//! ([`reference::prompt`](crate::llama::reference::prompt)); these methods give it
//! [`DEFAULT_SYSTEM_PROMPT`] from here, above `llama`, so that `llama` reads nothing built on it.

use super::DEFAULT_SYSTEM_PROMPT;
use crate::error::Result;
use crate::llama::Model;
use crate::llama::reference::{Chunks, Reference, pictures, prompt};

impl Reference {
    /// libmtmd's tokenization of the history of the runtime's [`prompt`] (its text up to the last
    /// frame's marker) with pictures `0..frames`.
    pub fn history(&self, model: &Model, frames: usize, question: &str) -> Result<Chunks> {
        let (text, end) = prompt(model, DEFAULT_SYSTEM_PROMPT, frames, question)?;
        self.chunks(&text[..end], &pictures(frames))
    }

    /// libmtmd's tokenization of the whole of the runtime's [`prompt`] (the question and the
    /// assistant's opened turn included) with pictures `0..frames`.
    pub fn whole(&self, model: &Model, frames: usize, question: &str) -> Result<Chunks> {
        let (text, _) = prompt(model, DEFAULT_SYSTEM_PROMPT, frames, question)?;
        self.chunks(&text, &pictures(frames))
    }
}
