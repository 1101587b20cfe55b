//! Running one configuration: a session (the configurations that can run, the log folder, the
//! peer's settings) runs a configuration's worker processes (this binary, re-executed: one, or
//! one per stream for B3), started together once all are ready and their reports merged, or the
//! llama-server peer; optionally only on a quiet machine, a busy run discarded and run again.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;

use crate::gpu_memory::GpuMemory;
use crate::record::{AnswerRecord, Config, DecodeSplit, FeedStats, LagStats, RunRecord, WorkerMsg};
use crate::runtime_run::WorkerSpec;
use crate::workload::{CpuTicks, HistorySpec, Workload, unix_ms};
use crate::{BoxError, CommonArgs, cores, peer, report_run};

enum Event {
    Msg(usize, Box<WorkerMsg>),
    Closed,
}

/// The worker processes of `config` over `w`: one, or one per stream for B3.
fn worker_specs(config: Config, w: &Workload, history: Option<&HistorySpec>) -> Vec<WorkerSpec> {
    let spec = |only_stream| WorkerSpec { config, only_stream, workload: w.clone(), history: history.cloned() };
    if config == Config::B3 { (0..w.streams).map(|i| spec(Some(i))).collect() } else { vec![spec(None)] }
}

/// Run the worker processes `specs` (of one configuration), start them together once all are
/// ready, and merge what they report. `label` names the run in the log files.
fn run_workers(
    specs: &[WorkerSpec],
    round: usize,
    label: &str,
    logs: &std::path::Path,
    bar: &ProgressBar,
    timeout: Duration,
) -> Result<RunRecord, BoxError> {
    // The running binary itself: a rebuild in a shared target folder replaces the file at
    // current_exe()'s path during a long run, while /proc/self/exe still executes this one.
    let proc_exe = std::path::Path::new("/proc/self/exe");
    let exe = if proc_exe.exists() { proc_exe.to_owned() } else { std::env::current_exe()? };
    let config = specs[0].config;
    let (tx, rx) = mpsc::channel();
    let mut children = vec![];
    let mut stdins = vec![];
    let gpu = GpuMemory::watch();
    for (i, spec) in specs.iter().enumerate() {
        let log = std::fs::File::create(logs.join(format!("{label}-{}-{i}.log", config.name())))?;
        let mut child = Command::new(&exe)
            .arg("__worker")
            .arg(serde_json::to_string(spec)?)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()?;
        stdins.push(child.stdin.take().expect("piped"));
        let stdout = child.stdout.take().expect("piped");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(msg) = serde_json::from_str::<WorkerMsg>(&line) {
                    let _ = tx.send(Event::Msg(i, Box::new(msg)));
                }
            }
            let _ = tx.send(Event::Closed);
        });
        children.push(child);
    }
    drop(tx);
    let mut record = RunRecord {
        decode_split: Some(DecodeSplit::default()),
        lag: Some(LagStats::default()),
        feed: Some(FeedStats::default()),
        ..RunRecord::empty(config, round, specs.len())
    };
    let mut errors: Vec<String> = vec![];
    let mut ready = 0;
    let mut open = specs.len();
    let mut started = false;
    let deadline = Instant::now() + timeout;
    loop {
        // A worker's message (unboxed), or None when a worker's stdout closed.
        let event = match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Event::Msg(i, msg)) => Some((i, *msg)),
            Ok(Event::Closed) => None,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                errors.push(format!("timed out after {} s", timeout.as_secs()));
                started = false; // stop the workers below
                break;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        match event {
            Some((_, WorkerMsg::Ready { load_ms, frame_cells, kv_layout, encoder_contexts })) => {
                record.load_ms = record.load_ms.max(load_ms);
                record.frame_cells = record.frame_cells.max(frame_cells);
                record.kv_layout = record.kv_layout.take().or(kv_layout);
                record.encoder_contexts = record.encoder_contexts.max(encoder_contexts);
                ready += 1;
                if ready == specs.len() {
                    // Everyone loaded: start the window together, a moment from now.
                    let at = unix_ms() + 200;
                    for stdin in &mut stdins {
                        writeln!(stdin, "go {at}")?;
                        stdin.flush()?;
                    }
                    started = true;
                }
            }
            Some((_, WorkerMsg::Frame(f))) => record.frame_timings.push(f),
            Some((_, WorkerMsg::Answer(a))) => {
                bar.inc(1);
                record.answers.push(a);
            }
            Some((_, WorkerMsg::Done { window_ms, peak_rss_kib, kv, decode_split, lag, feed, encoder_contexts })) => {
                record.window_ms = record.window_ms.max(window_ms);
                record.encoder_contexts = record.encoder_contexts.max(encoder_contexts);
                record.peak_rss_kib += peak_rss_kib;
                record.kv.get_or_insert_default().add(&kv);
                record.decode_split.as_mut().expect("set above").add(&decode_split);
                record.lag.as_mut().expect("set above").add(&lag);
                record.feed.as_mut().expect("set above").add(&feed);
            }
            Some((i, WorkerMsg::Failed { error })) => {
                errors.push(format!("worker {i}: {error}"));
                if !started {
                    break; // it will never be ready: stop the others below
                }
            }
            None => {
                open -= 1;
                if open == 0 {
                    break;
                }
                if !started {
                    errors.push("a worker exited before it was ready".into());
                    break;
                }
            }
        }
    }
    drop(stdins);
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    for (i, mut child) in children.into_iter().enumerate() {
        if !started {
            let _ = child.kill();
        }
        let status = child.wait()?;
        if !status.success() && started {
            errors.push(format!("worker {i} exited with {status}"));
        }
    }
    record.peak_gpu_mib = gpu.and_then(|g| g.peak_mib(&pids));
    if !errors.is_empty() {
        record.error = Some(format!("{} (logs in {})", errors.join("; "), logs.display()));
    }
    Ok(record)
}

