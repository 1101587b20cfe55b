//! Benchmark: the KV element types (`vlmcontext kv-type`) side by side on one model: bytes per
//! cell, prefill and decode time, and agreement of greedy answers with f16's (first diverging
//! token over fixed questions, as fidelity (c) is published). Flash attention on for all (llama.cpp
//! quantizes V only with it).
//!
//!   cargo run -p vlm-runtime --example kv_types -- [--frames 8] [--tokens 32] [--json FILE]
//!
//! Each type gets its own engine (one at a time, so they do not share the cores); the history
//! (prompt + N frames) is ingested, then each question is answered greedily for exactly
//! `--tokens` tokens. Times are the engine's own measured rates after the run.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use clap::Parser;

#[path = "common/mod.rs"]
mod common;
use vlm_runtime::encoder::{MtmdEncoder, Picture, PixelLayout, VisionEncoder};
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::{Device, Engine, EngineConfig, KvType, Question, Sampling, Stream, StreamConfig, answer, models};

#[derive(Parser)]
struct Args {
    /// Frames of history before the questions.
    #[arg(long, default_value_t = 8)]
    frames: usize,
    /// Tokens per answer (end-of-generation ignored).
    #[arg(long, default_value_t = 32)]
    tokens: u32,
    /// Picture size WIDTHxHEIGHT (a real projector tiles larger pictures into more tokens).
    #[arg(long, default_value = "64x48")]
    size: String,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    #[command(flatten)]
    files: common::ModelArgs,
}

const QUESTIONS: [&str; 4] =
    ["What is in the picture?", "Describe the colours.", "What changed?", "Is anything moving? Answer in detail."];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let (w, h) =
        args.size.split_once('x').and_then(|(w, h)| Some((w.parse().ok()?, h.parse().ok()?))).ok_or("--size")?;
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get() as i32);
    let model = models::model(&args.files.model, &Device::Cpu)?;
    let encoder = MtmdEncoder::new(models::projector(&args.files.mmproj, &model, false, threads, 1)?);
    let frames: Vec<_> = (0..args.frames)
        .map(|v| {
            let rgb: Vec<u8> =
                (0..w * h * 3).map(|i: u32| (i / 3 % w * 4 + i / 3 / w * 3 + v as u32 * 29) as u8).collect();
            encoder.encode(&Picture::packed(&rgb, w, h, w as usize * 3, PixelLayout::Rgb)).map(Arc::new)
        })
        .collect::<Result<_, _>>()?;
    let cells = frames.iter().map(|f| f.cells()).sum::<i32>() as u32 + 512;
    let never = Arc::new(AtomicBool::new(false));
    let mut reference: Vec<Vec<i32>> = vec![];
    let mut rows = vec![];
    println!(
        "{:<6} {:>10} {:>14} {:>14} {:>12} {:>22}",
        "type", "B/cell", "prefill ms/tok", "decode ms/step", "ingest ms", "agreement with f16"
    );
    for kv_type in KvType::ALL {
        let config = EngineConfig {
            context_per_sequence: cells.next_power_of_two(),
            max_streams: 1,
            max_branches: 1,
            threads,
            flash_attention: true,
            kv_type,
            ..EngineConfig::default()
        };
        let engine = Engine::start(&args.files.model, config)?;
        let prompt = Arc::new(Prompt::new(engine.model(), DEFAULT_SYSTEM_PROMPT)?);
        let stream = Stream::open(&engine, prompt, StreamConfig { answer_reserve: 128, ..StreamConfig::new("s") })?;
        let t = Instant::now();
        for f in &frames {
            stream.register(Arc::clone(f), &never)?;
        }
        let version = stream.wait_version(frames.len() as u64, &never)?;
        let ingest_ms = t.elapsed().as_secs_f64() * 1e3;
        let mut answers = vec![];
        for q in QUESTIONS {
            let question = Question {
                id: q.into(),
                text: q.into(),
                max_tokens: args.tokens,
                ignore_eos: true,
                sampling: Sampling::default(),
                arrival: Instant::now(),
            };
            answers.push(answer(&version, &question, &never, |_| {})?.token_ids);
        }
        if reference.is_empty() {
            reference = answers.clone();
        }
        // Per question: how many leading greedy tokens equal f16's.
        let agree: Vec<usize> =
            answers.iter().zip(&reference).map(|(a, r)| a.iter().zip(r).take_while(|(x, y)| x == y).count()).collect();
        let rates = engine.rates();
        let cell_bytes = engine.kv_memory().cell_bytes;
        println!(
            "{:<6} {:>10} {:>14.3} {:>14.2} {:>12.0} {:>22}",
            kv_type.name(),
            cell_bytes,
            rates.prefill_ms_per_token,
            rates.decode_ms_per_step,
            ingest_ms,
            format!("{agree:?} of {}", args.tokens)
        );
        rows.push(serde_json::json!({
            "kv_type": kv_type.name(), "cell_bytes": cell_bytes, "prefill_ms_per_token": rates.prefill_ms_per_token,
            "decode_ms_per_step": rates.decode_ms_per_step, "ingest_ms": ingest_ms, "agreeing_tokens": agree,
        }));
        stream.close();
        engine.stop();
    }
    let json = serde_json::json!({
        "example": "kv_types", "model": args.files.model, "mmproj": args.files.mmproj, "frames": args.frames,
        "history_cells": cells - 512, "tokens": args.tokens, "questions": QUESTIONS, "threads": threads, "rows": rows,
    });
    println!("{json}");
    if let Some(path) = args.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    Ok(())
}
