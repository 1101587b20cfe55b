//! The alerts benchmark's peer: the same streams, frames and alerts through llama-server (the
//! same llama.cpp release, built by `scripts/build-llama-server.sh`), driven as its strongest
//! client would: each stream on its own slot with `cache_prompt`, each alert a one-token chat
//! completion over the stream's frames so far and the alert's question, sent as soon as its frame
//! is captured, so the server prefills only the new frame and the question.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vlm_runtime::prompt::DEFAULT_SYSTEM_PROMPT;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A running llama-server, stopped when dropped.
pub struct Server {
    child: Child,
    base: String,
    agent: ureq::Agent,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The server binary: `VLM_LLAMA_SERVER`, else the build script's CPU build in its cache.
pub fn find_server() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("VLM_LLAMA_SERVER") {
        return Some(p.into());
    }
    let cache = std::env::var_os("PEER_CACHE").map_or_else(|| PathBuf::from("/var/tmp/gst-vlm-peer"), PathBuf::from);
    let built = cache.join("11434.0.0/build-cpu/bin/llama-server");
    built.is_file().then_some(built)
}

pub struct Settings<'a> {
    pub server: &'a Path,
    pub model: &'a Path,
    pub mmproj: &'a Path,
    pub slots: usize,
    pub cells_per_slot: u32,
    pub threads: i32,
    pub flash_attention: bool,
    /// Every layer and the projector on the GPU (`-ngl 99`).
    pub gpu: bool,
}

/// Start the server (its log in the temporary directory) and wait until it is healthy.
pub fn start(s: &Settings) -> Result<Server, BoxError> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let log_path = std::env::temp_dir().join(format!("vlm-alerts-peer-{port}.log"));
    let log = std::fs::File::create(&log_path)?;
    let child = Command::new(s.server)
        .args(["-m".as_ref(), s.model.as_os_str(), "--mmproj".as_ref(), s.mmproj.as_os_str()])
        .args(["-np".to_owned(), s.slots.to_string(), "-c".into(), (s.cells_per_slot as usize * s.slots).to_string()])
        .args(["-t".to_owned(), s.threads.to_string(), "-tb".into(), s.threads.to_string()])
        .args(["-fa", if s.flash_attention { "on" } else { "off" }])
        .args(if s.gpu { &["-ngl", "99"][..] } else { &[][..] })
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", s.server.display()))?;
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(600)))
        .http_status_as_error(false)
        .build()
        .into();
    let mut server = Server { child, base: format!("http://127.0.0.1:{port}"), agent };
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if let Some(status) = server.child.try_wait()? {
            return Err(format!("llama-server exited ({status}); see {}", log_path.display()).into());
        }
        if server.agent.get(format!("{}/health", server.base)).call().is_ok_and(|r| r.status().is_success()) {
            return Ok(server);
        }
        if Instant::now() > deadline {
            return Err(format!("llama-server not healthy after 300 s; see {}", log_path.display()).into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A packed RGB picture as a PNG `data:` URL.
pub fn png_url(rgb: &[u8], width: u32, height: u32) -> Result<String, BoxError> {
    use base64::Engine as _;
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

impl Server {
    /// One alert: a one-token completion of `question` after `images`, on `slot`.
    pub fn evaluate(&self, images: &[String], question: &str, slot: usize) -> Result<(), BoxError> {
        let mut content: Vec<serde_json::Value> =
            images.iter().map(|url| serde_json::json!({"type": "image_url", "image_url": {"url": url}})).collect();
        content.push(serde_json::json!({"type": "text", "text": question}));
        let body = serde_json::json!({
            "messages": [
                {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                {"role": "user", "content": content},
            ],
            "max_tokens": 1,
            "temperature": 0.0,
            "cache_prompt": true,
            "id_slot": slot,
        });
        let response = self
            .agent
            .post(format!("{}/v1/chat/completions", self.base))
            .header("Content-Type", "application/json")
            .send(body.to_string())?;
        let status = response.status();
        let text = response.into_body().read_to_string()?;
        if !status.is_success() {
            return Err(format!("llama-server: HTTP {status}: {}", text.chars().take(400).collect::<String>()).into());
        }
        Ok(())
    }
}
