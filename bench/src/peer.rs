//! The peer: llama.cpp's own `llama-server` (built by `scripts/build-llama-server.sh` from the
//! same llama.cpp source as the runtime), fed the same pictures as PNG images with the same
//! projector. One slot per stream (`-np S`, each stream's requests pinned to its slot with
//! `id_slot`), prompt caching on, each question sent at its frame's due time from its own thread,
//! streamed, with `ignore_eos` and the same exact length.
//!
//! Two clients ([`Mode`]): the naive one sends nothing but the questions, each carrying every
//! frame of its stream so far (the server encodes them at question time); the warm one sends
//! every frame as it is captured (a 1-token request carrying the stream's history, so the slot's
//! prompt cache holds it), and a question on top. What each sends is planned by [`plan`], a pure
//! function of the workload (`vlm-bench --print-peer-plan warm` prints it).

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

use crate::gpu_memory::GpuMemory;
use crate::record::{AnswerRecord, Config, FeedStats, RunRecord};
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

fn start(settings: &PeerSettings, mode: Mode, w: &Workload, label: &str) -> Result<Server, BoxError> {
    let port = free_port()?;
    let log_path = settings.logs.join(format!("{label}-{}.log", mode.config().name()));
    let per_slot = w.sequence_cells();
    let log = File::create(&log_path)?;
    let child = Command::new(&settings.server)
        .env("LLAMA_MEDIA_MARKER", MEDIA_MARKER)
        .args(["-m".as_ref(), w.model.as_os_str(), "--mmproj".as_ref(), w.mmproj.as_os_str()])
        .args(["-np".to_owned(), w.streams.to_string(), "-c".into(), (per_slot as usize * w.streams).to_string()])
        .args(["-t".to_owned(), settings.threads.to_string(), "-tb".into(), settings.threads.to_string()])
        .args(["-fa", if w.flash_attention { "on" } else { "off" }])
        // No host prompt cache: each stream keeps its own slot, whose KV stays there (saving
        // the idle slots' KV at every task would only cost the server's loop time and memory).
        .args(["--cache-ram", "0"])
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

/// How the client drives the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Questions only, each with every frame of its stream so far.
    Naive,
    /// Every frame sent as it is captured; the question on top, on the same slot.
    Warm,
}

impl Mode {
    pub fn config(self) -> Config {
        match self {
            Mode::Naive => Config::Peer,
            Mode::Warm => Config::PeerWarm,
        }
    }

    pub fn of(config: Config) -> Option<Mode> {
        match config {
            Config::Peer => Some(Mode::Naive),
            Config::PeerWarm => Some(Mode::Warm),
            _ => None,
        }
    }
}

/// What the warm client does, as the JSON report says it.
pub const WARM_CLIENT: &str = "warm: at each frame's due time a 1-token request (n_predict 1, cache_prompt, \
    id_slot = the stream) carrying the stream's frames so far and no text goes to the stream's sender thread, which \
    sends one at a time and waits for each, so the slot's prompt cache holds the history (a request not sent yet when \
    a newer one or a question is due is dropped and counted as superseded: the newer one carries its frames); a \
    question is sent at its frame's due time from its own thread on the same slot with the same frames and its text, \
    so the server prefills only what its cache lacks (the question's frame travels with the question)";

/// One request of a client, planned.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Planned {
    pub stream: usize,
    /// The frame (1-based) at whose due time the request is sent; it carries frames 1..=frame
    /// of its stream.
    pub frame: usize,
    /// The question's index in its stream; None for a frame's 1-token request.
    pub question: Option<usize>,
}

impl Planned {
    /// The request's JSON body over `images` (frames 1..=frame of the stream).
    pub fn body(&self, images: &[Arc<String>], w: &Workload) -> String {
        match self.question {
            Some(index) => request_body(images, Some(question_text(index)), self.stream, w.tokens, true),
            None => request_body(images, None, self.stream, 1, false),
        }
    }
}

