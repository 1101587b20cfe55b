//! The peer: llama.cpp's own `llama-server` (built by `scripts/build-llama-server.sh` from the
//! same llama.cpp source as the runtime), fed the same pictures as PNG images with the same
//! projector. One slot per stream (`-np S`, each stream's questions pinned to its slot with
//! `id_slot`), prompt caching on, each question sent at its arrival time from its own thread,
//! streamed, with `ignore_eos` and the same exact length.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Value, json};
use vlm_runtime::prompt::DEFAULT_SYSTEM_PROMPT;

use crate::record::{AnswerRecord, Config, RunRecord};
use crate::workload::{Workload, ms, peak_rss_kib, picture, question_text, sleep_until};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The media marker pinned through `LLAMA_MEDIA_MARKER` (newer servers draw a random one).
pub const MEDIA_MARKER: &str = "<__media__>";

pub struct PeerSettings {
    pub server: PathBuf,
    pub threads: usize,
    /// Extra arguments for the server (e.g. `-ngl 99` with a GPU build).
    pub args: Vec<String>,
    /// Folder of the server's logs (one a round).
    pub logs: PathBuf,
    /// Longest one request may take.
    pub timeout: Duration,
}

/// The server process; killed when dropped.
struct Server {
    child: Child,
    base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder().timeout_global(Some(timeout)).build().into()
}

/// A picture as a PNG `data:` URL.
pub fn png_data_url(rgb: &[u8], width: u32, height: u32) -> Result<String, BoxError> {
    let mut bytes = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut bytes, width, height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(rgb)?;
        writer.finish()?;
    }
    Ok(format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes)))
}

