//! Benchmark: what chunked prefill costs. A frame's worth of inputs (36 tokens, the test
//! projector's frame) prefilled in chunks of 2..36, against one decode step, side by side in one
//! run; this is what the engine's `step_budget_ms` default is chosen from (a chunk delays the
//! decode steps of active answers; smaller chunks cost more per token).
//!
//!   cargo run -p vlm-runtime --example chunks -- [--sizes 2,4,6,9,12,18,36] [--repeats 7]

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;

#[path = "common/mod.rs"]
mod common;
use vlm_runtime::llama::{Context, ContextParams};
use vlm_runtime::{Device, models};

#[derive(Parser)]
struct Args {
    #[arg(long, value_delimiter = ',', default_value = "2,4,6,9,12,18,36")]
    sizes: Vec<usize>,
    #[arg(long, default_value_t = 7)]
    repeats: usize,
    #[command(flatten)]
    files: common::ModelArgs,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get() as i32);
    let model = models::model(&args.files.model, &Device::Cpu)?;
    let params = ContextParams {
        n_ctx_per_seq: 1024,
        n_seq: 2,
        n_batch: 512,
        threads,
        kv_unified: None,
        kv_type: Default::default(),
        flash_attention: false,
    };
    let mut ctx = Context::new(Arc::clone(&model), &params)?;
    let history: Vec<i32> = (0..200).map(|i| 100 + i).collect();
    let frame: Vec<i32> = (0..36).map(|i| 400 + i).collect();
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
    // A 200-token history first, as a stream has.
    ctx.decode_tokens(&history, 0, 0, false)?;
    let mut decode = vec![];
    let mut rows = vec![];
    println!("{:>6} {:>12} {:>14} {:>12}", "chunk", "chunk ms", "ms per token", "vs 36");
    let mut per_token = vec![];
    for _ in 0..args.repeats {
        let t = Instant::now();
        ctx.decode_tokens(&[7], 200, 0, true)?;
        decode.push(ms(t));
        ctx.seq_truncate(0, 200);
    }
    for &size in &args.sizes {
        let mut chunk_ms = vec![];
        for _ in 0..args.repeats {
            let mut pos = 200;
            for part in frame.chunks(size.max(1)) {
                let t = Instant::now();
                ctx.decode_tokens(part, pos, 0, false)?;
                chunk_ms.push(ms(t) / part.len() as f64 * size as f64);
                pos += part.len() as i32;
            }
            ctx.seq_truncate(0, 200);
        }
        let c = common::median(&mut chunk_ms);
        per_token.push((size, c / size as f64));
        rows.push(serde_json::json!({"chunk": size, "chunk_ms": c, "ms_per_token": c / size as f64}));
    }
    let whole = per_token.iter().find(|(s, _)| *s == 36).map_or(f64::NAN, |(_, p)| *p);
    for (row, (size, p)) in rows.iter().zip(&per_token) {
        println!("{size:>6} {:>12.1} {p:>14.2} {:>11.2}x", row["chunk_ms"].as_f64().unwrap(), p / whole);
    }
    let d = common::median(&mut decode);
    println!("decode step (1 token): {d:.1} ms");
    println!(
        "{}",
        serde_json::json!({"benchmark": "chunked-prefill", "threads": threads, "decode_step_ms": d, "rows": rows})
    );
    Ok(())
}
