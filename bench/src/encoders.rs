//! `vlm-bench encoders`: vision encoding throughput against the number of libmtmd encoder
//! contexts (`vlmencode encoder-contexts`) and of streams encoding at once. Each stream is a
//! thread that encodes its own pictures back to back, as a `vlmencode` behind a source that never
//! waits; every context count runs every stream count, on one clock (the wall clock of the whole
//! level), and frames/s and tiles/s are side by side with the one-context level as the peer.
//! Each level also says the process's memory once its contexts are warm: GPU memory with a GPU
//! encoder, resident memory with a CPU one (the contexts of a projector share its weights and
//! each adds its compute buffers).

use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use serde::Serialize;
use vlm_runtime::encoder::{MtmdEncoder, Picture, PixelLayout, Rgb, VisionEncoder};
use vlm_runtime::llama::Turn;
use vlm_runtime::{Device, models};

use crate::workload::{picture, rss_kib};
use crate::{BoxError, CommonArgs};

#[derive(Args)]
pub struct EncodersArgs {
    /// Encoder contexts to try, ascending (one projector gains contexts as the levels grow).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    contexts: Vec<usize>,
    /// Streams encoding at once.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    streams: Vec<usize>,
    /// Frames each stream encodes per level (after one warm-up frame each).
    #[arg(long, default_value_t = 8)]
    frames: usize,
    /// A seconds-long run for CI: contexts 1,2, streams 1,2, 2 frames.
    #[arg(long)]
    smoke: bool,
    #[command(flatten)]
    common: CommonArgs,
}

/// One level: `contexts` contexts, `streams` streams, each encoding `frames` frames.
#[derive(Debug, Serialize)]
struct Level {
    contexts: usize,
    streams: usize,
    frames: usize,
    /// Images (tiles) encoded in all.
    tiles: usize,
    wall_ms: f64,
    frames_per_s: f64,
    tiles_per_s: f64,
    /// A frame's encode call, mean and p95 (ms).
    encode_mean_ms: f64,
    encode_p95_ms: f64,
    /// Of the mean: the picture prepared on the CPU, and waiting for an encoder context (ms).
    prepare_mean_ms: f64,
    wait_mean_ms: f64,
    /// frames/s over the one-context level's at the same stream count.
    speedup: Option<f64>,
    /// The process's memory after the level (MiB): GPU memory (`nvidia-smi`) with a GPU
    /// encoder, else resident memory (VmRSS).
    memory_mib: Option<u64>,
}

