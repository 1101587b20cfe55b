//! Fidelity report (c) and stage costs: the mixed path (a CPU prefix imported into the GPU
//! engine, decoded there) against the all-GPU reference, over a fixed prompt set; plus the stage
//! rates every engine measured. Prints tables and one JSON object.
//!
//!   GGML_VK_VISIBLE_DEVICES=0 cargo run -p vlm-runtime --example fidelity -- [--engines cpu,gpu] [--tokens 8]
//!   cargo run -p vlm-runtime --example fidelity -- --engines local:cpu:1,far:rpc:127.0.0.1:50052
//!
//! (the second with llama.cpp's `ggml-rpc-server -H 127.0.0.1 -p 50052 -t 1` running: an RPC
//! engine's stage costs against a local one's, network and protocol included).
//!
//! Without a GPU, Mesa's lavapipe stands in (about 30x slower than the CPU backend, and its first
//! run compiles shaders for a minute or more): keep --tokens small. The comparison is reported,
//! not asserted: CPU and GPU kernels already part after a few greedy tokens with no transfer.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use clap::Parser;

#[path = "common/mod.rs"]
mod common;
use vlm_runtime::encoder::{MtmdEncoder, Picture, PixelLayout, VisionEncoder};
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::{
    Device, Engine, EngineConfig, PreparePath, Question, Sampling, Stream, StreamConfig, answer_on, models,
};

#[derive(Parser)]
struct Args {
    /// Engines (NAME[:cpu|gpu[:THREADS]]); the first holds the streams (the "CPU prefix").
    #[arg(long, default_value = "cpu,gpu")]
    engines: String,
    /// Greedy tokens per answer.
    #[arg(long, default_value_t = 8)]
    tokens: u32,
    /// Frames per history.
    #[arg(long, default_value_t = 1)]
    frames: u32,
    /// Flash attention on every engine (V stored untransposed: a snapshot is a few large copies
    /// instead of one per V row, which matters over RPC).
    #[arg(long)]
    flash_attention: bool,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    #[command(flatten)]
    files: common::ModelArgs,
}

