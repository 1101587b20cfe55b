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
use crate::workload::{HistorySpec, Workload, ms, peak_rss_kib, picture, question_text, sleep_until};

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
    // Status codes are read here ([`accepted`]), so that a refusal keeps the server's reason.
    ureq::Agent::config_builder().timeout_global(Some(timeout)).http_status_as_error(false).build().into()
}

/// The response, or the server's reason when it refused the request (HTTP 4xx/5xx: its JSON
/// error, e.g. a prompt beyond the slot's context).
fn accepted(response: ureq::http::Response<ureq::Body>) -> Result<ureq::http::Response<ureq::Body>, BoxError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let reason = response.into_body().read_to_string().unwrap_or_default();
    Err(format!("llama-server: HTTP {status}: {}", reason.chars().take(400).collect::<String>()).into())
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

fn start(settings: &PeerSettings, w: &Workload, label: &str) -> Result<Server, BoxError> {
    let port = free_port()?;
    let log_path = settings.logs.join(format!("{label}-PEER.log"));
    let per_slot = w.sequence_cells();
    let log = File::create(&log_path)?;
    let child = Command::new(&settings.server)
        .env("LLAMA_MEDIA_MARKER", MEDIA_MARKER)
        .args(["-m".as_ref(), w.model.as_os_str(), "--mmproj".as_ref(), w.mmproj.as_os_str()])
        .args(["-np".to_owned(), w.streams.to_string(), "-c".into(), (per_slot as usize * w.streams).to_string()])
        .args(["-t".to_owned(), settings.threads.to_string(), "-tb".into(), settings.threads.to_string()])
        .args(["-fa", if w.flash_attention { "on" } else { "off" }])
        .args(["--cache-type-k", &w.kv_type, "--cache-type-v", &w.kv_type])
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
        if health.get(format!("{}/health", server.base)).call().is_ok_and(|r| r.status().is_success()) {
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
    let response = accepted(
        agent.post(format!("{base}/v1/chat/completions")).header("Content-Type", "application/json").send(body)?,
    )?;
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

/// Start the server, warm it up, run the window (the live workload, or the history curve) and
/// stop it: one round of the peer. `label` names the server's log.
pub fn run_round(
    settings: &PeerSettings,
    w: &Workload,
    round: usize,
    label: &str,
    history: Option<&HistorySpec>,
    on_answer: &(dyn Fn(&AnswerRecord) + Sync),
) -> RunRecord {
    let mut record = RunRecord::empty(Config::Peer, round, 1);
    if let Err(e) = run(settings, w, label, history, on_answer, &mut record) {
        record.error = Some(e.to_string());
    }
    record
}

/// What a window of the peer shares: the server, its client and what has been measured.
struct Window<'a> {
    w: &'a Workload,
    agent: ureq::Agent,
    base: String,
    t0: Instant,
    on_answer: &'a (dyn Fn(&AnswerRecord) + Sync),
    answers: Mutex<Vec<AnswerRecord>>,
    last_end: Mutex<Instant>,
}

impl Window<'_> {
    /// Send question `index` of stream `gs` over `images` (asked right after frame `after`)
    /// now, streamed and timed from its arrival; record it.
    fn ask(&self, gs: usize, index: usize, after: usize, images: &[Arc<String>], prime_ms: Option<f64>) {
        // The body (every image as a data URL) is the client's work: built before the arrival.
        let body = request_body(images, question_text(index), gs, self.w.tokens, true);
        let arrival = Instant::now();
        let result = ask(&self.agent, &self.base, body, arrival);
        let end = Instant::now();
        let mut answer = AnswerRecord {
            engine: Some("llama-server".into()),
            frames: images.len() as u64,
            prime_ms,
            ..AnswerRecord::asked(gs, index, after, ms(arrival - self.t0), ms(end - arrival))
        };
        match result {
            Ok(s) => {
                answer.ttft_ms = s.ttft_ms;
                answer.total_ms = s.total_ms;
                answer.tokens = s.tokens;
            }
            Err(e) => answer.error = Some(e.to_string()),
        }
        (self.on_answer)(&answer);
        self.answers.lock().expect("no panics hold it").push(answer);
        let mut last = self.last_end.lock().expect("no panics hold it");
        *last = (*last).max(end);
    }

    /// A one-token request over `images` on `slot`, outside the measurements (warm-up, and the
    /// history curve's priming); its text differs from every question's.
    fn prime(&self, slot: usize, images: &[Arc<String>]) -> Result<(), BoxError> {
        let body = request_body(images, "Hello", slot, 1, false);
        accepted(
            self.agent
                .post(format!("{}/v1/chat/completions", self.base))
                .header("Content-Type", "application/json")
                .send(body)?,
        )?
        .into_body()
        .read_to_string()?;
        Ok(())
    }

    /// The live workload: each stream's frames at their due times, each question sent from its
    /// own thread with all of the stream's frames so far.
    fn live(&self) {
        let w = self.w;
        std::thread::scope(|scope| {
            for gs in 0..w.streams {
                scope.spawn(move || {
                    let mut images: Vec<Arc<String>> = vec![];
                    for number in 1..=w.frames {
                        sleep_until(w.frame_due(self.t0, gs, number));
                        match png_data_url(&picture(gs, number, w.width, w.height), w.width, w.height) {
                            Ok(url) => images.push(Arc::new(url)),
                            Err(e) => {
                                eprintln!("peer: stream {gs}, frame {number}: {e}");
                                break;
                            }
                        }
                        for (index, _) in w.ask_after.iter().enumerate().filter(|(_, a)| **a == number) {
                            let images = images.clone();
                            scope.spawn(move || self.ask(gs, index, number, &images, None));
                        }
                    }
                });
            }
        });
    }

    /// The history curve on slot 0: at each point, one priming request carries the frames so
    /// far (the server reads the new ones), then `reps` questions one after another.
    fn history(&self, h: &HistorySpec) -> Result<(), BoxError> {
        let w = self.w;
        let mut images: Vec<Arc<String>> = vec![];
        for &point in &h.points {
            while images.len() < point {
                let number = images.len() + 1;
                images.push(Arc::new(png_data_url(&picture(0, number, w.width, w.height), w.width, w.height)?));
            }
            let started = Instant::now();
            self.prime(0, &images)?;
            let prime_ms = ms(started.elapsed());
            for rep in 0..h.reps {
                std::thread::sleep(Duration::from_millis(h.settle_ms));
                self.ask(0, rep, point, &images, Some(prime_ms));
            }
        }
        Ok(())
    }
}