pub fn run(mut a: EncodersArgs) -> Result<(), BoxError> {
    if a.smoke {
        (a.contexts, a.streams, a.frames) = (vec![1, 2], vec![1, 2], 2);
    }
    if a.contexts.is_empty()
        || a.streams.is_empty()
        || a.frames == 0
        || a.contexts.contains(&0)
        || a.streams.contains(&0)
    {
        return Err("--contexts, --streams and --frames must be positive".into());
    }
    if a.contexts.windows(2).any(|w| w[0] >= w[1]) {
        return Err("--contexts must be ascending".into());
    }
    crate::resolve_pair(&mut a.common)?;
    let w = crate::build_workload(&a.common, 1, 1, 1.0, vec![1], 1)?;
    let model = models::model(&w.model, &Device::Cpu)?;
    let projector = models::projector(&w.mmproj, &model, w.encoder_gpu, w.encoder_threads as i32, a.contexts[0])?;
    if let Some(threads) = w.prepare_threads {
        projector.set_prepare_threads(threads);
    }
    let encoder = MtmdEncoder::new(Arc::clone(&projector));
    let encode_rgb =
        |rgb: &[u8]| encoder.encode(&Picture::packed(rgb, w.width, w.height, w.width as usize * 3, PixelLayout::Rgb));
    let encode = |stream: usize, frame: usize| encode_rgb(&picture(stream, frame, w.width, w.height));
    let encoder_ref = &encoder;
    let images = |frame: &vlm_runtime::Frame| {
        frame.segments.iter().filter(|s| matches!(s, vlm_runtime::llama::Segment::Image(_))).count()
    };
    let tiles_a_frame = images(&encode(0, 0)?);
    eprintln!(
        "vlm-bench encoders: {} ({}), {}x{} pictures of {tiles_a_frame} images, {} encoder, {} frames a stream",
        w.mmproj.display(),
        encoder.id(),
        w.width,
        w.height,
        if w.encoder_gpu { "GPU" } else { "CPU" },
        a.frames
    );
    let mut levels: Vec<Level> = vec![];
    for &contexts in &a.contexts {
        projector.ensure_contexts(contexts, w.encoder_threads as i32)?;
        for &streams in &a.streams {
            // Warm every context (its first encode of this size allocates its buffers).
            std::thread::scope(|s| {
                for stream in 0..contexts.max(streams) {
                    s.spawn(move || encode(stream, 1));
                }
            });
            let started = Instant::now();
            type Stream = (Vec<f64>, usize, f64, f64);
            let results: Vec<Result<Stream, String>> = std::thread::scope(|s| {
                let threads: Vec<_> = (0..streams)
                    .map(|stream| {
                        s.spawn(move || {
                            let (mut times, mut tiles, mut prepare_ms, mut wait_ms) = (vec![], 0, 0.0, 0.0);
                            for frame in 0..a.frames {
                                let rgb = Rgb {
                                    data: picture(stream, 2 + frame, w.width, w.height),
                                    width: w.width,
                                    height: w.height,
                                };
                                let t = Instant::now();
                                let (_, count) = encoder_ref
                                    .encode_rgb_tiles(&rgb, &mut |_, _| None, Turn::default())
                                    .map_err(|e| e.to_string())?;
                                times.push(t.elapsed().as_secs_f64() * 1e3);
                                tiles += count.encoded;
                                prepare_ms += count.prepare_ms;
                                wait_ms += count.wait_ms;
                            }
                            Ok((times, tiles, prepare_ms, wait_ms))
                        })
                    })
                    .collect();
                threads.into_iter().map(|t| t.join().unwrap_or_else(|_| Err("an encode panicked".into()))).collect()
            });
            let wall_ms = started.elapsed().as_secs_f64() * 1e3;
            let (mut times, mut tiles, mut prepare_ms, mut wait_ms) = (vec![], 0, 0.0, 0.0);
            for r in results {
                let (t, n, p, wt) = r?;
                times.extend(t);
                tiles += n;
                prepare_ms += p;
                wait_ms += wt;
            }
            times.sort_by(f64::total_cmp);
            let frames = times.len();
            let frames_per_s = frames as f64 / wall_ms * 1e3;
            let speedup = levels
                .iter()
                .find(|l| l.contexts == a.contexts[0] && l.streams == streams)
                .map(|one| frames_per_s / one.frames_per_s);
            let level = Level {
                contexts,
                streams,
                frames,
                tiles,
                wall_ms,
                frames_per_s,
                tiles_per_s: tiles as f64 / wall_ms * 1e3,
                encode_mean_ms: times.iter().sum::<f64>() / frames as f64,
                encode_p95_ms: times[((frames as f64 * 0.95).ceil() as usize).clamp(1, frames) - 1],
                prepare_mean_ms: prepare_ms / frames as f64,
                wait_mean_ms: wait_ms / frames as f64,
                speedup,
                memory_mib: if w.encoder_gpu { crate::gpu_memory::own_mib() } else { rss_kib().map(|k| k / 1024) },
            };
            eprintln!(
                "contexts {contexts:>2}, streams {streams:>3}: {:.2} frames/s, {:.1} tiles/s, encode {:.0} ms mean \
                 (prepared {:.0}, waited {:.0}), {:.0} ms p95",
                level.frames_per_s,
                level.tiles_per_s,
                level.encode_mean_ms,
                level.prepare_mean_ms,
                level.wait_mean_ms,
                level.encode_p95_ms
            );
            levels.push(level);
        }
    }
    let mut table = format!(
        "Vision encoding throughput (clock: wall time of each level; peer: {} context(s) at the same streams)\n\n\
         | contexts | streams | frames/s | tiles/s | encode mean ms | of which prepared / waiting | encode p95 ms | x {} context(s) | {} MiB |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        a.contexts[0],
        a.contexts[0],
        if w.encoder_gpu { "GPU memory" } else { "resident" }
    );
    for l in &levels {
        table.push_str(&format!(
            "| {} | {} | {:.2} | {:.1} | {:.0} | {:.0} / {:.0} | {:.0} | {} | {} |\n",
            l.contexts,
            l.streams,
            l.frames_per_s,
            l.tiles_per_s,
            l.encode_mean_ms,
            l.prepare_mean_ms,
            l.wait_mean_ms,
            l.encode_p95_ms,
            l.speedup.map_or("-".into(), |s| format!("{s:.2}")),
            l.memory_mib.map_or("-".into(), |m| m.to_string())
        ));
    }
    eprintln!("\n{table}");
    let json = serde_json::json!({
        "kind": "encoders",
        "mmproj": w.mmproj,
        "model": w.model,
        "encoder": if w.encoder_gpu { "gpu" } else { "cpu" },
        "encoder_threads": w.encoder_threads,
        "picture": format!("{}x{}", w.width, w.height),
        "tiles_a_frame": tiles_a_frame,
        "frames_a_stream": a.frames,
        "levels": levels,
        "table": table,
    });
    crate::publish(&a.common, json, |_| Ok(vec![]))
}
