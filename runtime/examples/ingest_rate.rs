//! Benchmark: how fast an engine's context ingests frames, against its batch size and the number
//! of streams whose frames go in one decode. A frame is `--rows` embedding rows (862: a 13-tile
//! SmolVLM-500M frame with its markers) prefilled after a `--history` of rows on each of
//! `--streams` sequences of a per-sequence KV context sized as an engine's (`--context` cells
//! each); for each batch size, frames are prefilled one stream at a time in chunks of the batch
//! (what the engine's scheduler does), and `k` streams' frames in one decode per chunk.
//! Prints a table (ms a frame, rows/s; the clock is this process's, around each decode) and JSON,
//! and what the engine's KV account (`Context::kv_bytes_in_use`, every 50 ms while it works)
//! costs with those histories in place.
//!
//!   cargo run -p vlm-runtime --example ingest_rate -- [--gpu] [--batches 512,1024,2048] [--together 1,2,4]

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;

#[path = "common/mod.rs"]
mod common;
use vlm_runtime::llama::{Batch, Context, ContextParams};
use vlm_runtime::{Device, models};

#[derive(Parser)]
struct Args {
    /// Run on the GPU (llama.cpp's default device).
    #[arg(long)]
    gpu: bool,
    #[arg(long, value_delimiter = ',', default_value = "512,1024,2048")]
    batches: Vec<u32>,
    /// Streams whose frames share one decode.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    together: Vec<usize>,
    #[arg(long, default_value_t = 862)]
    rows: usize,
    #[arg(long, default_value_t = 2048)]
    history: usize,
    #[arg(long, default_value_t = 8192)]
    context: u32,
    /// Sequences of the context (streams and answer branches).
    #[arg(long, default_value_t = 24)]
    sequences: u32,
    /// Frames timed per configuration (after one untimed).
    #[arg(long, default_value_t = 6)]
    frames: usize,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    #[command(flatten)]
    files: common::ModelArgs,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.history + (args.frames + 1) * args.rows > args.context as usize {
        return Err(
            format!("{} + {} frames of {} rows exceed the context", args.history, args.frames + 1, args.rows).into()
        );
    }
    let device = if args.gpu { Device::gpu() } else { Device::Cpu };
    let model = models::model(&args.files.model, &device)?;
    let width = model.n_embd();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get() as i32);
    // Rows like an image's: small values, 97 different ones in turn (made once: the timed
    // decodes only copy them into their batches, as the engine's chunks do).
    let rows: Vec<Vec<f32>> =
        (0..97).map(|i| (0..width).map(|j| ((i * 31 + j * 7) % 97) as f32 / 970.0 - 0.05).collect()).collect();
    let mut results = vec![];
    println!("clock: this process's, around each llama_decode; {} x {} rows a frame", args.rows, width);
    println!("{:>6} {:>9} {:>12} {:>10}", "batch", "together", "ms a frame", "rows/s");
    for &n_batch in &args.batches {
        let params = ContextParams {
            n_ctx_per_seq: args.context,
            n_seq: args.sequences,
            n_batch,
            threads,
            kv_unified: None,
            kv_type: Default::default(),
            flash_attention: true,
        };
        let mut ctx = Context::new(Arc::clone(&model), &params)?;
        let streams = *args.together.iter().max().unwrap_or(&1);
        for seq in 0..streams as i32 {
            prefill(&mut ctx, &rows, 0..args.history, &[seq], n_batch as usize)?;
        }
        // What the engine's KV account costs (it is refreshed every 50 ms while an engine works).
        let mut account = vec![];
        for _ in 0..5 {
            let t = Instant::now();
            std::hint::black_box(ctx.kv_bytes_in_use());
            account.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let account_ms = common::median(&mut account);
        println!("{n_batch:>6} KV account: {account_ms:.2} ms");
        for &k in &args.together {
            let seqs: Vec<i32> = (0..k as i32).collect();
            let mut ms = vec![];
            for f in 0..=args.frames {
                let start = args.history + f * args.rows;
                let t = Instant::now();
                prefill(&mut ctx, &rows, start..start + args.rows, &seqs, n_batch as usize)?;
                if f > 0 {
                    ms.push(t.elapsed().as_secs_f64() * 1e3 / k as f64);
                }
            }
            for &seq in &seqs {
                ctx.seq_truncate(seq, args.history as i32);
            }
            let frame_ms = common::median(&mut ms);
            let rows_per_s = args.rows as f64 * 1e3 / frame_ms;
            println!("{n_batch:>6} {k:>9} {frame_ms:>12.1} {rows_per_s:>10.0}");
            results.push(serde_json::json!({
                "n-batch": n_batch, "streams-together": k, "ms-a-frame": frame_ms, "rows-per-s": rows_per_s,
                "kv-account-ms": account_ms,
            }));
        }
    }
    let out = serde_json::json!({
        "benchmark": "ingest-rate", "clock": "process, around each decode", "device": if args.gpu { "gpu" } else { "cpu" },
        "model": args.files.model, "rows": args.rows, "history": args.history, "context": args.context,
        "sequences": args.sequences, "kv": "per-sequence, flash attention", "results": results,
    });
    println!("{out}");
    if let Some(path) = args.json {
        std::fs::write(path, serde_json::to_string_pretty(&out)?)?;
    }
    Ok(())
}

/// Prefill the rows `at` (positions equal to the row index) on each of `seqs`, in decodes of at
/// most `n_batch` rows, the streams' chunks of a decode side by side.
fn prefill(
    ctx: &mut Context,
    rows: &[Vec<f32>],
    at: std::ops::Range<usize>,
    seqs: &[i32],
    n_batch: usize,
) -> vlm_runtime::Result<()> {
    let per_seq = (n_batch / seqs.len()).max(1);
    let mut from = at.start;
    while from < at.end {
        let n = per_seq.min(at.end - from);
        let mut batch = Batch::embeddings(n * seqs.len(), ctx.model().n_embd());
        for &seq in seqs {
            for i in from..from + n {
                batch.push_row(&rows[i % rows.len()], i as i32, seq, false);
            }
        }
        ctx.decode(&batch)?;
        from += n;
    }
    Ok(())
}
