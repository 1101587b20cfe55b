//! Typed wrappers for gst-vlm's custom events and queries.

/// Name of the question event's structure.
pub const QUESTION: &str = "vlm-question";
/// Name of the sticky event that tells downstream which stream a pad carries.
pub const STREAM: &str = "vlm-stream";
/// Name of the query vlmencode sends downstream to learn the language model.
pub const MODEL_QUERY: &str = "vlm-model";

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
            let id = s.get_optional::<String>("id").map_err(|e| format!("vlm-question field 'id': {e}"))?;
            let max_tokens = s
                .get_optional::<u32>("max-tokens")
                .map_err(|e| format!("vlm-question field 'max-tokens' must be a uint: {e}"))?;
            Ok(QuestionEvent { text, id, max_tokens })
        })())
    }
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
