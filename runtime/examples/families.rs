//! Check of the generated test pairs of three VLM families (`scripts/make_test_family.py`):
//! SmolVLM (`llama` + `idefics3`), Qwen2-VL (`qwen2vl` + `qwen2vl_merger`, M-RoPE) and Gemma 3
//! (`gemma3` + `gemma3`, images decoded non-causally). For each family it
//!
//! 1. loads the model and projector through the runtime (`models::model`, `models::projector`),
//! 2. encodes one synthetic 64x48 picture with [`MtmdEncoder`] and prints the segments it becomes
//!    (text tokens, image chunks with their rows and positions),
//! 3. opens an engine and a stream, registers frames, waits for the version and answers one
//!    question greedily, printing the text and the version's `end` position,
//! 4. runs the same prompt through libmtmd's own helper (`mtmd_helper_eval_chunks`, what llama.cpp's
//!    mtmd-cli uses) on a separate llama.cpp context, and prints its `n_past` and greedy tokens
//!    beside the runtime's (`vlm_runtime::llama::reference`, the plain-libmtmd reference that
//!    `tests/families.rs` checks against too).
//!
//!   cargo run -p vlm-runtime --example families -- [--family all|idefics3|qwen2vl|gemma3] [--frames 2] [--tokens 8]
//!
//! `--family all` (the default) runs every family in a child process of its own, so that a
//! llama.cpp abort (`GGML_ASSERT`) in one does not hide the others, and reports each exit status.
//! `VLM_MODEL` / `VLM_MMPROJ` (or `--model` / `--mmproj`) replace one family's pair; the default is
//! `models/test-<family>-lm.gguf` and `models/test-<family>-mmproj.gguf`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use clap::Parser;

use vlm_runtime::encoder::{MtmdEncoder, Picture, PixelLayout, VisionEncoder};
use vlm_runtime::llama::reference::{Reference, picture};
use vlm_runtime::llama::{LogLevel, Segment};
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::{Device, Engine, EngineConfig, Question, Sampling, Stream, StreamConfig, answer, models};

const FAMILIES: [&str; 3] = ["idefics3", "qwen2vl", "gemma3"];
const QUESTION: &str = "What do you see in the video?";

#[derive(Parser)]
struct Args {
    /// `all`, or one of idefics3, qwen2vl, gemma3.
    #[arg(long, default_value = "all")]
    family: String,
    /// Language model (default: models/test-<family>-lm.gguf).
    #[arg(long, env = "VLM_MODEL")]
    model: Option<PathBuf>,
    /// Projector (default: models/test-<family>-mmproj.gguf).
    #[arg(long, env = "VLM_MMPROJ")]
    mmproj: Option<PathBuf>,
    /// Frames registered before the question.
    #[arg(long, default_value_t = 2)]
    frames: u32,
    /// Greedy tokens of the answer.
    #[arg(long, default_value_t = 8)]
    tokens: u32,
    /// Then fill a stream of an engine with this many KV cells per sequence until the history is
    /// full (it must end in `HistoryFull`, never a failed prefill; 0: skip).
    #[arg(long, default_value_t = 256)]
    fill_cells: u32,
    /// Print every line llama.cpp / libmtmd log (default: warnings and errors).
    #[arg(long)]
    verbose: bool,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.family != "all" {
        return run_family(&args);
    }
    // One child process per family: an abort in llama.cpp takes down only its own family.
    let exe = std::env::current_exe()?;
    let mut outcomes = vec![];
    for family in FAMILIES {
        println!("\n===== {family} =====");
        let mut child = std::process::Command::new(&exe);
        child.args(["--family", family, "--frames", &args.frames.to_string(), "--tokens", &args.tokens.to_string()]);
        child.args(["--fill-cells", &args.fill_cells.to_string()]);
        if args.verbose {
            child.arg("--verbose");
        }
        // A pair given for one family does not apply to the others.
        let status = child.env_remove("VLM_MODEL").env_remove("VLM_MMPROJ").status()?;
        let outcome = match (status.code(), std::os::unix::process::ExitStatusExt::signal(&status)) {
            (Some(0), _) => "ok".to_string(),
            (Some(code), _) => format!("failed (exit {code})"),
            (None, Some(6)) => "ABORTED (SIGABRT: a GGML_ASSERT / GGML_ABORT in llama.cpp, see above)".to_string(),
            (None, Some(sig)) => format!("killed by signal {sig}"),
            (None, None) => "unknown exit".to_string(),
        };
        outcomes.push((family, outcome));
    }
    println!("\n===== summary =====");
    for (family, outcome) in &outcomes {
        println!("{family:<9} {outcome}");
    }
    if outcomes.iter().any(|(_, o)| o != "ok") {
        std::process::exit(1);
    }
    Ok(())
}

