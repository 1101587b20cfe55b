//! Benchmark: a tiled (SmolVLM) projector's picture preparation on the CPU, resized and cut into
//! tiles here on 1 to N threads against libmtmd preparing it whole on the calling thread (the
//! peer), by picture size, side by side in one run. Nothing is encoded
//! (`Projector::prepare_picture`): the call is the preparation alone (resize, tiling,
//! normalisation). Clock: the call's wall time (`TileCount::prepare_ms`).
//!
//!   cargo run --release -p vlm-runtime --example prepare -- --mmproj models/timing/smolvlm-500m-mmproj.gguf \
//!       --model models/timing/smolvlm-500m-lm.gguf [--threads 0,1,2,4] [--frames 10]
//!
//! Prints a table and one JSON object.

use std::sync::Arc;

use clap::Parser;

#[path = "common/mod.rs"]
mod common;
use vlm_runtime::llama::Projector;
use vlm_runtime::{Device, models};

#[derive(Parser)]
struct Args {
    /// Resize threads to compare (0: libmtmd resizes, the peer).
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,4")]
    threads: Vec<usize>,
    /// Picture sizes, WxH.
    #[arg(long, value_delimiter = ',', default_value = "320x240,640x480,1280x720,1920x1080")]
    sizes: Vec<String>,
    /// Timed calls per size and thread count (after one warm-up), alternating thread counts.
    #[arg(long, default_value_t = 10)]
    frames: usize,
    #[command(flatten)]
    files: common::ModelArgs,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let model = models::model(&args.files.model, &Device::Cpu)?;
    // Two encoder contexts: the second prepares the tiles of a picture cut here.
    let projector = Arc::new(Projector::load(&args.files.mmproj, Arc::clone(&model), false, 2, 2)?);
    projector.set_prepare_threads(1);
    if !projector.resizes_pictures() {
        return Err(format!(
            "{} is not a tiled projector whose pictures are resized here",
            args.files.mmproj.display()
        )
        .into());
    }
    let prepare = |rgb: &[u8], w: u32, h: u32, threads: usize| -> Result<(f64, usize), Box<dyn std::error::Error>> {
        projector.set_prepare_threads(threads);
        let count = projector.prepare_picture(rgb, w, h)?;
        Ok((count.prepare_ms, count.tiles.len()))
    };
    println!(
        "| picture | images | {} |",
        args.threads.iter().map(|t| format!("{t} thread(s) ms (x libmtmd)")).collect::<Vec<_>>().join(" | ")
    );
    println!("|---|---:|{}", "---:|".repeat(args.threads.len()));
    let mut rows = vec![];
    for size in &args.sizes {
        let (w, h) = size
            .split_once('x')
            .and_then(|(w, h)| Some((w.parse::<u32>().ok()?, h.parse::<u32>().ok()?)))
            .ok_or("sizes are WxH")?;
        let rgb: Vec<u8> = (0..w * h * 3).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
        // One call each first: libmtmd prepares the first picture of a size whole, and the
        // threads' later ones are cut here.
        let mut images = 0;
        for &t in &args.threads {
            images = prepare(&rgb, w, h, t)?.1;
        }
        let mut times: Vec<Vec<f64>> = vec![vec![]; args.threads.len()];
        for _ in 0..args.frames {
            for (i, &t) in args.threads.iter().enumerate() {
                times[i].push(prepare(&rgb, w, h, t)?.0);
            }
        }
        let medians: Vec<f64> = times.iter_mut().map(|v| common::median(v)).collect();
        let peer = args.threads.iter().position(|&t| t == 0).map(|i| medians[i]);
        println!(
            "| {w}x{h} | {images} | {} |",
            medians
                .iter()
                .map(|m| match peer {
                    Some(p) => format!("{m:.1} ({:.2}x)", m / p),
                    None => format!("{m:.1}"),
                })
                .collect::<Vec<_>>()
                .join(" | ")
        );
        rows.push(serde_json::json!({"width": w, "height": h, "images": images, "threads": args.threads,
            "median_ms": medians, "times_ms": times}));
    }
    let json = serde_json::json!({
        "benchmark": "prepare", "clock": "the preparation's wall time, nothing encoded (prepare_ms)",
        "peer": "libmtmd preparing the whole picture on the calling thread (threads 0)",
        "mmproj": args.files.mmproj, "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "rows": rows,
    });
    println!("{json}");
    Ok(())
}
