//! gst-vlm's runtime: everything heavy, with no GStreamer types, so it is unit-tested without a
//! pipeline and benchmarked on machines without GStreamer.
//!
//! - [`llama`]: the safe layer over llama.cpp / libmtmd (all `unsafe` lives there);
//! - [`models`]: one shared copy of each model's weights per device per process;
//! - [`engine`]: a language engine (one context, one thread, several sequences) and its step
//!   scheduler; `prefill`: chunked prefill of frames, replays and questions;
//! - [`stream`]: a stream's versioned, append-only history ([`entry`]: its entries);
//! - [`alert`]: standing yes/no questions evaluated on every new version (forced choice,
//!   hysteresis);
//! - [`answer`](mod@answer): answering a question from a pinned version (branch, import or replay);
//!   [`commits`]: answers committed to the history in question order;
//! - [`placer`]: choosing the engine and path of each answer from measured stage costs;
//!   [`residence`]: the engine each stream lives on;
//! - [`prefix`]: prefix keys and compatibility tags; [`snapshot`]: KV snapshots;
//! - [`cache`]: the bounded cache every cache uses;
//! - [`encoder`]: vision encoding of frames into embeddings (libmtmd; `rknn`: the NPU);
//! - [`prompt`]: the chat layout of histories and questions; [`text`]: streaming UTF-8;
//! - `threads`: how many threads an engine computes with, measured and revised while it runs.

pub mod alert;
pub mod answer;
pub mod cache;
pub mod commits;
pub mod encoder;
pub mod engine;
pub mod engine_spec;
pub mod entry;
pub mod error;
pub mod llama;
pub mod models;
pub mod placer;
mod prefill;
pub mod prefix;
pub mod prompt;
pub mod residence;
#[cfg(feature = "rknn")]
pub use encoder::rknn;
pub mod snapshot;
pub mod stream;
pub mod text;
mod threads;

pub use answer::{AnswerReport, Question, Sampling, answer, answer_frame, answer_on, answer_placed};
pub use commits::CommitTurn;
pub use engine::{DecodeRates, Engine, EngineConfig, KvLayout, KvMemory, TimeSplit};
pub use error::{Error, Result};
pub use llama::{Device, Gpu, KvType};
pub use placer::PreparePath;
pub use stream::{
    DEFAULT_ANSWER_RESERVE, DEFAULT_SLIDE_WAIT, Frame, HistoryPolicy, Lag, Overload, RebuildListener, Registration,
    Stream, StreamConfig, Version, Watch,
};
