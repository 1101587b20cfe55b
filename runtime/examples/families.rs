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
//!    beside the runtime's.
//!
//!   cargo run -p vlm-runtime --example families -- [--family all|idefics3|qwen2vl|gemma3] [--frames 2] [--tokens 8]
//!
//! `--family all` (the default) runs every family in a child process of its own, so that a
//! llama.cpp abort (`GGML_ASSERT`) in one does not hide the others, and reports each exit status.
//! `VLM_MODEL` / `VLM_MMPROJ` (or `--model` / `--mmproj`) replace one family's pair; the default is
//! `models/test-<family>-lm.gguf` and `models/test-<family>-mmproj.gguf`.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr::{NonNull, null_mut};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use clap::Parser;
use llama_cpp_sys_2 as sys;

use vlm_runtime::encoder::{MtmdEncoder, Picture, PixelLayout, VisionEncoder};
use vlm_runtime::llama::{LogLevel, Segment, Token};
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

/// A deterministic 64x48 RGB picture; different `variant`s give different pictures.
fn picture(variant: u32) -> Vec<u8> {
    let (w, h) = (64u32, 48u32);
    let mut v = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            let on = ((x + variant * 7) / 8 + y / 8).is_multiple_of(2);
            v.extend_from_slice(&[(x * 4) as u8, (y * 5) as u8, if on { 230 } else { (20 + 30 * variant) as u8 }]);
        }
    }
    v
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
    let encoder = MtmdEncoder::new(models::projector(&mmproj, &model, false, threads)?);
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
    let marker = unsafe { CStr::from_ptr(sys::mtmd_default_marker()) }.to_str()?.to_owned();
    let frames_text = marker.repeat(args.frames as usize);
    let full = model.apply_chat_template(
        &[("system", DEFAULT_SYSTEM_PROMPT), ("user", &format!("{frames_text}\n{QUESTION}"))],
        true,
    )?;
    let history_end = full.rfind(&marker).map(|i| i + marker.len()).ok_or("the template dropped the frames")?;
    let pictures: Vec<Vec<u8>> = (0..args.frames).map(picture).collect();
    let history = reference.chunks(&full[..history_end], &pictures)?;
    println!("[mtmd] history prompt: {} chunks, mtmd_helper_get_n_pos = {}", history.len(), history.n_pos());
    let whole = reference.chunks(&full, &pictures)?;
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

/// The pair loaded a second time directly through llama-cpp-sys-2, to run libmtmd's helper on
/// its own context.
struct Reference {
    model: NonNull<sys::llama_model>,
    mtmd: NonNull<sys::mtmd_context>,
    threads: i32,
}

/// Chunks of one tokenized prompt (freed on drop).
struct Chunks(NonNull<sys::mtmd_input_chunks>);

impl Drop for Chunks {
    fn drop(&mut self) {
        // SAFETY: owned chunks from mtmd_input_chunks_init, not used after this.
        unsafe { sys::mtmd_input_chunks_free(self.0.as_ptr()) }
    }
}

impl Chunks {
    fn len(&self) -> usize {
        // SAFETY: valid chunks.
        unsafe { sys::mtmd_input_chunks_size(self.0.as_ptr()) }
    }

    fn n_pos(&self) -> i32 {
        // SAFETY: valid chunks.
        unsafe { sys::mtmd_helper_get_n_pos(self.0.as_ptr()) }
    }

    fn describe(&self, reference: &Reference) -> Vec<String> {
        let mut lines = vec![];
        let mut pos = 0;
        for i in 0..self.len() {
            // SAFETY: i < size; the chunk and its token buffer live as long as self.
            unsafe {
                let c = sys::mtmd_input_chunks_get(self.0.as_ptr(), i);
                let n_pos = sys::mtmd_input_chunk_get_n_pos(c);
                if sys::mtmd_input_chunk_get_type(c) == sys::MTMD_INPUT_CHUNK_TYPE_TEXT {
                    let mut n = 0usize;
                    let p = sys::mtmd_input_chunk_get_tokens_text(c, &mut n);
                    let tokens = std::slice::from_raw_parts(p, n);
                    let text = reference.render(tokens);
                    let shown = if text.chars().count() > 60 {
                        format!("{}...", text.chars().take(57).collect::<String>())
                    } else {
                        text
                    };
                    lines.push(format!("{i:>2} text  {n:>3} tokens  pos {pos:>3}..  {shown:?}"));
                } else {
                    let rows = sys::mtmd_input_chunk_get_n_tokens(c);
                    lines.push(format!("{i:>2} image {rows:>3} rows (n_pos {n_pos:>3})  pos {pos:>3}.."));
                }
                pos += n_pos;
            }
        }
        lines
    }
}

impl Drop for Reference {
    fn drop(&mut self) {
        // SAFETY: owned; the mtmd context refers to the model, so it goes first.
        unsafe {
            sys::mtmd_free(self.mtmd.as_ptr());
            sys::llama_model_free(self.model.as_ptr());
        }
    }
}

