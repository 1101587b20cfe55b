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
//!   the buffer's, waiting for the video to get there (meanwhile the stream's frames are
//!   encoded and prefilled before other streams', through its demand: `vlm-demand`);
//! - `caption-prompt`, asked automatically about the newest frame every `caption-interval` of
//!   running time (periodic captions, same outputs).
//!
//! Each question is answered at once on its own thread, from a private branch of its version
//! (greedy by default); a question whose frame is registered but not yet prefilled waits for it
//! (with several engines the placer may instead replay that history on another engine).
//! Nothing is answered from no frames: a question that finds its stream with no registered frame
//! yet (a video with no frame so far, a timed question before the first frame, `ask` before any
//! video reached the element or while the model loads) waits for the stream's first registered
//! frame and binds to the newest one then. It holds its `max-questions` slot meanwhile, a flush
//! or stop cancels it, and at the video's EOS with still no frame it ends `failed` with the
//! `reason` "the video ended before any frame was registered".
//! Each question's `vlm-answer` message is posted as soon as its answer has ended (in question
//! order), and its text is pushed in question order, timestamped at the end of the newest video
//! frame (the first frame that can show it), lasting `answer-duration`; while there is nothing to
//! say the text pad sends GAP events up to the newest frame, so overlays and sinks never wait and
//! a non-live pipeline prerolls at once. `output-format=text` pushes each answered text as exactly
//! one line (fit for `filesink`): line breaks inside an answer are folded, each run of them (with
//! the spaces and tabs around it) becoming one space, the line trimmed, so N answers are N lines
//! (the `vlm-answer` message and JSON keep the text as generated); `json` pushes one object a
//! line with the `vlm-answer` fields, every outcome included.
//!
//! With `stream-tokens=true` the oldest pending answer goes out as it is generated (live
//! captions), later ones follow in question order: every buffer holds the answer so far (text: a
//! line, folded the same way; json: an object with `id`, `stream`, `status` `partial` and
//! `text`, the answer so far),
//! the last one the whole answer (its `vlm-answer` line in json), so a lost piece loses nothing
//! and an overlay shows the growing answer.
//!
//! Drawn on the video (text output with `video_src` linked, e.g. into `textoverlay`, which holds
//! one text buffer until the video passes its end), the text pad follows the video: what is shown
//! goes out one buffer per frame, each ending where that frame ends (the answer so far while it
//! streams, then the whole answer until `answer-duration` has passed), so no piece or answer is
//! held behind another one's display. `display` decides what crowded answers do there: `replace`
//! (the default: a live view wants the newest answer, so a newer answer replaces the one on
//! screen as soon as it comes) or `queue` (each answer is one buffer and keeps its whole
//! `answer-duration`; a newer one waits behind it). Elsewhere (json, or `video_src` unlinked)
//! each answer is one buffer and each streamed piece one buffer without a duration.
//!
//! `subtitle_src`, for recorders, carries one cue per answered question whatever `display`
//! says: the answer's text as one line, from the end of the newest frame when the answer ended
//! for `answer-duration`, and GAP events up to the newest frame between cues, so a muxer never
//! waits (`q.subtitle_src ! mux.subtitle_0`); its own task pushes them, so a text pad held by an
//! overlay never holds the recorder.
//!
//! Every text buffer carries a custom meta `VlmAnswerMeta` (`id`, `stream`, `status`: `answered`,
//! `cancelled`, `failed` or `partial`; `gst_buffer_get_custom_meta (buffer, "VlmAnswerMeta")`).
//! The answers also ride on the video: each answered or failed question's answer is attached to
//! the first buffer leaving `video_src` after its `vlm-answer` (one answer per buffer, in question
//! order) as a `VlmAnswerMeta` with `id`, `stream`, `status`, `text` and, unless answered with
//! text, `reason` (Python: `buffer.get_custom_meta("VlmAnswerMeta").get_structure()`), for
//! recorders and message brokers. EOS leaves the text pad after the last accepted question's
//! answer; the video's EOS waits until every accepted question has its `vlm-answer` on the bus
//! (with `src` unlinked, until its answer is through), so a pipeline that ends with the video
//! (textoverlay) ends after its last answer, which is answered, not cancelled.
//!
//! A question is refused at once, with a WARNING naming the cause, after EOS or when its `id`
//! was already used; `ask` and `vlm-question` events are also refused (`ask` returns NULL) while
//! flushing, before the element starts, or when `max-questions` are pending (`ask` also for
//! empty text), where the `query` pad blocks instead (the video's own thread never waits for
//! room, which an overlay may give only once the video passes an answer's time). A question
//! timed ahead of the video waits inside the element (up to 4,096 questions or 4 MiB of text:
//! an hour of subtitles, one a second) and is accepted once the video has passed its time and
//! a `max-questions` slot is free (at the video's EOS, bound to the last frame); the `query` pad
//! does not wait for the video, so a forced EOS (`gst-launch-1.0 -e`, Ctrl-C) reaches the
//! camera whatever the order of the sources (beyond that queue the pad waits, as textoverlay's
//! text pad waits with one subtitle ahead). A malformed `vlm-question` (no `text`, a
//! `max-tokens` that is not a positive integer) is a WARNING.
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
//! Answers drawn on the video, streamed as they are generated (`autovideosink` falls back to a
//! fake sink without a display):
//!
//! ```sh
//! gst-launch-1.0 videotestsrc num-buffers=450 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf \
//!     ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf ! vlmquery name=q max-tokens=16 stream-tokens=true \
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
//! question's arrival), `ttft-from-capture-ms` (from the capture of the question's frame, the
//! newest sampled frame at its time, one `vlmencode min-change` held included, to the
//! first token, on the pipeline clock: a live source stamps a frame's capture as its running
//! time; -1 without a clock or where a source that is not live runs ahead of it), `queue-ms`, `prepare-ms`, `tokens`, `total-ms`, `estimate-ms` (the
//! placer's, -1 when none), `lag-frames` and `lag-ms` (the stream's ingestion lag when the
//! question arrived), `pts`, `picture-age-ms` (how old the bound frame's picture was at the
//! question's time, in running time: with `vlmencode min-change` it includes the unchanged
//! frames it stood for; -1 when unknown). A failed question also posts a WARNING. A question cancelled by a
//! flush or a stop gets its `vlm-answer` (`cancelled`, `reason` says which) then; at the video's
//! EOS nothing is left to cancel (see above), so `gst-launch-1.0 -m` shows every answer.
//!
//! ## Alerts
//!
//! `alerts` lists standing yes/no questions, `id:question;id:question` (settable in a pipeline
//! description and while PLAYING; a list with an empty id, a duplicate id or a missing question
//! is refused with a WARNING naming the fault, on stderr and on the bus, and the previous list
//! kept; a new list keeps the states of the alerts it leaves unchanged, and a new or changed
//! alert posts its first state again). Each alert is evaluated on every new version (frame) of
//! every stream reaching this element, on a private branch of that version: the question
//! (followed by "Answer yes or no.") is prefilled there and its last logits give a forced choice between the model's "yes" and
//! "no" tokens (found by tokenizing the words; a model without single-token answers disables the
//! alerts with a WARNING): no sampling, `P(yes)` the softmax over the two logits, the state
//! `yes > no`. Evaluations share the engine's steps with answers, and a question a user asked
//! starts before every evaluation still waiting. A frame's alerts are decided in one decode, and
//! with `kv-layout` unified (the default on CPU engines) the words their questions open with are decoded once for
//! all of them: questions phrased alike ("Is there a person?", "Is there a vehicle?") cost less.
//! While `alerts` is set, the streams' frames are ingested as frames a question waits for are. `alert-interval` evaluates every Nth frame;
//! `alert-hold` is the hysteresis (a state changes after N evaluations in a row of the other
//! state). Each stream has one slot for its next frame: a frame that comes while the slot is
//! full replaces it (newest frame first), counted in `alerts-thinned` and said by a
//! `vlm-alert-overload` message (`stream`, `frame` not evaluated, `thinned` so far, `policy`
//! `newest-first`; at most one a second per stream). At the video's EOS the frames already
//! scheduled are evaluated before EOS goes on; a flush drops them, and PAUSED→READY ends the
//! alert thread and forgets the states (the next run posts first states again).
//!
//! Element message `vlm-alert`, once with each stream's first state of an alert and once per
//! change: `id`, `question`, `stream`, `state` (boolean), `probability` (of yes, double),
//! `frame` (uint64: the frame that decided it), `pts` (that frame's), `latency-ms` (from that
//! frame's arrival at this element, or from its running time on the pipeline clock when that is
//! longer, as for a live source, which stamps capture time), `evaluations` (of this alert on this
//! stream so far), `first` (boolean) and `engine`. With `output-format=json` the text pad also
//! carries one line per `vlm-alert` (an object with its fields and `"type":"alert"`); `text`
//! output carries answers only. The states ride the video: each buffer leaving `video_src` of a
//! stream with reported states carries a custom meta `VlmAlertMeta` (`stream`; arrays `ids`,
//! `states`, `probabilities`, `frames`: each alert's reported state, the P(yes) and the frame
//! that decided it), the states as reported when the buffer leaves (Python:
//! `buffer.get_custom_meta("VlmAlertMeta").get_structure()`).
//!
//! ```sh
//! gst-launch-1.0 -m videotestsrc pattern=ball num-buffers=30 ! videoconvert ! vlmencode mmproj=models/test-mmproj-mlp.gguf \
//!     ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
//!     ! vlmquery alerts="ball:Is there a ball?;dark:Is the picture dark?" alert-hold=2 output-format=json ! fdsink
//! ```
//!
//! ## Properties
//!
//! Every property below: Since: 0.1.
//!
//! - `placement` (`auto`): the placer decides, or an engine's name forces it.
//! - `max-tokens` (1-4096, 64): most tokens per answer (a question event's `max-tokens`
//!   overrides it). `exact-tokens` (false): generate exactly `max-tokens` (measurements).
//! - `stream-tokens` (false): push each answer as it is generated (the answer so far).
//! - `output-format` (`text`/`json`, `text`); `answer-duration` (ns, 5000000000).
//! - `display` (`replace`/`queue`, `replace`): on the video, a newer answer replaces the one on
//!   screen at once, or waits for its `answer-duration` to end.
//! - `caption-prompt` (empty = off); `caption-interval` (ns, 10000000000; 0 = every frame that
//!   joins the history). A caption that finds `max-questions` pending is skipped.
//! - `max-questions` (1-1024, 16): questions pending at once (being answered, or answered and
//!   waiting for the text pad while the video runs: after the video's EOS only those being
//!   answered count, since textoverlay then holds its text pad for ever).
//! - `commit-answers` (`none`/`ordered`, `none`): with `ordered`, each question and its answer
//!   join the stream's history in question order, so later questions see the conversation.
//! - `temp` (0 = greedy), `seed` (0; at most 4294967294), `top-k` (40), `top-p` (0.95), `min-p` (0.05).
//! - Read-only: `answers` (answer buffers pushed), notified when it changes and zero again at
//!   PAUSED→READY (read it before stopping the pipeline).
//! - `alerts` (empty = none), `alert-interval` (1 = every frame), `alert-hold` (1 = change at
//!   once); read-only `alert-evaluations` (evaluations done) and `alerts-thinned` (frames not
//!   evaluated), zero again at PAUSED→READY (see Alerts).
//!
//! Debug category: `vlmquery`.
//!
//! Since: 0.1

use gst::glib;
use gst::prelude::*;

mod imp;

glib::wrapper! {
    pub struct VlmQuery(ObjectSubclass<imp::VlmQuery>) @extends gst::Element, gst::Object;
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    // The debug category exists from plugin load on (`gst-launch-1.0 --gst-debug-help` lists it).
    std::sync::LazyLock::force(&imp::CAT);
    // The enums of its properties are part of the plugin's documented API.
    imp::CommitAnswers::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    imp::OutputFormat::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    imp::Display::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    gst::Element::register(Some(plugin), "vlmquery", gst::Rank::NONE, VlmQuery::static_type())
}