fn start(settings: &PeerSettings, w: &Workload, round: usize) -> Result<Server, BoxError> {
    let port = free_port()?;
    let log_path = settings.logs.join(format!("round{}-PEER.log", round + 1));
    let per_slot = w.context.max((256 + w.frames as u32 * 128 + w.tokens).next_power_of_two());
    let log = File::create(&log_path)?;
    let child = Command::new(&settings.server)
        .env("LLAMA_MEDIA_MARKER", MEDIA_MARKER)
        .args(["-m".as_ref(), w.model.as_os_str(), "--mmproj".as_ref(), w.mmproj.as_os_str()])
        .args(["-np".to_owned(), w.streams.to_string(), "-c".into(), (per_slot as usize * w.streams).to_string()])
        .args(["-t".to_owned(), settings.threads.to_string(), "-tb".into(), settings.threads.to_string()])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(&settings.args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", settings.server.display()))?;
    let mut server = Server { child, base: format!("http://127.0.0.1:{port}") };
    let deadline = Instant::now() + Duration::from_secs(300);
    let health = agent(Duration::from_secs(5));
    loop {
        if let Some(status) = server.child.try_wait()? {
            return Err(format!("llama-server exited ({status}); see {}", log_path.display()).into());
        }
        if health.get(format!("{}/health", server.base)).call().is_ok() {
            return Ok(server);
        }
        if Instant::now() > deadline {
            return Err(format!("llama-server not healthy after 300 s; see {}", log_path.display()).into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn request_body(images: &[Arc<String>], question: &str, slot: usize, tokens: u32, stream: bool) -> String {
    let mut content: Vec<Value> =
        images.iter().map(|url| json!({"type": "image_url", "image_url": {"url": url.as_str()}})).collect();
    content.push(json!({"type": "text", "text": question}));
    json!({
        "messages": [
            {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
            {"role": "user", "content": content},
        ],
        "max_tokens": tokens,
        "n_predict": tokens,
        "ignore_eos": true,
        "cache_prompt": true,
        "id_slot": slot,
        "temperature": 0.0,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
    .to_string()
}

/// What one streamed answer measured, from its arrival.
struct Streamed {
    ttft_ms: f64,
    total_ms: f64,
    tokens: u32,
}

/// Send one chat completion and read its event stream. The first token is the first event that
/// carries a choice (the server sends the assistant's role with the first generated token).
fn ask(agent: &ureq::Agent, base: &str, body: String, arrival: Instant) -> Result<Streamed, BoxError> {
    let response =
        agent.post(format!("{base}/v1/chat/completions")).header("Content-Type", "application/json").send(body)?;
    let reader = BufReader::new(response.into_body().into_reader());
    let (mut first, mut pieces, mut usage) = (None, 0u32, None);
    for line in reader.lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data:").map(str::trim) else { continue };
        if data == "[DONE]" {
            break;
        }
        let event: Value = serde_json::from_str(data)?;
        if let Some(e) = event.get("error") {
            return Err(format!("llama-server: {e}").into());
        }
        if let Some(n) = event.pointer("/usage/completion_tokens").and_then(Value::as_u64) {
            usage = Some(n as u32);
        }
        let Some(choice) = event.pointer("/choices/0") else { continue };
        first.get_or_insert_with(Instant::now);
        if choice.pointer("/delta/content").and_then(Value::as_str).is_some_and(|c| !c.is_empty()) {
            pieces += 1;
        }
    }
    let end = Instant::now();
    let first = first.ok_or("the answer streamed no token")?;
    Ok(Streamed { ttft_ms: ms(first - arrival), total_ms: ms(end - arrival), tokens: usage.unwrap_or(pieces) })
}

/// Start the server, warm it up, run the window and stop it: one round of the peer.
pub fn run_round(
    settings: &PeerSettings,
    w: &Workload,
    round: usize,
    on_answer: &(dyn Fn(&AnswerRecord) + Sync),
) -> RunRecord {
    let mut record = RunRecord {
        config: Config::Peer,
        round,
        processes: 1,
        load_ms: 0.0,
        peak_rss_kib: 0,
        window_ms: 0.0,
        answers: vec![],
        decode_split: None,
        lag: None,
        error: None,
    };
    if let Err(e) = run(settings, w, round, on_answer, &mut record) {
        record.error = Some(e.to_string());
    }
    record
}

fn run(
    settings: &PeerSettings,
    w: &Workload,
    round: usize,
    on_answer: &(dyn Fn(&AnswerRecord) + Sync),
    record: &mut RunRecord,
) -> Result<(), BoxError> {
    let loading = Instant::now();
    let server = start(settings, w, round)?;
    // Warm-up on every slot (one picture, one token), outside the window.
    let warm = Arc::new(png_data_url(&picture(99, 0, w.width, w.height), w.width, w.height)?);
    let agent = agent(settings.timeout);
    for slot in 0..w.streams {
        let body = request_body(std::slice::from_ref(&warm), "Hello", slot, 1, false);
        agent
            .post(format!("{}/v1/chat/completions", server.base))
            .header("Content-Type", "application/json")
            .send(body)?
            .into_body()
            .read_to_string()?;
    }
    record.load_ms = ms(loading.elapsed());

    let t0 = Instant::now() + Duration::from_millis(200);
    let answers = Mutex::new(vec![]);
    let last_end = Mutex::new(t0);
    std::thread::scope(|scope| {
        for gs in 0..w.streams {
            let (answers, last_end, agent, base) = (&answers, &last_end, &agent, server.base.as_str());
            scope.spawn(move || {
                let mut images: Vec<Arc<String>> = vec![];
                for number in 1..=w.frames {
                    sleep_until(w.frame_due(t0, number));
                    match png_data_url(&picture(gs, number, w.width, w.height), w.width, w.height) {
                        Ok(url) => images.push(Arc::new(url)),
                        Err(e) => {
                            eprintln!("peer: stream {gs}, frame {number}: {e}");
                            break;
                        }
                    }
                    for (index, _) in w.ask_after.iter().enumerate().filter(|(_, a)| **a == number) {
                        let images = images.clone();
                        scope.spawn(move || {
                            let arrival = Instant::now();
                            let body = request_body(&images, question_text(index), gs, w.tokens, true);
                            let result = ask(agent, base, body, arrival);
                            let end = Instant::now();
                            let mut answer = AnswerRecord {
                                engine: Some("llama-server".into()),
                                frames: images.len() as u64,
                                ..AnswerRecord::asked(gs, index, number, ms(arrival - t0), ms(end - arrival))
                            };
                            match result {
                                Ok(s) => {
                                    answer.ttft_ms = s.ttft_ms;
                                    answer.total_ms = s.total_ms;
                                    answer.tokens = s.tokens;
                                }
                                Err(e) => answer.error = Some(e.to_string()),
                            }
                            on_answer(&answer);
                            answers.lock().expect("no panics hold it").push(answer);
                            let mut last = last_end.lock().expect("no panics hold it");
                            *last = (*last).max(end);
                        });
                    }
                }
            });
        }
    });
    record.window_ms = ms(*last_end.lock().expect("no panics hold it") - t0);
    record.answers = answers.into_inner().expect("no panics hold it");
    record.peak_rss_kib = peak_rss_kib(Some(server.child.id())).unwrap_or(0);
    drop(server);
    Ok(())
}

/// The server binary: the given path, else the build script's CPU build in its default cache.
pub fn find_server(given: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = given {
        return Some(p.to_owned());
    }
    let cache = std::env::var_os("PEER_CACHE").map_or_else(|| PathBuf::from("/var/tmp/gst-vlm-peer"), PathBuf::from);
    let built = cache.join("11434.0.0/build-cpu/bin/llama-server");
    built.is_file().then_some(built)
}
