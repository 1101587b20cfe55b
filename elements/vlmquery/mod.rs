//! SECTION:element-vlmquery
//! @see_also: vlmencode, vlmcontext
//!
//! `vlmquery` answers questions about a stream from the version of its history each question
//! is bound to, and pushes every answer on its `src` pad as `text/x-raw, format=utf8`. The video
//! leaves unchanged on `video_src` (dropped while that pad is not linked), so `textoverlay` can
//! draw the answers with its default settings and no `tee`. Questions arrive as
//!
//! - a serialized custom downstream event `vlm-question` in the video stream (`text`, required;
//!   `id` and `max-tokens`, optional), bound to the frames before it;
//! - the action signal `ask` (text; returns the question id, or NULL when refused), bound to the
//!   newest registered frame;
//! - text buffers on the `query` pad (`utf8`, or `pango-markup` as `subparse` emits it, tags
//!   stripped), one question per buffer, bound to the frames whose running time is at or before
//!   the buffer's, waiting for the video to get there;
//! - `caption-prompt`, asked automatically about the newest frame every `caption-interval` of
//!   running time (periodic captions, same outputs).
//!
//! Each question is answered at once on its own thread, from a private branch of its version
//! (greedy by default); a question whose frame is registered but not yet prefilled waits for it
//! (with several engines the placer may instead replay that history on another engine).
//! Answers are pushed in question order, each timestamped at the end of the newest video frame
//! when it is pushed, with `answer-duration` as its duration; while there is nothing to say the text pad
//! sends GAP events up to the newest frame, so overlays and sinks never wait and a non-live
//! pipeline prerolls at once. `output-format=text` pushes each answered text and a newline (fit
//! for `filesink`); `json` pushes one object a line with the `vlm-answer` fields, every outcome
//! included. With `stream-tokens=true` the oldest pending answer's text goes out as it is
//! generated (live captions): text mode pushes the pieces and then the newline, json mode one
//! object per piece with `status` `partial`, then the whole answer. Every text buffer carries a
//! custom meta `VlmAnswerMeta` (`id`, `stream`, `status`: `answered`, `cancelled`, `failed` or
//! `partial`; `gst_buffer_get_custom_meta (buffer, "VlmAnswerMeta")`). EOS leaves after the last
//! accepted question's answer; with `src` unlinked (answers read from the bus), `video_src`'s EOS
//! waits for it too. With both linked (textoverlay), the video ends when it ends, and answers
//! still being generated then are cancelled.
//!
//! A question is refused at once, with a WARNING naming the cause, after EOS or when its `id`
//! was already used; `ask` and `vlm-question` events are also refused (`ask` returns NULL) while
//! flushing, before the element starts, or when `max-questions` are pending (`ask` also for
//! empty text), where the `query` pad blocks instead (the video's own thread never waits for
//! answers, which an overlay may hold until the video passes their time). A malformed `vlm-question` (no `text`, a `max-tokens` that is not a positive
//! integer) is a WARNING.
//!
//! ## Example pipelines
//!
//! Timed questions from a subtitle file, answers on the bus (`-m`):
//!
//! ```sh
//! gst-launch-1.0 -m videotestsrc num-buffers=150 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf \
//!     ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery name=q max-tokens=16 ! fakesink \
//!     filesrc location=pipelines/questions.srt ! subparse ! q.query
//! ```
//!
//! Answers drawn on the video (`autovideosink` falls back to a fake sink without a display). The
//! pipeline ends with the video, cancelling questions still being answered, so the video here
//! runs past the last question (9.5 s) by more than its answer takes:
//!
//! ```sh
//! gst-launch-1.0 videotestsrc num-buffers=450 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf \
//!     ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery name=q max-tokens=16 \
//!     q.video_src ! textoverlay name=o ! videoconvert ! autovideosink \
//!     q.src ! o.text_sink  filesrc location=pipelines/questions.srt ! subparse ! q.query
//! ```
//!
//! Live captions on stdout, each streamed as it is generated:
//!
//! ```sh
//! gst-launch-1.0 -q videotestsrc is-live=true num-buffers=90 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf \
//!     ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
//!     ! vlmquery caption-prompt="Describe the scene." caption-interval=1000000000 max-tokens=12 stream-tokens=true ! fdsink
//! ```
//!
//! Periodic captions, one JSON line each, into a file:
//!
//! ```sh
//! gst-launch-1.0 videotestsrc num-buffers=90 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf \
//!     ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
//!     ! vlmquery caption-prompt="Describe the scene." caption-interval=1000000000 max-tokens=12 output-format=json \
//!     ! filesink location=answers.jsonl
//! ```
//!
//! From an application (Rust, or `emit("ask", ...)` from Python), and a question event sent
//! into the stream (`examples/ask.rs`, `examples/ask.py`):
//!
//! ```text
//! let id = vlmquery.emit_by_name::<Option<String>>("ask", &[&"What is on the table?"]);
//! let s = gst::Structure::builder("vlm-question").field("text", "Is the door open?").field("id", "door").build();
//! vlmquery.static_pad("sink").unwrap().send_event(gst::event::CustomDownstream::new(s));
//! ```
//!
//! ## Messages
//!
//! Every accepted question ends in exactly one element message `vlm-answer`: `id`, `question`,
//! `text`, `status` (`answered`; `cancelled` by a flush or stop, or `failed`, both with a
//! `reason`), `stream`, `frames` (history length of the bound version), `frame` (its newest
//! frame), `history-cells` (KV cells of its history after the prompt: frames and committed
//! answers; answered questions only), `engine`, `path` (`resident`, `import` or `replay`), `ttft-ms` and `wait-ms` (from the
//! question's arrival), `queue-ms`, `prepare-ms`, `tokens`, `total-ms`, `estimate-ms` (the
//! placer's, -1 when none), `lag-frames` and `lag-ms` (the stream's ingestion lag when the
//! question arrived), `pts`. A failed question also posts a WARNING.
//!
//! ## Properties
//!
//! - `placement` (`auto`): the placer decides, or an engine's name forces it.
//! - `max-tokens` (1-4096, 64): most tokens per answer (a question event's `max-tokens`
//!   overrides it). `exact-tokens` (false): generate exactly `max-tokens` (measurements).
//! - `stream-tokens` (false): push each answer's text as it is generated.
//! - `output-format` (`text`/`json`, `text`); `answer-duration` (ns, 5000000000).
//! - `caption-prompt` (empty = off); `caption-interval` (ns, 10000000000; 0 = every frame that
//!   joins the history). A caption that finds `max-questions` pending is skipped.
//! - `max-questions` (1-1024, 16): questions pending at once.
//! - `commit-answers` (`none`/`ordered`, `none`): with `ordered`, each question and its answer
//!   join the stream's history in question order, so later questions see the conversation.
//! - `temp` (0 = greedy), `seed` (0), `top-k` (40), `top-p` (0.95), `min-p` (0.05).
//! - Read-only: `answers` (answer buffers pushed).
//!
//! Debug category: `vlmquery`.

use gst::glib;
use gst::prelude::*;

mod imp;

glib::wrapper! {
    pub struct VlmQuery(ObjectSubclass<imp::VlmQuery>) @extends gst::Element, gst::Object;
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    // The debug category exists from plugin load on (`gst-launch-1.0 --gst-debug-help` lists it).
    std::sync::LazyLock::force(&imp::CAT);
    gst::Element::register(Some(plugin), "vlmquery", gst::Rank::NONE, VlmQuery::static_type())
}