/// Every request the client of `mode` sends over the live workload `w`, stream by stream, each
/// stream's in the order it sends them (by frame; the frame's request before its questions).
pub fn plan(w: &Workload, mode: Mode) -> Vec<Planned> {
    let mut out = vec![];
    for stream in 0..w.streams {
        for frame in 1..=w.frames {
            let questions: Vec<usize> =
                w.ask_after.iter().enumerate().filter(|(_, a)| **a == frame).map(|(i, _)| i).collect();
            if mode == Mode::Warm && questions.is_empty() {
                out.push(Planned { stream, frame, question: None });
            }
            out.extend(questions.into_iter().map(|q| Planned { stream, frame, question: Some(q) }));
        }
    }
    out
}

/// The plan of `mode` over `w` as JSON: each request's stream, frame, due time (ms from the
/// first frame) and body, the images named `frame S:N` instead of their data.
pub fn plan_json(w: &Workload, mode: Mode) -> Value {
    let t0 = Instant::now();
    let requests: Vec<Value> = plan(w, mode)
        .iter()
        .map(|p| {
            let images: Vec<Arc<String>> = (1..=p.frame).map(|n| Arc::new(format!("frame {}:{n}", p.stream))).collect();
            let body: Value = serde_json::from_str(&p.body(&images, w)).expect("bodies are JSON");
            json!({
                "stream": p.stream,
                "frame": p.frame,
                "question": p.question,
                "due_ms": ms(w.frame_due(t0, p.stream, p.frame) - t0),
                "body": body,
            })
        })
        .collect();
    json!({ "mode": format!("{mode:?}").to_lowercase(), "requests": requests })
}

/// A chat completion over `images` with `question` after them (none: the images alone).
fn request_body(images: &[Arc<String>], question: Option<&str>, slot: usize, tokens: u32, stream: bool) -> String {
    let mut content: Vec<Value> =
        images.iter().map(|url| json!({"type": "image_url", "image_url": {"url": url.as_str()}})).collect();
    if let Some(question) = question {
        content.push(json!({"type": "text", "text": question}));
    }
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
    config: Config,
    w: &Workload,
    round: usize,
    label: &str,
    history: Option<&HistorySpec>,
    on_answer: &(dyn Fn(&AnswerRecord) + Sync),
) -> RunRecord {
    let mut record = RunRecord::empty(config, round, 1);
    let mode = Mode::of(config).expect("a peer configuration");
    if let Err(e) = run(settings, mode, w, label, history, on_answer, &mut record) {
        record.error = Some(e.to_string());
    }
    record
}

