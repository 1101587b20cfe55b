//! Measurement: what an endless stream's retained embeddings cost in host memory. One stream on
//! a CPU engine, `history-policy=slide`, frames of `--rows` embedding rows (plain rows of the
//! language model's width, as an NPU or a tiled projector hands over: SmolVLM-500M's 13 tiles are
//! 832 rows of 960 floats, 3.2 MB) registered and ingested one after another. Every `--every`
//! frames it prints the process's RSS (free heap given back first); at the end, how many of the
//! newest 64 frames' versions are still bindable, and a JSON line.
//!
//!   cargo run -p vlm-runtime --example retention -- [--frames 120] [--rows 400] [--context 2048]

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use clap::Parser;

#[path = "common/mod.rs"]
mod common;
use vlm_runtime::entry::Frame;
use vlm_runtime::llama::{ImageEmbeddings, Segment};
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::{Engine, EngineConfig, HistoryPolicy, Stream, StreamConfig};

#[derive(Parser)]
struct Args {
    /// Frames registered.
    #[arg(long, default_value_t = 120)]
    frames: u64,
    /// Embedding rows a frame.
    #[arg(long, default_value_t = 400)]
    rows: usize,
    /// KV cells of the stream's sequence.
    #[arg(long, default_value_t = 2048)]
    context: u32,
    /// Frames between RSS samples.
    #[arg(long, default_value_t = 10)]
    every: u64,
    #[command(flatten)]
    files: common::ModelArgs,
}

unsafe extern "C" {
    /// glibc: give free heap memory back to the system.
    fn malloc_trim(pad: usize) -> i32;
}

/// VmRSS in MiB, free heap pages given back first.
fn rss_mib() -> f64 {
    // SAFETY: malloc_trim only releases free memory of glibc's allocator.
    unsafe { malloc_trim(0) };
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse().ok());
    kib.unwrap_or(0.0) / 1024.0
}

/// A frame of `rows` deterministic rows of `width` small floats.
fn frame(variant: u64, rows: usize, width: usize) -> Arc<Frame> {
    let data: Box<[f32]> =
        (0..rows * width).map(|i| (((i as u64 * 7919 + variant * 104_729) % 2001) as f32 - 1000.0) * 2e-5).collect();
    let image = ImageEmbeddings::plain(data, rows, width).expect("rows x width floats");
    Arc::new(Frame { segments: vec![Segment::Image(image)], content_hash: variant })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let config =
        EngineConfig { context_per_sequence: args.context, max_streams: 1, max_branches: 1, ..EngineConfig::default() };
    let engine = Engine::start(&args.files.model, config)?;
    let width = engine.model().n_embd();
    let prompt = Arc::new(Prompt::new(engine.model(), DEFAULT_SYSTEM_PROMPT)?);
    let stream = Stream::open(
        &engine,
        prompt,
        StreamConfig { history_policy: HistoryPolicy::Slide, answer_reserve: 64, ..StreamConfig::new("s") },
    )?;
    let never = AtomicBool::new(false);
    let frame_mib = (args.rows * width * 4) as f64 / (1 << 20) as f64;
    println!("{:>7} {:>9} {:>7} {:>9}", "frames", "history", "slides", "RSS MiB");
    let mut samples = vec![];
    let mut history = 0;
    for n in 1..=args.frames {
        stream.register(frame(n, args.rows, width), &never)?;
        history = stream.wait_version(n, &never)?.frames();
        if n % args.every == 0 || n == args.frames {
            let rss = rss_mib();
            println!("{n:>7} {history:>9} {:>7} {rss:>9.1}", stream.slides());
            samples.push(serde_json::json!({ "frames": n, "rss_mib": rss }));
        }
    }
    let newest = args.frames;
    let bindable =
        (newest.saturating_sub(63).max(1)..=newest).filter(|&n| stream.wait_version(n, &never).is_ok()).count();
    println!("{bindable} of the newest 64 frames' versions bindable; a frame is {frame_mib:.2} MiB of embeddings");
    let json = serde_json::json!({
        "benchmark": "retention", "clock": "none (memory)", "model": args.files.model,
        "frames": args.frames, "rows": args.rows, "width": width, "frame_mib": frame_mib, "context": args.context,
        "history_frames": history, "slides": stream.slides(), "bindable_of_newest_64": bindable, "samples": samples,
    });
    println!("{json}");
    stream.close();
    engine.stop();
    Ok(())
}
