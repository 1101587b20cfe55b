//! What the change gate (`vlmencode min-change`) and tile reuse (`tile-reuse`) save on camera
//! scenes built from GStreamer's own sources, gate off and on side by side in one run.
//!
//!   cargo run --release -p gst-plugin-vlm --example gate_scenes -- [--seconds 60] [--json FILE]
//!       [--model LM.gguf --mmproj MMPROJ.gguf] [--width 640 --height 480]
//!
//! Each scene is `--seconds` of 30 frames/s video (stream time, run as fast as it goes: the
//! counts do not depend on the machine), one due frame a second, into `vlmencode` alone:
//!
//! - `still-noise`: `videotestsrc pattern=smpte` (still bars, a patch of fresh noise every frame);
//! - `still-grain`: the bars under a 10% layer of `snow` (grain on every pixel);
//! - `small-object`: the bars with a 64x64 window of `pattern=ball` (a small moving ball);
//! - `full-motion`: the bars scrolling sideways (`horizontal-speed=8`).
//!
//! Printed per scene and mode: frames encoded and held, tiles (images) encoded and reused (the
//! JSON adds the encoder's time on this machine, which other work on it moves: the counts are
//! the claim). The default models are the
//! idefics3 test pair (SmolVLM's projector type: 2x2 tiles and an overview; random weights).

use std::time::Instant;

use clap::Parser;
use gst::prelude::*;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 60)]
    seconds: u32,
    #[arg(long, default_value = "models/test-idefics3-lm.gguf")]
    model: String,
    #[arg(long, default_value = "models/test-idefics3-mmproj.gguf")]
    mmproj: String,
    #[arg(long, default_value_t = 640)]
    width: u32,
    #[arg(long, default_value_t = 480)]
    height: u32,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// The scenes: name, and the source part of a pipeline (raw video at the scene's size).
fn scenes(w: u32, h: u32, frames: u32) -> Vec<(&'static str, String)> {
    let caps = format!("video/x-raw,width={w},height={h},framerate=30/1");
    let bars = format!("videotestsrc pattern=smpte num-buffers={frames} ! {caps}");
    vec![
        ("still-noise", bars.clone()),
        (
            "still-grain",
            format!(
                "{bars} ! mix.sink_0 videotestsrc pattern=snow num-buffers={frames} ! {caps} ! mix.sink_1 \
                 compositor name=mix sink_1::alpha=0.1 ! {caps}"
            ),
        ),
        (
            "small-object",
            format!(
                "{bars} ! mix.sink_0 videotestsrc pattern=ball num-buffers={frames} \
                 ! video/x-raw,width=64,height=64,framerate=30/1 ! mix.sink_1 \
                 compositor name=mix sink_1::xpos={} sink_1::ypos={} ! {caps}",
                w / 3,
                h / 3
            ),
        ),
        ("full-motion", format!("videotestsrc pattern=smpte horizontal-speed=8 num-buffers={frames} ! {caps}")),
    ]
}

#[derive(Debug)]
struct Row {
    scene: &'static str,
    gate: &'static str,
    due: u64,
    frames_encoded: u64,
    frames_unchanged: u64,
    tiles_encoded: u64,
    tiles_reused: u64,
    encode_ms_total: f64,
    wall_s: f64,
}

fn run(a: &Args, scene: &'static str, source: &str, gate: &'static str) -> Result<Row, Box<dyn std::error::Error>> {
    let settings = if gate == "off" { "min-change=0 tile-reuse=off" } else { "" };
    let pipeline = gst::parse::launch(&format!(
        "{source} ! videoconvert ! vlmencode name=enc mmproj={} model={} interval=1000000000 {settings} ! fakesink",
        a.mmproj, a.model
    ))?;
    let started = Instant::now();
    pipeline.set_state(gst::State::Playing)?;
    let bus = pipeline.bus().ok_or("no bus")?;
    for msg in bus.iter_timed(gst::ClockTime::NONE) {
        match msg.view() {
            gst::MessageView::Eos(_) => break,
            gst::MessageView::Error(e) => return Err(format!("{scene}: {} ({:?})", e.error(), e.debug()).into()),
            _ => (),
        }
    }
    let enc = pipeline.downcast_ref::<gst::Bin>().ok_or("not a bin")?.by_name("enc").ok_or("no enc")?;
    let n = |p: &str| enc.property::<u64>(p);
    let encoded = n("frames-encoded");
    let row = Row {
        scene,
        gate,
        due: encoded + n("frames-unchanged") + n("cache-hits"),
        frames_encoded: encoded,
        frames_unchanged: n("frames-unchanged"),
        tiles_encoded: n("tiles-encoded"),
        tiles_reused: n("tiles-reused"),
        encode_ms_total: enc.property::<f64>("mean-encode-ms") * encoded as f64,
        wall_s: started.elapsed().as_secs_f64(),
    };
    pipeline.set_state(gst::State::Null)?;
    Ok(row)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    gst::init()?;
    gstvlm::plugin_register_static()?;
    let mut rows = vec![];
    for (scene, source) in scenes(a.width, a.height, a.seconds * 30) {
        for gate in ["off", "on"] {
            rows.push(run(&a, scene, &source, gate)?);
        }
    }
    println!(
        "Change gate and tile reuse, {}x{} at 30 frames/s, one due frame a second for {} s of stream time\n\
         models: {} + {}; gate off = min-change=0 tile-reuse=off, on = the defaults\n",
        a.width, a.height, a.seconds, a.model, a.mmproj
    );
    println!(
        "| scene | gate | due frames | frames encoded | held | tiles encoded | tiles reused | tile encodes saved |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for pair in rows.chunks(2) {
        let off_tiles = pair[0].tiles_encoded.max(1) as f64;
        for r in pair {
            println!(
                "| {} | {} | {} | {} | {} | {} | {} | {:.0}% |",
                r.scene,
                r.gate,
                r.due,
                r.frames_encoded,
                r.frames_unchanged,
                r.tiles_encoded,
                r.tiles_reused,
                100.0 * (1.0 - r.tiles_encoded as f64 / off_tiles),
            );
        }
    }
    let json = serde_json::json!({
        "what": "vlmencode change gate and tile reuse on videotestsrc scenes",
        "width": a.width, "height": a.height, "seconds": a.seconds,
        "model": a.model, "mmproj": a.mmproj,
        "rows": rows.iter().map(|r| serde_json::json!({
            "scene": r.scene, "gate": r.gate, "due": r.due, "frames_encoded": r.frames_encoded,
            "frames_unchanged": r.frames_unchanged, "tiles_encoded": r.tiles_encoded,
            "tiles_reused": r.tiles_reused, "encode_ms_total": r.encode_ms_total, "wall_s": r.wall_s,
        })).collect::<Vec<_>>(),
    });
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    Ok(())
}
