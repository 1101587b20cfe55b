//! The runtime's error type: every failure carries what a user needs to fix it.

use std::path::PathBuf;

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A file named by a setting cannot be used.
    #[error("{}: {reason}", path.display())]
    File { path: PathBuf, reason: String },
    /// A setting is missing or inconsistent.
    #[error("{0}")]
    Config(String),
    /// An input (question, frame, caps) cannot be processed.
    #[error("{0}")]
    BadInput(String),
    /// llama.cpp / libmtmd reported a failure.
    #[error("{0}")]
    Engine(String),
    /// The stream's history has no room for another frame: `frames` frames fill `used` of the
    /// sequence's `cells` KV cells (one per text token and embedding row; the rest is reserved
    /// for a question and its answer).
    #[error(
        "history full: {frames} frames fill {used} of the {cells} KV cells of the stream's sequence (the rest is kept for answers)"
    )]
    HistoryFull { frames: u64, used: u32, cells: u32 },
    /// One entry (a frame, a committed answer) is larger than a history may be: `cells` KV cells
    /// where the stream's sequence leaves `room` after its prompt and the answers' reserve.
    #[error(
        "an entry of {cells} KV cells does not fit the {room} cells a history of the stream's sequence may take after its prompt"
    )]
    EntryTooLarge { cells: u32, room: u32 },
    /// The unified KV pool has no free cells for a decode now (answers holding cells free them
    /// as they end).
    #[error("{0}")]
    PoolFull(String),
    /// A stored state cannot be consumed by the target engine.
    #[error("incompatible snapshot: {0}")]
    Incompatible(String),
    /// The work was cancelled (flush, stop) before it finished.
    #[error("cancelled")]
    Cancelled,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The message a caught panic carries (`panic!` with a literal or a formatted string).
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}
