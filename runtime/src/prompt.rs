//! How a stream's history and a question are laid out in the model's chat template.
//!
//! The history is the start of one user turn holding the frames; a question closes that turn and
//! opens the assistant's:
//!
//! ```text
//! [system + "user:" prefix] [frame 1] [frame 2] ... | [question suffix: text + "assistant:"]
//! ```
//!
//! Frames only ever append, so every version is a prefix of the next one. The layout is derived
//! from the model's own template by rendering sentinels and splitting on them.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::llama::{Model, Token};

// The family checks' reference (`llama::reference`) with the runtime's system prompt.
#[cfg(feature = "reference")]
mod reference;

const FRAMES: &str = "\u{1}FRAMES\u{1}";
const QUESTION: &str = "\u{1}QUESTION\u{1}";
const ANSWER: &str = "\u{1}ANSWER\u{1}";
const NEXT: &str = "\u{1}NEXT\u{1}";

pub const DEFAULT_SYSTEM_PROMPT: &str =
    "You are a helpful assistant watching a live video. Answer questions about it briefly.";

#[derive(Debug, Clone)]
pub struct Prompt {
    /// Tokens before the first frame (version 0 of every stream).
    pub prefix: Arc<[Token]>,
    between: Vec<Token>,
    after: Vec<Token>,
    /// After a committed answer: the end of the assistant's turn and the start of the next
    /// user turn, where later frames go.
    pub reopen: Vec<Token>,
}

impl Prompt {
    pub fn new(model: &Model, system: &str) -> Result<Prompt> {
        let rendered =
            model.apply_chat_template(&[("system", system), ("user", &format!("{FRAMES}\n{QUESTION}"))], true)?;
        let (f, q) = match (rendered.find(FRAMES), rendered.find(QUESTION)) {
            (Some(f), Some(q)) if f < q => (f, q),
            _ => {
                return Err(Error::Config("the model's chat template does not keep the user's text in order".into()));
            }
        };
        let conversation = model.apply_chat_template(
            &[("system", system), ("user", &format!("{FRAMES}\n{QUESTION}")), ("assistant", ANSWER), ("user", NEXT)],
            false,
        )?;
        let reopen = match (conversation.find(ANSWER), conversation.find(NEXT)) {
            (Some(a), Some(n)) if a < n => &conversation[a + ANSWER.len()..n],
            _ => return Err(Error::Config("the model's chat template does not keep a conversation in order".into())),
        };
        Ok(Prompt {
            prefix: model.tokenize(&rendered[..f], true, true)?.into(),
            between: model.tokenize(&rendered[f + FRAMES.len()..q], false, true)?,
            after: model.tokenize(&rendered[q + QUESTION.len()..], false, true)?,
            reopen: model.tokenize(reopen, false, true)?,
        })
    }

    /// The tokens that follow a version's history for `question`. The question's own text is
    /// tokenized without special-token parsing, so it cannot close the turn itself.
    pub fn question_tokens(&self, model: &Model, question: &str) -> Result<Vec<Token>> {
        let mut tokens = self.between.clone();
        tokens.extend(model.tokenize(question, false, false)?);
        tokens.extend_from_slice(&self.after);
        Ok(tokens)
    }
}