/// A stream's frame request waiting for its sender (the newest only), and whether the stream
/// has ended.
#[derive(Default)]
struct Outbox {
    next: Option<(Planned, Vec<Arc<String>>, Instant)>,
    ended: bool,
    /// Frame requests dropped unsent: a newer request or a question carried their frames.
    superseded: u64,
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
    /// Send question `index` of stream `gs` over `images` (asked at frame `after`) now,
    /// streamed and timed from its arrival; record it. `capture`: frame `after`'s due time
    /// (live workload only), the newest frame in `images`.
    fn ask(
        &self,
        gs: usize,
        index: usize,
        after: usize,
        images: &[Arc<String>],
        prime_ms: Option<f64>,
        capture: Option<Instant>,
    ) {
        // The body (every image as a data URL) is the client's work: built before the arrival.
        let planned = Planned { stream: gs, frame: after, question: Some(index) };
        let body = planned.body(images, self.w);
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
                answer.ttft_from_question_ms = s.ttft_ms;
                answer.total_ms = s.total_ms;
                answer.tokens = s.tokens;
            }
            Err(e) => answer.error = Some(e.to_string()),
        }
        if let Some(due) = capture {
            let due_ms = ms(due - self.t0);
            answer.set_capture(due_ms, Some(due_ms));
        }
        (self.on_answer)(&answer);
        self.answers.lock().expect("no panics hold it").push(answer);
        let mut last = self.last_end.lock().expect("no panics hold it");
        *last = (*last).max(end);
    }

    /// A one-token request over `images` on `slot`, outside the measurements (warm-up, and the
    /// history curve's priming); its text differs from every question's.
    fn prime(&self, slot: usize, images: &[Arc<String>]) -> Result<(), BoxError> {
        self.send(request_body(images, Some("Hello"), slot, 1, false))
    }

    /// Send a request that is not streamed and read its whole response.
    fn send(&self, body: String) -> Result<(), BoxError> {
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

    /// The live workload: each stream's frames made at their due times (PNG images) and the
    /// client's plan sent: each question at its frame's due time from its own thread with all of
    /// the stream's frames so far; a frame's 1-token request (the warm client) handed to the
    /// stream's sender thread, which sends one at a time and waits for each, the newest first:
    /// a request not sent yet when a newer one (or a question, which carries its frames) is due
    /// is dropped and counted in `superseded`. The frames' feed lateness (their request answered
    /// minus their due time) and the first frame request's error, if any.
    fn live(&self, mode: Mode) -> (FeedStats, Option<String>) {
        let w = self.w;
        let plan = plan(w, mode);
        let feed = Mutex::new((FeedStats::default(), None::<String>));
        std::thread::scope(|scope| {
            for gs in 0..w.streams {
                let mine: Vec<Planned> = plan.iter().filter(|p| p.stream == gs).cloned().collect();
                let feed = &feed;
                scope.spawn(move || {
                    let outbox = Arc::new((Mutex::new(Outbox::default()), std::sync::Condvar::new()));
                    let sender = {
                        let outbox = Arc::clone(&outbox);
                        scope.spawn(move || self.send_frames(gs, &outbox))
                    };
                    let mut images: Vec<Arc<String>> = vec![];
                    for number in 1..=w.frames {
                        let due = w.frame_due(self.t0, gs, number);
                        sleep_until(due);
                        match png_data_url(&picture(gs, number, w.width, w.height), w.width, w.height) {
                            Ok(url) => images.push(Arc::new(url)),
                            Err(e) => {
                                eprintln!("peer: stream {gs}, frame {number}: {e}");
                                break;
                            }
                        }
                        for p in mine.iter().filter(|p| p.frame == number) {
                            let mut o = outbox.0.lock().expect("no panics hold it");
                            o.superseded += o.next.is_some() as u64;
                            o.next = None;
                            match p.question {
                                Some(index) => {
                                    let images = images.clone();
                                    scope.spawn(move || self.ask(gs, index, number, &images, None, Some(due)));
                                }
                                None => {
                                    o.next = Some((p.clone(), images.clone(), due));
                                    outbox.1.notify_one();
                                }
                            }
                        }
                    }
                    outbox.0.lock().expect("no panics hold it").ended = true;
                    outbox.1.notify_one();
                    let (local, error) = sender.join().expect("the sender does not panic");
                    let mut all = feed.lock().expect("no panics hold it");
                    all.0.add(&local);
                    if all.1.is_none() {
                        all.1 = error;
                    }
                });
            }
        });
        feed.into_inner().expect("no panics hold it")
    }

    /// A stream's sender: its frame requests, one at a time, until the stream has ended.
    fn send_frames(&self, gs: usize, outbox: &(Mutex<Outbox>, std::sync::Condvar)) -> (FeedStats, Option<String>) {
        let (mut local, mut error) = (FeedStats::default(), None);
        loop {
            let next = {
                let mut o = outbox.0.lock().expect("no panics hold it");
                loop {
                    if let Some(next) = o.next.take() {
                        break Some(next);
                    }
                    if o.ended {
                        local.superseded = o.superseded;
                        break None;
                    }
                    o = outbox.1.wait(o).expect("no panics hold it");
                }
            };
            let Some((p, images, due)) = next else { return (local, error) };
            match self.send(p.body(&images, self.w)) {
                Ok(()) => local.fed(ms(Instant::now().saturating_duration_since(due))),
                Err(e) => {
                    error.get_or_insert(format!("stream {gs}, frame {}: {e}", p.frame));
                }
            }
        }
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
                self.ask(0, rep, point, &images, Some(prime_ms), None);
            }
        }
        Ok(())
    }
}

