//! Experiment: why does a stream extended while branches exist part from a fresh context with
//! llama.cpp's unified KV, and not with per-sequence KV streams?
//!
//!   cargo run -p vlm-runtime --example kv_layout -- [--tokens 32]
//!
//! For each layout, a history (prompt + 3 frames) is decoded into sequence 0, then a greedy
//! continuation of N tokens is generated in four situations and compared with a fresh context of
//! the same layout that holds nothing else:
//! - `alone`: the same context, no other sequence (control);
//! - `branches`: two answer branches copied from sequence 0 and extended by 16 tokens each first;
//! - `unrelated`: another sequence holding an unrelated text of the same length first.
//!
//! Prints agreement, the first diverging token, and the largest step-0 logit difference.

use std::sync::Arc;

use clap::Parser;

#[path = "common/mod.rs"]
mod common;
use vlm_runtime::encoder::{MtmdEncoder, Picture, PixelLayout, VisionEncoder};
use vlm_runtime::llama::{Context, ContextParams, Device, Segment, Token};
use vlm_runtime::models;
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    #[command(flatten)]
    files: common::ModelArgs,
}

fn argmax(l: &[f32]) -> Token {
    (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a))).unwrap() as Token
}

/// Decode the history into `seq`; returns its end position.
fn history(ctx: &mut Context, prompt: &Prompt, frames: &[Vec<Segment>], question: &[Token], seq: i32) -> i32 {
    ctx.decode_tokens(&prompt.prefix, 0, seq, false).unwrap();
    let mut pos = prompt.prefix.len() as i32;
    for segments in frames {
        for s in segments {
            pos = match s {
                Segment::Text(t) => {
                    ctx.decode_tokens(t, pos, seq, false).unwrap();
                    pos + t.len() as i32
                }
                Segment::Image(i) => ctx.decode_image(i, pos, seq).unwrap(),
            };
        }
    }
    ctx.decode_tokens(question, pos, seq, true).unwrap();
    pos + question.len() as i32
}

/// Greedy continuation from the current logits of `seq`; returns tokens and step-0 logits.
fn continue_greedy(ctx: &mut Context, mut pos: i32, seq: i32, n: usize) -> (Vec<Token>, Vec<f32>) {
    let first = ctx.last_logits().unwrap().to_vec();
    let mut out = vec![];
    for _ in 0..n {
        let t = argmax(ctx.last_logits().unwrap());
        out.push(t);
        ctx.decode_tokens(&[t], pos, seq, true).unwrap();
        pos += 1;
    }
    (out, first)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let model = models::model(&args.files.model, &Device::Cpu)?;
    let encoder = MtmdEncoder::new(models::projector(&args.files.mmproj, &model, false, 2, 1)?);
    let prompt = Prompt::new(&model, DEFAULT_SYSTEM_PROMPT)?;
    let frames: Vec<_> = (0..3u8)
        .map(|v| {
            let rgb: Vec<u8> = (0..64 * 48 * 3).map(|i| (i as u8).wrapping_mul(v + 3)).collect();
            encoder.encode(&Picture::packed(&rgb, 64, 48, 192, PixelLayout::Rgb)).unwrap().segments
        })
        .collect();
    let question = prompt.question_tokens(&model, "Describe what you see in detail.")?;
    let unrelated = model.tokenize(&"The quick brown fox jumps over the lazy dog. ".repeat(30), false, false)?;
    println!("{:<10} {:<10} {:>9} {:>16} {:>16}", "layout", "situation", "agree", "first diverging", "max |dlogit| @0");
    for unified in [false, true] {
        let params = |n_seq| ContextParams {
            n_ctx_per_seq: 1024,
            n_seq,
            n_batch: 512,
            threads: 2,
            kv_unified: unified.then_some(4 * 1024),
            kv_type: Default::default(),
            flash_attention: false,
        };
        let mut fresh = Context::new(Arc::clone(&model), &params(4))?;
        let end = history(&mut fresh, &prompt, &frames, &question, 0);
        let (reference, ref_logits) = continue_greedy(&mut fresh, end, 0, args.tokens);
        for situation in ["alone", "branches", "unrelated"] {
            let mut ctx = Context::new(Arc::clone(&model), &params(4))?;
            if situation == "unrelated" {
                ctx.decode_tokens(&unrelated, 0, 3, false)?;
            }
            let end = history(&mut ctx, &prompt, &frames, &question, 0);
            if situation == "branches" {
                for b in [1, 2] {
                    ctx.seq_copy_prefix(0, b, end);
                    let (_, _) = continue_greedy(&mut ctx, end, b, 16);
                }
                // The stream's own logits were overwritten: decode its last question token again.
                ctx.seq_clear(0);
                let end2 = history(&mut ctx, &prompt, &frames, &question, 0);
                assert_eq!(end, end2);
            }
            let (tokens, logits) = continue_greedy(&mut ctx, end, 0, args.tokens);
            let agree = tokens.iter().zip(&reference).take_while(|(a, b)| a == b).count();
            let diff = logits.iter().zip(&ref_logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let first = if agree == tokens.len() { "-".to_string() } else { agree.to_string() };
            println!(
                "{:<10} {:<10} {:>6}/{:<2} {:>16} {:>16.2e}",
                if unified { "unified" } else { "per-seq" },
                situation,
                agree,
                tokens.len(),
                first,
                diff
            );
        }
    }
    Ok(())
}