impl Reference {
    fn load(lm: &Path, mmproj: &Path, threads: i32) -> Result<Reference, Box<dyn std::error::Error>> {
        vlm_runtime::llama::init_backend();
        let (lm_c, mmproj_c) =
            (CString::new(lm.to_str().ok_or("path")?)?, CString::new(mmproj.to_str().ok_or("path")?)?);
        // SAFETY: default params are plain data; an empty device list keeps the model on the CPU;
        // both paths are NUL-terminated and outlive the calls.
        unsafe {
            let mut mp = sys::llama_model_default_params();
            let mut devices: [sys::ggml_backend_dev_t; 1] = [null_mut()];
            mp.devices = devices.as_mut_ptr();
            mp.n_gpu_layers = 0;
            let model = NonNull::new(sys::llama_model_load_from_file(lm_c.as_ptr(), mp)).ok_or("reference model")?;
            let mut p = sys::mtmd_context_params_default();
            p.use_gpu = false;
            p.n_threads = threads;
            p.print_timings = false;
            let Some(mtmd) = NonNull::new(sys::mtmd_init_from_file(mmproj_c.as_ptr(), model.as_ptr(), p)) else {
                sys::llama_model_free(model.as_ptr());
                return Err("reference projector".into());
            };
            Ok(Reference { model, mtmd, threads })
        }
    }

    fn vocab(&self) -> *const sys::llama_vocab {
        // SAFETY: valid model.
        unsafe { sys::llama_model_get_vocab(self.model.as_ptr()) }
    }

    /// Tokens as text, special tokens with their own text.
    fn render(&self, tokens: &[Token]) -> String {
        let mut bytes = vec![];
        for &t in tokens {
            let mut buf = [0u8; 128];
            // SAFETY: buf/len describe a writable buffer.
            let n = unsafe { sys::llama_token_to_piece(self.vocab(), t, buf.as_mut_ptr().cast(), 128, 0, true) };
            bytes.extend_from_slice(&buf[..n.clamp(0, 128) as usize]);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// libmtmd's tokenization of `text` (markers replaced by `pictures`, 64x48 RGB).
    fn chunks(&self, text: &str, pictures: &[Vec<u8>]) -> Result<Chunks, Box<dyn std::error::Error>> {
        let n_markers = text.matches(unsafe { CStr::from_ptr(sys::mtmd_default_marker()) }.to_str()?).count();
        let text_c = CString::new(text)?;
        // SAFETY: bitmaps copy the pixels (64*48*3 bytes each) and are freed after tokenizing; the
        // text outlives the call; the chunks are owned by the returned value.
        unsafe {
            let bitmaps: Vec<*const sys::mtmd_bitmap> = pictures[..n_markers]
                .iter()
                .map(|rgb| sys::mtmd_bitmap_init(64, 48, rgb.as_ptr()) as *const sys::mtmd_bitmap)
                .collect();
            let chunks = NonNull::new(sys::mtmd_input_chunks_init()).ok_or("chunks")?;
            let input = sys::mtmd_input_text {
                text: text_c.as_ptr(),
                text_len: text.len(),
                add_special: true,
                parse_special: true,
            };
            let rc = sys::mtmd_tokenize(self.mtmd.as_ptr(), chunks.as_ptr(), &input, bitmaps.as_ptr(), bitmaps.len());
            for b in bitmaps {
                sys::mtmd_bitmap_free(b as *mut _);
            }
            let chunks = Chunks(chunks);
            if rc != 0 {
                return Err(format!("mtmd_tokenize failed ({rc})").into());
            }
            Ok(chunks)
        }
    }

    /// `mtmd_helper_eval_chunks` into a fresh context (what mtmd-cli does), then `n` greedy tokens.
    fn eval_and_generate(&self, chunks: &Chunks, n: u32) -> Result<(i32, Vec<Token>), Box<dyn std::error::Error>> {
        // SAFETY: the context is created from the valid model and freed before return; batches
        // are allocated for one token and freed after use; logits rows hold n_vocab floats.
        unsafe {
            let mut cp = sys::llama_context_default_params();
            cp.n_ctx = 1024;
            cp.n_batch = 512;
            cp.n_ubatch = 512;
            cp.n_seq_max = 1;
            cp.n_threads = self.threads;
            cp.n_threads_batch = self.threads;
            cp.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_DISABLED;
            let ctx = NonNull::new(sys::llama_init_from_model(self.model.as_ptr(), cp)).ok_or("reference context")?;
            let ctx = ctx.as_ptr();
            let mut n_past = 0;
            let rc =
                sys::mtmd_helper_eval_chunks(self.mtmd.as_ptr(), ctx, chunks.0.as_ptr(), 0, 0, 512, true, &mut n_past);
            let mut out = vec![];
            let result = if rc != 0 {
                Err(format!("mtmd_helper_eval_chunks failed ({rc})").into())
            } else {
                let n_vocab = sys::llama_vocab_n_tokens(self.vocab()) as usize;
                let mut error = None;
                for pos in n_past..n_past + n as i32 {
                    let logits = std::slice::from_raw_parts(sys::llama_get_logits_ith(ctx, -1), n_vocab);
                    let mut best = 0;
                    for (i, &l) in logits.iter().enumerate() {
                        if l > logits[best] {
                            best = i;
                        }
                    }
                    let token = best as Token;
                    if sys::llama_vocab_is_eog(self.vocab(), token) {
                        break;
                    }
                    out.push(token);
                    let mut b = sys::llama_batch_init(1, 0, 1);
                    *b.token = token;
                    *b.pos = pos;
                    *b.n_seq_id = 1;
                    **b.seq_id = 0;
                    *b.logits = 1;
                    b.n_tokens = 1;
                    let rc = sys::llama_decode(ctx, b);
                    sys::llama_batch_free(b);
                    if rc != 0 {
                        error = Some(format!("llama_decode failed ({rc}) at {pos}"));
                        break;
                    }
                }
                match error {
                    Some(e) => Err(e.into()),
                    None => Ok((n_past, out)),
                }
            };
            sys::llama_free(ctx);
            result
        }
    }
}
