//! Typed wrappers for gst-vlm's custom events and queries.

use gst::glib;

/// Name of the question event's structure.
pub const QUESTION: &str = "vlm-question";
/// Name of the sticky event that tells downstream which stream a pad carries.
pub const STREAM: &str = "vlm-stream";
/// Name of the event vlmencode sends before a frame it encodes again though it did not change.
pub const STANDING: &str = "vlm-standing";
/// Name of the upstream event vlmcontext sends when an encoded frame did not join the history.
pub const NOT_TAKEN: &str = "vlm-frame-not-taken";
/// Name of the query vlmencode sends downstream to learn the language model.
pub const MODEL_QUERY: &str = "vlm-model";
/// Name of the query vlmencode sends downstream to learn its stream's demand.
pub const DEMAND_QUERY: &str = "vlm-demand";

/// The longest question id taken (vlmquery remembers recent ids to refuse duplicates).
pub const MAX_ID_BYTES: usize = 256;

/// A question, as carried by a serialized custom downstream event named `vlm-question`.
#[derive(Debug, Clone, PartialEq)]
pub struct QuestionEvent {
    pub text: String,
    pub id: Option<String>,
    pub max_tokens: Option<u32>,
}

impl QuestionEvent {
    /// The event for a question (`id` and `max-tokens` optional).
    pub fn event(text: &str, id: Option<&str>, max_tokens: Option<u32>) -> gst::Event {
        let s = gst::Structure::builder(QUESTION)
            .field("text", text)
            .field_if_some("id", id)
            .field_if_some("max-tokens", max_tokens)
            .build();
        gst::event::CustomDownstream::new(s)
    }

    /// `None` when the event is not a question; `Some(Err)` when it is one but malformed.
    pub fn parse(event: &gst::EventRef) -> Option<Result<QuestionEvent, String>> {
        let s = event.structure().filter(|s| s.name() == QUESTION)?;
        Some((|| {
            let text = s.get::<String>("text").map_err(|e| format!("vlm-question needs a string field 'text': {e}"))?;
            if text.trim().is_empty() {
                return Err("vlm-question has an empty 'text'".to_string());
            }
            // (A blank id is none: the question gets a generated one.)
            let id = s.get_optional::<String>("id").map_err(|e| format!("vlm-question field 'id': {e}"))?;
            let id = id.filter(|id| !id.trim().is_empty());
            if let Some(id) = id.as_ref().filter(|id| id.len() > MAX_ID_BYTES) {
                return Err(format!("vlm-question 'id' of {} bytes is longer than {MAX_ID_BYTES}", id.len()));
            }
            let max_tokens = match s.value("max-tokens") {
                Err(_) => None,
                Ok(v) => {
                    Some(integer(v).and_then(|n| u32::try_from(n).ok()).filter(|&n| n > 0).ok_or_else(|| {
                        format!("vlm-question field 'max-tokens' must be a positive integer, not {v:?}")
                    })?)
                }
            };
            Ok(QuestionEvent { text, id, max_tokens })
        })())
    }
}

/// An integer of any of GLib's integer types (what gst-launch or an application wrote).
fn integer(v: &glib::SendValue) -> Option<i128> {
    (v.get::<i32>().map(i128::from))
        .or_else(|_| v.get::<u32>().map(i128::from))
        .or_else(|_| v.get::<i64>().map(i128::from))
        .or_else(|_| v.get::<u64>().map(i128::from))
        .ok()
}

/// The sticky `vlm-stream` event: which runtime stream the buffers of this pad belong to.
pub struct StreamEvent;

impl StreamEvent {
    pub fn event(stream: u64, name: &str) -> gst::Event {
        gst::event::CustomDownstreamSticky::new(
            gst::Structure::builder(STREAM).field("id", stream).field("name", name).build(),
        )
    }

    pub fn parse(event: &gst::EventRef) -> Option<u64> {
        event.structure().filter(|s| s.name() == STREAM)?.get::<u64>("id").ok()
    }
}

