//! A minimal Rust application using gst-vlm: build a pipeline with `gst::parse::launch`, ask with
//! the `ask` signal and with a `vlm-question` event, read every answer from the bus
//! (`vlm-answer`) and from an appsink (one JSON object a line).
//!
//!   cargo run -p gst-plugin-vlm --example ask -- [MODEL MMPROJ]
//!
//! MODEL and MMPROJ default to `$VLM_MODEL` and `$VLM_MMPROJ`, then to the test pair.
//!
//! The plugin is registered statically here; an application using the installed plugin only
//! needs `gst::init()`. Exits with an error unless both questions are answered.

use std::sync::{Arc, Mutex};

use gst::prelude::*;
use gst_app::AppSink;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut arg =
        |var: &str, default: &str| args.next().or_else(|| std::env::var(var).ok()).unwrap_or_else(|| default.into());
    let model = arg("VLM_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mmproj = arg("VLM_MMPROJ", "models/test-mmproj-mlp.gguf");
    gst::init()?;
    gstvlm::plugin_register_static()?;
    let pipeline = gst::parse::launch(&format!(
        "videotestsrc pattern=ball num-buffers=60 ! video/x-raw,width=160,height=120,framerate=30/1 \
         ! videoconvert ! vlmencode mmproj={mmproj} interval=250000000 \
         ! vlmcontext name=ctx model={model} ! vlmquery name=q max-tokens=8 output-format=json \
         ! appsink name=answers sync=false"
    ))?
    .downcast::<gst::Pipeline>()
    .map_err(|_| "not a pipeline")?;
    let query = pipeline.by_name("q").ok_or("no vlmquery")?;

    // Ask once the video leaving vlmcontext passes 0.5 s (`ask`: bound to the newest frame) and
    // 1 s (a `vlm-question` event in the stream: bound to the frames before it).
    let asked = Arc::new(Mutex::new(Vec::<String>::new()));
    let (asked_by_probe, q) = (Arc::clone(&asked), query.clone());
    pipeline.by_name("ctx").ok_or("no vlmcontext")?.static_pad("src_0").ok_or("no src_0")?.add_probe(
        gst::PadProbeType::BUFFER,
        move |_, info| {
            let pts = info.buffer().and_then(|b| b.pts()).unwrap_or_default();
            let mut asked = asked_by_probe.lock().unwrap();
            if asked.is_empty() && pts >= gst::ClockTime::from_mseconds(500) {
                asked.extend(q.emit_by_name::<Option<String>>("ask", &[&"What is moving in the video?"]));
            } else if asked.len() == 1 && pts >= gst::ClockTime::from_seconds(1) {
                let s = gst::Structure::builder("vlm-question")
                    .field("text", "Describe the colours.")
                    .field("id", "colours")
                    .field("max-tokens", 6u32)
                    .build();
                q.static_pad("sink").unwrap().send_event(gst::event::CustomDownstream::new(s));
                asked.push("colours".into());
                return gst::PadProbeReturn::Remove;
            }
            gst::PadProbeReturn::Ok
        },
    );

    // The appsink: one JSON line per answer.
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink_lines = Arc::clone(&lines);
    let appsink =
        pipeline.by_name("answers").ok_or("no appsink")?.downcast::<AppSink>().map_err(|_| "not an appsink")?;
    appsink.set_callbacks(
        gst_app::AppSinkCallbacks::builder()
            .new_sample(move |sink| {
                let sample = sink.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                let map =
                    sample.buffer().ok_or(gst::FlowError::Error)?.map_readable().map_err(|_| gst::FlowError::Error)?;
                sink_lines.lock().unwrap().push(String::from_utf8_lossy(&map).into_owned());
                Ok(gst::FlowSuccess::Ok)
            })
            .build(),
    );

    // The bus: every accepted question ends in one vlm-answer.
    // A failed start says why on the bus (a missing file, a bad property): report that, not the
    // bare state-change error.
    if pipeline.set_state(gst::State::Playing).is_err() {
        let why = pipeline
            .bus()
            .and_then(|bus| bus.timed_pop_filtered(gst::ClockTime::from_seconds(5), &[gst::MessageType::Error]))
            .and_then(|m| match m.view() {
                gst::MessageView::Error(e) => Some(format!("{} ({:?})", e.error(), e.debug())),
                _ => None,
            })
            .unwrap_or_else(|| "no error on the bus".into());
        let _ = pipeline.set_state(gst::State::Null);
        return Err(format!("cannot start the pipeline: {why}").into());
    }
    let mut answered = vec![];
    let mut failed = None;
    for msg in pipeline.bus().unwrap().iter_timed(gst::ClockTime::from_seconds(120)) {
        match msg.view() {
            gst::MessageView::Eos(_) => break,
            gst::MessageView::Error(e) => {
                failed = Some(format!("{} ({:?})", e.error(), e.debug()));
                break;
            }
            gst::MessageView::Element(e) => {
                if let Some(s) = e.structure().filter(|s| s.name() == "vlm-answer") {
                    let (id, text) = (s.get::<String>("id")?, s.get::<String>("text")?);
                    println!("[bus] {id}: {text:?} ({})", s.get::<String>("status")?);
                    answered.push(id);
                }
            }
            _ => (),
        }
    }
    pipeline.set_state(gst::State::Null)?;
    if let Some(why) = failed {
        return Err(why.into());
    }
    let lines = lines.lock().unwrap();
    print!("[appsink] {} JSON lines:\n{}", lines.len(), lines.concat());
    let asked = asked.lock().unwrap();
    if asked.len() != 2 || !asked.iter().all(|a| answered.contains(a)) || lines.len() != 2 {
        return Err(format!("asked {asked:?}, answered {answered:?}").into());
    }
    Ok(())
}
