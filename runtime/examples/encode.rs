//! Benchmark: vision encoding per frame (preprocessing + libmtmd encode) by input format and
//! size, against the cost of an embedding-cache hit (preprocess + hash), side by side in one run.
//!
//!   cargo run -p vlm-runtime --example encode -- [--frames 20]
//!
//! Prints a table and one JSON object.

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;

#[path = "common/mod.rs"]
mod common;
use vlm_runtime::encoder::{FrameEncoder, MtmdEncoder, Picture, PixelFormat, PixelLayout, YuvMatrix};
use vlm_runtime::{Device, models};

#[derive(Parser)]
struct Args {
    /// Distinct frames encoded per format and size.
    #[arg(long, default_value_t = 20)]
    frames: usize,
    #[command(flatten)]
    files: common::ModelArgs,
}

/// Planes of a synthetic picture in `format`.
fn planes(format: &str, w: usize, h: usize, variant: usize) -> Planes {
    let px = |x: usize, y: usize| ((x * 3 + y * 5 + variant * 7) % 256) as u8;
    let (cw, ch) = (w.div_ceil(2), h.div_ceil(2));
    match format {
        "RGB" => {
            let data = (0..h).flat_map(|y| (0..w).flat_map(move |x| [px(x, y), px(y, x), px(x + y, 0)])).collect();
            (vec![data], [w * 3, 0, 0], PixelFormat::Packed(PixelLayout::Rgb))
        }
        "BGRx" => {
            let data = (0..h).flat_map(|y| (0..w).flat_map(move |x| [px(x + y, 0), px(y, x), px(x, y), 0])).collect();
            (vec![data], [w * 4, 0, 0], PixelFormat::Packed(PixelLayout::Bgrx))
        }
        "NV12" => {
            let luma = (0..h).flat_map(|y| (0..w).map(move |x| px(x, y))).collect();
            let chroma = (0..ch).flat_map(|y| (0..cw).flat_map(move |x| [px(x, y), px(y, x)])).collect();
            (vec![luma, chroma], [w, cw * 2, 0], PixelFormat::Nv12(YuvMatrix::Bt601Limited))
        }
        _ => {
            let luma = (0..h).flat_map(|y| (0..w).map(move |x| px(x, y))).collect();
            let u = (0..ch).flat_map(|y| (0..cw).map(move |x| px(x, y))).collect();
            let v = (0..ch).flat_map(|y| (0..cw).map(move |x| px(y, x))).collect();
            (vec![luma, u, v], [w, cw, cw], PixelFormat::I420(YuvMatrix::Bt601Limited))
        }
    }
}

type Planes = (Vec<Vec<u8>>, [usize; 3], PixelFormat);

fn picture((p, strides, format): &Planes, w: usize, h: usize) -> Picture<'_> {
    Picture {
        planes: [&p[0], p.get(1).map_or(&[][..], |v| v), p.get(2).map_or(&[][..], |v| v)],
        strides: *strides,
        width: w as u32,
        height: h as u32,
        format: *format,
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let model = models::model(&args.files.model, &Device::Cpu)?;
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get() as i32);
    let mtmd = Arc::new(MtmdEncoder::new(models::projector(&args.files.mmproj, &model, false, threads, 1)?));
    let mut rows = vec![];
    println!("{:<6} {:>10} {:>12} {:>14} {:>8}", "format", "size", "encode ms", "cache hit ms", "ratio");
    for (w, h) in [(320usize, 240usize), (640, 480), (1280, 720)] {
        for format in ["RGB", "BGRx", "NV12", "I420"] {
            let encoder = FrameEncoder::new(Arc::clone(&mtmd) as _, args.frames, 1 << 30);
            let inputs: Vec<_> = (0..args.frames).map(|v| planes(format, w, h, v)).collect();
            let (mut miss, mut hit) = (vec![], vec![]);
            for input in &inputs {
                let t = Instant::now();
                let (_, was_hit) = encoder.encode(&picture(input, w, h))?;
                assert!(!was_hit);
                miss.push(t.elapsed().as_secs_f64() * 1e3);
                let t = Instant::now();
                let (_, was_hit) = encoder.encode(&picture(input, w, h))?;
                assert!(was_hit);
                hit.push(t.elapsed().as_secs_f64() * 1e3);
            }
            miss.sort_by(f64::total_cmp);
            hit.sort_by(f64::total_cmp);
            let (m, c) = (miss[miss.len() / 2], hit[hit.len() / 2]);
            println!("{format:<6} {:>10} {m:>12.2} {c:>14.3} {:>8.1}", format!("{w}x{h}"), m / c);
            rows.push(serde_json::json!({"format": format, "width": w, "height": h, "encode_median_ms": m,
                "cache_hit_median_ms": c, "encode_ms": miss, "cache_hit_ms": hit}));
        }
    }
    println!(
        "{}",
        serde_json::json!({"benchmark": "vision-encode", "mmproj": args.files.mmproj, "threads": threads, "rows": rows})
    );
    Ok(())
}