/// What every run sets up before its first configuration: the configurations that can run
/// (the peer left out, with a message, when no server is built), the log folder, the peer.
pub struct Session {
    pub configs: Vec<Config>,
    pub logs: PathBuf,
    peer: Option<peer::PeerSettings>,
    timeout: Duration,
    retry_busy_pct: Option<f64>,
}

/// Wait (20 minutes at most) until other processes have used at most `limit_pct` of the CPU
/// for 20 s in a row.
fn wait_until_quiet(limit_pct: f64, bar: &ProgressBar) {
    let deadline = Instant::now() + Duration::from_secs(1200);
    let mut quiet = 0;
    let mut said = false;
    while quiet < 4 && Instant::now() < deadline {
        let Some(t) = CpuTicks::now() else { return };
        std::thread::sleep(Duration::from_secs(5));
        match t.foreign_pct_since(cores()) {
            Some(p) if p > limit_pct => {
                quiet = 0;
                if !said {
                    bar.set_message(format!("waiting for a quiet machine (other processes use {p:.0}% of the CPU)"));
                    said = true;
                }
            }
            _ => quiet += 1,
        }
    }
}

impl Session {
    pub fn new(c: &CommonArgs, w: &Workload, configs: &[Config], timeout: Duration) -> Result<Session, BoxError> {
        let mut configs = configs.to_vec();
        configs.dedup();
        let server = peer::find_server(c.llama_server.as_deref());
        if configs.iter().any(|c| c.is_peer()) && server.as_ref().is_none_or(|s| !s.is_file()) {
            eprintln!(
                "vlm-bench: no llama-server binary ({}); PEER and PEER-WARM are left out. Build it with \
                 scripts/build-llama-server.sh or name it with --llama-server.",
                server.as_ref().map_or_else(|| "not built".into(), |s| s.display().to_string())
            );
            configs.retain(|c| !c.is_peer());
        }
        if configs.is_empty() {
            return Err("no configuration to run".into());
        }
        let logs =
            c.log_dir.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("vlm-bench-{}", std::process::id())));
        std::fs::create_dir_all(&logs)?;
        let single_threads = vlm_runtime::EngineConfig::parse_list(&w.engine, &vlm_runtime::EngineConfig::default())?
            .first()
            .map_or(cores(), |e| e.threads as usize);
        let peer = server.map(|server| peer::PeerSettings {
            server,
            threads: c.peer_threads.unwrap_or(single_threads),
            args: c.peer_args.as_deref().unwrap_or("").split_whitespace().map(str::to_owned).collect(),
            logs: logs.clone(),
            timeout,
        });
        Ok(Session { configs, logs, peer, timeout, retry_busy_pct: c.retry_busy_pct })
    }

    /// Run `config` once over `w` (the live workload, or the history curve): in fresh worker
    /// processes, or against a freshly started server. `label` names the run in the logs. With
    /// `--retry-busy-pct`, a run during which other processes used more of the CPU is discarded
    /// (its share kept in `discarded_busy_pct`) and run again once the machine is quiet, twice
    /// at most.
    pub fn run_config(
        &self,
        config: Config,
        w: &Workload,
        round: usize,
        label: &str,
        history: Option<&HistorySpec>,
        bar: &ProgressBar,
    ) -> Result<RunRecord, BoxError> {
        let mut discarded = vec![];
        loop {
            if let Some(limit) = self.retry_busy_pct {
                wait_until_quiet(limit, bar);
            }
            let ticks = CpuTicks::now();
            let answered = bar.position();
            let mut record = if config.is_peer() {
                let settings = self.peer.as_ref().expect("the peer is only kept with a server");
                let on_answer = |_: &AnswerRecord| bar.inc(1);
                peer::run_round(settings, config, w, round, label, history, &on_answer)
            } else {
                run_workers(&worker_specs(config, w, history), round, label, &self.logs, bar, self.timeout)?
            };
            record.foreign_cpu_pct = ticks.and_then(|t| t.foreign_pct_since(cores()));
            let busy = record.foreign_cpu_pct.filter(|&p| self.retry_busy_pct.is_some_and(|limit| p > limit));
            match busy {
                Some(pct) if discarded.len() < 2 => {
                    report_run(bar, &format!("{label} (discarded: machine busy)"), &record, record.answers.len());
                    bar.set_position(answered);
                    discarded.push(pct);
                }
                _ => {
                    record.discarded_busy_pct = discarded;
                    return Ok(record);
                }
            }
        }
    }

    /// The peer's settings as the JSON report keeps them.
    pub fn peer_json(&self) -> serde_json::Value {
        self.peer.as_ref().map_or(serde_json::Value::Null, |p| {
            serde_json::json!({
                "server": p.server, "threads": p.threads, "args": p.args, "media_marker": peer::MEDIA_MARKER,
                // (Set by the benchmark besides `args`: `-fa` from the engines' flash attention,
                // which the runtime's vision encoder also follows, and no host prompt cache.)
                "fixed_args": ["-fa (as --flash-attention)", "--cache-ram 0"],
                "modes": {
                    "PEER": "naive: each question, sent at its frame's due time, carries every frame of its stream \
                        so far (the server encodes the frames it has not seen at question time)",
                    "PEER-WARM": peer::WARM_CLIENT,
                },
                "clock": "TTFT from capture counts from the due time of the question's frame, as for the runtime",
            })
        })
    }
}