const QUESTIONS: [&str; 4] =
    ["What is in the picture?", "Describe the colours.", "Is anything moving?", "Summarise the scene in a few words."];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let base = EngineConfig {
        context_per_sequence: 512,
        max_streams: 2,
        max_branches: 2,
        flash_attention: args.flash_attention,
        ..EngineConfig::default()
    };
    let mut engines = vec![];
    for config in EngineConfig::parse_list(&args.engines, &base)? {
        let t = Instant::now();
        let name = config.name.clone();
        engines.push(Engine::start(&args.files.model, config)?);
        eprintln!("engine {name} ready in {:.1} s", t.elapsed().as_secs_f64());
    }
    let (home, others) = engines.split_first().ok_or("no engine")?;
    let model = models::model(&args.files.model, &Device::Cpu)?;
    let encoder = MtmdEncoder::new(models::projector(&args.files.mmproj, &model, false, 2, 1)?);
    let prompt = Arc::new(Prompt::new(&model, DEFAULT_SYSTEM_PROMPT)?);
    let never = Arc::new(AtomicBool::new(false));
    let config = StreamConfig { answer_reserve: 64, peers: engines.clone(), ..StreamConfig::new("fidelity") };
    let stream = Stream::open(home, prompt, config)?;
    for v in 0..args.frames {
        let rgb: Vec<u8> = (0..64 * 48 * 3).map(|i| (i as u32 * (v + 3) % 251) as u8).collect();
        stream.register(Arc::new(encoder.encode(&Picture::packed(&rgb, 64, 48, 192, PixelLayout::Rgb))?), &never)?;
    }
    let version = stream.wait_version(args.frames as u64, &never)?;
    // (a) Transfer: the history's snapshot through each other engine and back, byte for byte.
    let snapshot = vlm_runtime::answer::snapshot(&version)?;
    let mut round_trips = vec![];
    for target in others {
        let bytes = snapshot.bytes.clone();
        let through = target.call(move |w| -> vlm_runtime::Result<(i32, Vec<u8>)> {
            w.ctx.seq_restore(0, &bytes)?;
            let pos_max = w.ctx.seq_pos_max(0);
            let again = w.ctx.seq_snapshot(0)?;
            w.ctx.seq_clear(0);
            Ok((pos_max, again))
        })??;
        let (last_position, via) = through;
        let original = snapshot.bytes.clone();
        let (direct, back) = home.call(move |w| -> vlm_runtime::Result<(Vec<u8>, Vec<u8>)> {
            // Back on the first engine in another sequence (its own holds the stream), compared
            // with the original restored into that same sequence.
            let mut as_seq_1 = |bytes: &[u8]| -> vlm_runtime::Result<Vec<u8>> {
                w.ctx.seq_restore(1, bytes)?;
                let again = w.ctx.seq_snapshot(1)?;
                w.ctx.seq_clear(1);
                Ok(again)
            };
            Ok((as_seq_1(&original)?, as_seq_1(&via)?))
        })??;
        let identical = back == direct;
        println!(
            "round trip {home} -> {target} -> {home}: {} bytes, positions 0..={last_position} (expected {}), byte-identical: {identical}",
            back.len(),
            version.end - 1,
            home = home.name(),
            target = target.name(),
        );
        round_trips.push(serde_json::json!({"through": target.name(), "bytes": back.len(), "identical": identical,
            "last_position": last_position, "expected_last_position": version.end - 1}));
    }
    let mut rows = vec![];
    println!(
        "{:<8} {:<40} {:>7} {:>9} {:>12} {:>12}",
        "engine", "question", "agree", "diverge@", "mixed ms", "reference ms"
    );
    for target in others {
        for q in QUESTIONS {
            let question = |id: &str| Question {
                id: id.into(),
                text: q.into(),
                max_tokens: args.tokens,
                ignore_eos: false,
                sampling: Sampling::default(),
                arrival: Instant::now(),
            };
            let mixed = answer_on(&version, &question("mixed"), target, PreparePath::Import, &never, |_| {})?;
            let reference = answer_on(&version, &question("reference"), target, PreparePath::Replay, &never, |_| {})?;
            let tokenize = |t: &str| model.tokenize(t, false, false).unwrap_or_default();
            let (a, b) = (tokenize(&mixed.text), tokenize(&reference.text));
            let agree = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
            let diverge = if a == b { "-".to_string() } else { agree.to_string() };
            println!(
                "{:<8} {:<40} {:>3}/{:<3} {:>9} {:>12.0} {:>12.0}",
                target.name(),
                q,
                agree,
                a.len().max(b.len()),
                diverge,
                mixed.total_ms,
                reference.total_ms
            );
            rows.push(serde_json::json!({
                "engine": target.name(), "question": q, "mixed": mixed.text, "reference": reference.text,
                "agreeing_tokens": agree, "identical": a == b, "mixed_ms": mixed.total_ms, "reference_ms": reference.total_ms,
            }));
        }
    }
    // The whole history replayed on every engine (chunks of the step budget, not the short
    // question suffixes that also feed the prefill rate): its cost per cell.
    let mut replay_ms_per_cell = vec![];
    for e in &engines {
        let q = Question {
            id: "replay".into(),
            text: QUESTIONS[0].into(),
            max_tokens: 1,
            ignore_eos: false,
            sampling: Sampling::default(),
            arrival: Instant::now(),
        };
        let report = answer_on(&version, &q, e, PreparePath::Replay, &never, |_| {})?;
        replay_ms_per_cell.push(report.prepare_ms / version.cells as f64);
    }
    // A snapshot's bytes per KV cell: export and import per byte.
    let bytes_per_cell = snapshot.bytes.len() as f64 / version.cells as f64;
    println!(
        "\n{:<8} {:>16} {:>14} {:>16} {:>16} {:>16} {:>12} {:>12}",
        "engine",
        "prefill ms/tok",
        "replay ms/tok",
        "decode ms/step",
        "export ms/tok",
        "import ms/tok",
        "export MB/s",
        "import MB/s"
    );
    let mut rates = vec![];
    for (e, replay) in engines.iter().zip(&replay_ms_per_cell) {
        let r = e.rates();
        let mb_s = |ms_per_token: f64| bytes_per_cell / ms_per_token / 1e3;
        println!(
            "{:<8} {:>16.2} {:>14.2} {:>16.2} {:>16.4} {:>16.4} {:>12.0} {:>12.0}",
            e.name(),
            r.prefill_ms_per_token,
            replay,
            r.decode_ms_per_step,
            r.export_ms_per_token,
            r.import_ms_per_token,
            mb_s(r.export_ms_per_token),
            mb_s(r.import_ms_per_token)
        );
        rates.push(serde_json::json!({
            "engine": e.name(), "prefill_ms_per_token": r.prefill_ms_per_token, "replay_ms_per_cell": replay, "decode_ms_per_step": r.decode_ms_per_step,
            "export_ms_per_token": r.export_ms_per_token, "import_ms_per_token": r.import_ms_per_token,
        }));
    }
    let json = serde_json::json!({"report": "fidelity-mixed-vs-reference", "engines": args.engines, "flash_attention": args.flash_attention, "history_tokens": version.end,
        "snapshot_bytes_per_cell": bytes_per_cell,
        "tokens": args.tokens, "round_trips": round_trips, "rows": rows, "rates": rates});
    println!("{json}");
    if let Some(path) = args.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    Ok(())
}