fn run(
    settings: &PeerSettings,
    w: &Workload,
    label: &str,
    history: Option<&HistorySpec>,
    on_answer: &(dyn Fn(&AnswerRecord) + Sync),
    record: &mut RunRecord,
) -> Result<(), BoxError> {
    let loading = Instant::now();
    let server = start(settings, w, label)?;
    let mut window = Window {
        w,
        agent: agent(settings.timeout),
        base: server.base.clone(),
        t0: Instant::now(),
        on_answer,
        answers: Mutex::new(vec![]),
        last_end: Mutex::new(Instant::now()),
    };
    // Warm-up on every slot (one picture, one token), outside the window.
    let warm = Arc::new(png_data_url(&picture(99, 0, w.width, w.height), w.width, w.height)?);
    for slot in 0..w.streams {
        window.prime(slot, std::slice::from_ref(&warm))?;
    }
    record.load_ms = ms(loading.elapsed());

    window.t0 = Instant::now() + Duration::from_millis(200);
    window.last_end = Mutex::new(window.t0);
    let result = match history {
        Some(h) => {
            sleep_until(window.t0);
            window.history(h)
        }
        None => {
            window.live();
            Ok(())
        }
    };
    record.window_ms = ms(*window.last_end.lock().expect("no panics hold it") - window.t0);
    record.answers = window.answers.into_inner().expect("no panics hold it");
    record.peak_rss_kib = peak_rss_kib(Some(server.child.id())).unwrap_or(0);
    drop(server);
    result
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