/// The serialized `vlm-standing` event: `vlmencode min-change` encodes the frame that follows
/// again although it did not change (`max-unchanged` reached), and until it is registered the
/// frame encoded last stands for it, as for a frame the gate held: a question about its time
/// binds at once. `pts` and `duration` are the frame's (in the video's segment); `vlmcontext`
/// adds its `stream` (the id `vlm-stream` announces).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StandingEvent {
    pub pts: Option<gst::ClockTime>,
    pub duration: Option<gst::ClockTime>,
    pub stream: Option<u64>,
}

impl StandingEvent {
    pub fn event(&self) -> gst::Event {
        gst::event::CustomDownstream::new(
            gst::Structure::builder(STANDING)
                .field("pts", self.pts)
                .field("duration", self.duration)
                .field_if_some("stream", self.stream)
                .build(),
        )
    }

    /// The event's fields, when it is one.
    pub fn parse(event: &gst::EventRef) -> Option<StandingEvent> {
        let s = event.structure().filter(|s| s.name() == STANDING)?;
        Some(StandingEvent {
            pts: s.get("pts").ok().flatten(),
            duration: s.get("duration").ok().flatten(),
            stream: s.get("stream").ok(),
        })
    }
}

/// The upstream `vlm-frame-not-taken` event: vlmcontext did not take the embeddings of a frame
/// into its stream's history (skipped under overload, no stream sequence free, the history full)
/// or got a frame the gate held while nothing stands for it in the history (a new or reopened
/// stream). vlmencode then encodes its next due frame whether or not the picture changed: the
/// change gate compares with the last frame encoded, which the history does not have.
pub struct NotTakenEvent;

impl NotTakenEvent {
    pub fn event() -> gst::Event {
        gst::event::CustomUpstream::new(gst::Structure::new_empty(NOT_TAKEN))
    }

    pub fn is(event: &gst::EventRef) -> bool {
        event.structure().is_some_and(|s| s.name() == NOT_TAKEN)
    }
}

/// The `vlm-model` query: vlmencode asks downstream which language model its embeddings feed
/// (libmtmd needs the model's vocabulary and width); vlmcontext answers with its `model`.
pub struct ModelQuery;

impl ModelQuery {
    pub fn query() -> gst::query::Custom<gst::Query> {
        gst::query::Custom::new(gst::Structure::new_empty(MODEL_QUERY))
    }

    pub fn is(query: &gst::QueryRef) -> bool {
        query.structure().is_some_and(|s| s.name() == MODEL_QUERY)
    }

    pub fn answer(query: &mut gst::QueryRef, model: &str) {
        query.structure_mut().set("model", model);
    }

    pub fn model(query: &gst::QueryRef) -> Option<String> {
        query.structure()?.get::<String>("model").ok().filter(|m| !m.is_empty())
    }
}

/// A stream's demand carried in a query's structure: how many readers wait for its next frames.
#[derive(Clone, glib::Boxed)]
#[boxed_type(name = "GstVlmDemand")]
struct DemandValue(vlm_runtime::llama::Demand);

/// The `vlm-demand` query: vlmencode asks downstream for the demand of the stream its frames
/// feed, so that while a question waits on the stream (or a standing alert reads it) its frames
/// are encoded before other streams' (the process's encoder contexts are shared); vlmcontext
/// answers once the pad's stream is open.
pub struct DemandQuery;

impl DemandQuery {
    pub fn query() -> gst::query::Custom<gst::Query> {
        gst::query::Custom::new(gst::Structure::new_empty(DEMAND_QUERY))
    }

    pub fn is(query: &gst::QueryRef) -> bool {
        query.structure().is_some_and(|s| s.name() == DEMAND_QUERY)
    }

    pub fn answer(query: &mut gst::QueryRef, demand: vlm_runtime::llama::Demand) {
        query.structure_mut().set("demand", DemandValue(demand));
    }

    pub fn demand(query: &gst::QueryRef) -> Option<vlm_runtime::llama::Demand> {
        query.structure()?.get::<DemandValue>("demand").ok().map(|d| d.0)
    }
}