fn run_family(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let family = args.family.as_str();
    if !FAMILIES.contains(&family) {
        return Err(format!("unknown family {family:?} (expected all, {})", FAMILIES.join(", ")).into());
    }
    let root = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("..");
    let lm = args.model.clone().unwrap_or_else(|| root.join(format!("models/test-{family}-lm.gguf")));
    let mmproj = args.mmproj.clone().unwrap_or_else(|| root.join(format!("models/test-{family}-mmproj.gguf")));
    let verbose = args.verbose;
    vlm_runtime::llama::set_log_sink(move |level, line| {
        if verbose || matches!(level, LogLevel::Warn | LogLevel::Error) {
            eprintln!("  [llama.cpp {level:?}] {line}");
        }
    });
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get() as i32).min(2);

    // 1. Load through the runtime.
    println!("model  {}\nmmproj {}", lm.display(), mmproj.display());
    let model = models::model(&lm, &Device::Cpu)?;
    println!("[load] model: {} (n_embd {}, vocab {})", model.description(), model.n_embd(), model.n_vocab());
    let encoder = MtmdEncoder::new(models::projector(&mmproj, &model, false, threads, 1)?);
    println!("[load] projector: ok");
    // A second, raw copy of the pair for libmtmd's own helper (the runtime keeps its pointers
    // private); also used to print tokens with their special text.
    let reference = Reference::load(&lm, &mmproj, threads)?;

    // 2. Encode one picture.
    let encode = |variant: u32| {
        let rgb = picture(variant);
        encoder.encode(&Picture::packed(&rgb, 64, 48, 64 * 3, PixelLayout::Rgb))
    };
    let t = Instant::now();
    let frame = encode(0)?;
    let first_ms = ms(t);
    let t = Instant::now();
    encode(1)?;
    println!(
        "[encode] a 64x48 frame in {first_ms:.1} ms (the next one {:.1} ms): {} segments, n_pos {}",
        ms(t),
        frame.segments.len(),
        frame.n_pos()
    );
    let mut pos = 0;
    for (i, segment) in frame.segments.iter().enumerate() {
        match segment {
            Segment::Text(tokens) => {
                println!("  {i:>2} text  {:>3} tokens  pos {pos:>3}..  {:?}", tokens.len(), reference.render(tokens));
                pos += tokens.len() as i32;
            }
            Segment::Image(image) => {
                println!(
                    "  {i:>2} image {:>3} rows x {} (n_pos {:>3})  pos {pos:>3}..",
                    image.rows, image.width, image.n_pos
                );
                pos += image.n_pos;
            }
        }
    }

    // 3. Engine + stream: register frames, wait for the version, answer.
    let config = EngineConfig {
        name: "cpu".into(),
        threads,
        context_per_sequence: 1024,
        max_streams: 1,
        max_branches: 1,
        ..EngineConfig::default()
    };
    let engine = Engine::start(&lm, config)?;
    let prompt = Arc::new(Prompt::new(engine.model(), DEFAULT_SYSTEM_PROMPT)?);
    println!("[stream] prompt prefix: {} tokens {:?}", prompt.prefix.len(), reference.render(&prompt.prefix));
    let stream =
        Stream::open(&engine, Arc::clone(&prompt), StreamConfig { answer_reserve: 64, ..StreamConfig::new(family) })?;
    let never = Arc::new(AtomicBool::new(false));
    let t = Instant::now();
    for v in 0..args.frames {
        let frame = Arc::new(encode(v)?);
        let n_pos = frame.n_pos();
        let r = stream.register(frame, &never)?;
        println!("[stream] registered frame {} (n_pos {n_pos})", r.number);
    }
    let version = stream.wait_version(args.frames as u64, &never)?;
    println!(
        "[stream] version {} published after {:.0} ms: end = {} (prefix {} + frames {})",
        version.number,
        ms(t),
        version.end,
        prompt.prefix.len(),
        version.end - prompt.prefix.len() as i32
    );
    let question = Question {
        id: family.into(),
        text: QUESTION.into(),
        max_tokens: args.tokens,
        ignore_eos: false,
        sampling: Sampling::default(),
        arrival: Instant::now(),
    };
    let suffix = prompt.question_tokens(engine.model(), QUESTION)?;
    let report = answer(&version, &question, &never, |_| {})?;
    println!(
        "[answer] {:?} ({} tokens {:?}, path {}, ttft {:.0} ms); question suffix {} tokens, so the answer starts at {}",
        report.text,
        report.tokens,
        report.token_ids,
        report.path.name(),
        report.ttft_ms,
        suffix.len(),
        version.end + suffix.len() as i32
    );

    // The answer depends on the history (a model that ignored its context would echo the same
    // tokens over any history): the same question over the first frame only.
    let shorter = answer(
        &stream.wait_version(1, &never)?,
        &Question { arrival: Instant::now(), ..question.clone() },
        &never,
        |_| {},
    )?;
    println!(
        "[answer] over frame 1 only: {:?} ({})",
        shorter.text,
        if shorter.token_ids == report.token_ids { "same tokens as over 2 frames" } else { "differs from 2 frames" }
    );

    // 4. The same prompt through libmtmd's helper.
    let history = reference.history(&model, args.frames as usize, QUESTION)?;
    println!("[mtmd] history prompt: {} chunks, mtmd_helper_get_n_pos = {}", history.len(), history.n_pos());
    let whole = reference.whole(&model, args.frames as usize, QUESTION)?;
    for line in whole.describe(&reference) {
        println!("  {line}");
    }
    let (n_past, tokens) = reference.eval_and_generate(&whole, args.tokens)?;
    println!(
        "[mtmd] mtmd_helper_eval_chunks(whole prompt): n_past = {n_past}; greedy {:?} {:?}",
        tokens,
        reference.render(&tokens)
    );
    println!(
        "[compare] history end: runtime {} / libmtmd {}; answer start: runtime {} / libmtmd {}; tokens {}",
        version.end,
        history.n_pos(),
        version.end + suffix.len() as i32,
        n_past,
        if tokens == report.token_ids { "identical" } else { "DIFFER" }
    );
    stream.close();
    if args.fill_cells > 0 {
        fill(&lm, &prompt, &Arc::new(encode(0)?), args.fill_cells, threads)?;
    }
    Ok(())
}