fn run(
    settings: &PeerSettings,
    mode: Mode,
    w: &Workload,
    label: &str,
    history: Option<&HistorySpec>,
    on_answer: &(dyn Fn(&AnswerRecord) + Sync),
    record: &mut RunRecord,
) -> Result<(), BoxError> {
    let loading = Instant::now();
    let gpu = GpuMemory::watch();
    let server = start(settings, mode, w, label)?;
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
            let (feed, error) = window.live(mode);
            if mode == Mode::Warm {
                record.feed = Some(feed);
            }
            error.map_or(Ok(()), |e| Err(format!("a frame request failed: {e}").into()))
        }
    };
    record.window_ms = ms(*window.last_end.lock().expect("no panics hold it") - window.t0);
    record.answers = window.answers.into_inner().expect("no panics hold it");
    record.peak_rss_kib = peak_rss_kib(Some(server.child.id())).unwrap_or(0);
    record.peak_gpu_mib = gpu.and_then(|g| g.peak_mib(&[server.child.id()]));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(streams: usize, frames: usize, ask_after: Vec<usize>) -> Workload {
        Workload {
            streams,
            frames,
            fps: 0.1,
            ask_after,
            tokens: 64,
            width: 32,
            height: 24,
            model: "lm.gguf".into(),
            mmproj: "mmproj.gguf".into(),
            engine: "cpu:cpu:2".into(),
            engines: "cpu0:cpu:1,cpu1:cpu:1".into(),
            max_answers: 8,
            context: 2048,
            max_pending: 2,
            skip_on_overload: true,
            stagger: false,
            frame_cells: None,
            encoder_gpu: false,
            kv_layout: "per-sequence".into(),
            kv_type: "f16".into(),
            flash_attention: false,
            merge_frames: "auto".into(),
            encode_first: false,
            encoder_threads: 1,
            encoder_contexts: 1,
            prepare_threads: None,
        }
    }

    fn p(stream: usize, frame: usize, question: Option<usize>) -> Planned {
        Planned { stream, frame, question }
    }

    #[test]
    fn the_warm_client_sends_every_frame_and_the_question_carries_its_own() {
        // The W1 shape, shortened: questions after frames 2 and 4 of 4.
        let w = workload(2, 4, vec![2, 4]);
        let plan = plan(&w, Mode::Warm);
        let stream0: Vec<_> = plan.iter().filter(|r| r.stream == 0).cloned().collect();
        assert_eq!(stream0, vec![p(0, 1, None), p(0, 2, Some(0)), p(0, 3, None), p(0, 4, Some(1))]);
        assert_eq!(plan.len(), 8, "every frame of both streams once");
        // Two questions about one frame: both go, no frame request besides.
        let plan = super::plan(&workload(1, 2, vec![2, 2]), Mode::Warm);
        assert_eq!(plan, vec![p(0, 1, None), p(0, 2, Some(0)), p(0, 2, Some(1))]);
    }

    #[test]
    fn the_naive_client_sends_only_questions() {
        let plan = plan(&workload(2, 4, vec![2, 4]), Mode::Naive);
        assert_eq!(plan, vec![p(0, 2, Some(0)), p(0, 4, Some(1)), p(1, 2, Some(0)), p(1, 4, Some(1))]);
    }

    #[test]
    fn frame_requests_are_one_token_on_the_stream_slot_and_a_prefix_of_the_question() {
        let w = workload(2, 3, vec![3]);
        let images: Vec<Arc<String>> = (1..=3).map(|n| Arc::new(format!("data:image/png;base64,{n}"))).collect();
        let frame: Value = serde_json::from_str(&p(1, 2, None).body(&images[..2], &w)).unwrap();
        let question: Value = serde_json::from_str(&p(1, 3, Some(0)).body(&images, &w)).unwrap();
        for (body, n_predict, streamed) in [(&frame, 1, false), (&question, 64, true)] {
            assert_eq!(body["id_slot"], 1);
            assert_eq!(body["cache_prompt"], true);
            assert_eq!((body["n_predict"].as_u64(), body["stream"].as_bool()), (Some(n_predict), Some(streamed)));
            assert_eq!(body["messages"][0], question["messages"][0], "the same system prompt");
        }
        // The frame request's user content (its images) starts the question's.
        let (f, q) = (
            frame["messages"][1]["content"].as_array().unwrap(),
            question["messages"][1]["content"].as_array().unwrap(),
        );
        assert_eq!(f.len(), 2);
        assert_eq!(&q[..2], &f[..]);
        assert_eq!(q[3]["text"], question_text(0));
    }
}
