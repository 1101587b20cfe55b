//! Benchmark: time to first token of a question over a retained history of N frames against the
//! re-prefill baseline (`retain=false`), measured side by side in one run on one engine.
//!
//!   cargo run -p vlm-runtime --example ttft -- [--frames 1,8,32] [--repeats 5] [--json FILE]
//!
//! Prints a table and one JSON object. The question arrives when its version is already
//! published, so TTFT = history preparation (branch copy or replay) + question prefill + the
//! first token. Runs alternate retained / baseline to share the machine's noise.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use clap::Parser;

#[path = "common/mod.rs"]
mod common;
use vlm_runtime::encoder::{MtmdEncoder, Picture, PixelLayout, VisionEncoder};
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::{Device, Engine, EngineConfig, Question, Sampling, Stream, StreamConfig, answer, models};

#[derive(Parser)]
struct Args {
    /// History lengths to measure, in frames.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    frames: Vec<usize>,
    /// Questions per history length and mode.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Also write the JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    #[command(flatten)]
    files: common::ModelArgs,
}

fn picture(variant: usize) -> Vec<u8> {
    (0..64 * 48).flat_map(|i| [(i % 64 * 4) as u8, (i / 64 * 5) as u8, ((i / 8 + variant * 3) % 256) as u8]).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get() as i32);
    let max_frames = *args.frames.iter().max().unwrap_or(&1);
    let cells = (64 + 40 * max_frames as u32 + 256).next_power_of_two();
    let engine = Engine::start(
        &args.files.model,
        EngineConfig {
            context_per_sequence: cells,
            max_streams: 2,
            max_branches: 1,
            threads,
            ..EngineConfig::default()
        },
    )?;
    let model = models::model(&args.files.model, &Device::Cpu)?;
    let encoder = MtmdEncoder::new(models::projector(&args.files.mmproj, &model, false, threads, 1)?);
    let prompt = Arc::new(Prompt::new(engine.model(), DEFAULT_SYSTEM_PROMPT)?);
    let never = Arc::new(AtomicBool::new(false));
    let open = |name: &str, retain| {
        let config = StreamConfig { retain, answer_reserve: 64, ..StreamConfig::new(name) };
        Stream::open(&engine, Arc::clone(&prompt), config)
    };
    let (retained, baseline) = (open("retained", true)?, open("baseline", false)?);
    let mut registered = 0;
    let mut rows = vec![];
    println!("{:>7} {:>16} {:>16} {:>8} {:>14}", "frames", "retained ms", "re-prefill ms", "ratio", "prefill ms/frm");
    for &n in &args.frames {
        let ingest = Instant::now();
        while registered < n {
            let rgb = picture(registered);
            let frame = Arc::new(encoder.encode(&Picture::packed(&rgb, 64, 48, 192, PixelLayout::Rgb))?);
            retained.register(Arc::clone(&frame), &never)?;
            baseline.register(frame, &never)?;
            registered += 1;
        }
        let (vr, vb) = (retained.wait_version(n as u64, &never)?, baseline.wait_version(n as u64, &never)?);
        let ingest_ms = ingest.elapsed().as_secs_f64() * 1e3;
        let (mut r, mut b) = (vec![], vec![]);
        for i in 0..args.repeats {
            for (version, out) in [(&vr, &mut r), (&vb, &mut b)] {
                let q = Question {
                    id: format!("{n}-{i}"),
                    text: "What is happening in the video right now?".into(),
                    max_tokens: 1,
                    ignore_eos: false,
                    sampling: Sampling::default(),
                    arrival: Instant::now(),
                };
                out.push(answer(version, &q, &never, |_| {})?.ttft_ms);
            }
        }
        let (rm, bm) = (common::median(&mut r), common::median(&mut b));
        let new_frames =
            n.saturating_sub(rows.last().map_or(0, |row: &serde_json::Value| row["frames"].as_u64().unwrap() as usize));
        let per_frame = ingest_ms / new_frames.max(1) as f64;
        println!("{n:>7} {rm:>16.1} {bm:>16.1} {:>8.2} {per_frame:>14.1}", bm / rm);
        rows.push(serde_json::json!({
            "frames": n, "retained_ttft_ms": r, "reprefill_ttft_ms": b,
            "retained_median_ms": rm, "reprefill_median_ms": bm, "speedup": bm / rm,
        }));
    }
    let json = serde_json::json!({
        "benchmark": "ttft-retained-vs-reprefill",
        "model": args.files.model, "mmproj": args.files.mmproj, "threads": threads, "repeats": args.repeats,
        "tokens_per_frame": 36, "rows": rows,
    });
    println!("{json}");
    if let Some(path) = args.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    Ok(())
}