/// Register copies of `frame` into a stream of `cells` KV cells per sequence until the stream
/// refuses one or a prefill fails. An image takes `rows` cells but only `n_pos` positions (fewer
/// for M-RoPE): the stream plans its history in cells, so it refuses with `HistoryFull`.
fn fill(
    lm: &Path,
    prompt: &Arc<Prompt>,
    frame: &Arc<vlm_runtime::Frame>,
    cells: u32,
    threads: i32,
) -> vlm_runtime::Result<()> {
    let config = EngineConfig {
        name: "fill".into(),
        threads,
        context_per_sequence: cells,
        max_streams: 1,
        max_branches: 1,
        ..EngineConfig::default()
    };
    let engine = Engine::start(lm, config)?;
    let stream =
        Stream::open(&engine, Arc::clone(prompt), StreamConfig { answer_reserve: 0, ..StreamConfig::new("fill") })?;
    // Cells: one per text token and one per embedding row.
    let frame_cells: usize = frame
        .segments
        .iter()
        .map(|s| match s {
            Segment::Text(t) => t.len(),
            Segment::Image(i) => i.rows,
        })
        .sum();
    let never = AtomicBool::new(false);
    let (mut n, mut ended) = (0u64, String::new());
    while ended.is_empty() {
        match stream.register(Arc::clone(frame), &never) {
            Ok(r) => match stream.wait_version(r.number, &never) {
                Ok(_) => n = r.number,
                Err(e) => ended = format!("frame {} failed in prefill: {e}", r.number),
            },
            Err(e) => ended = format!("frame {} refused: {e}", n + 1),
        }
    }
    let positions = prompt.prefix.len() as i64 + n as i64 * frame.n_pos() as i64;
    let used = prompt.prefix.len() as i64 + n as i64 * frame_cells as i64;
    println!(
        "[fill] {} cells a sequence: {n} frames published ({} positions, {} cells a frame): positions {positions}, cells {used}; then {ended}",
        engine.n_ctx_per_seq(),
        frame.n_pos(),
        frame_cells
    );
    stream.close();
    Ok(())
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}
