//! What a run measures, as the workers report it and the JSON keeps it.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The configurations compared side by side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Config {
    /// No retention: every question re-prefills its whole history (one engine).
    B0,
    /// Retained history, one engine (all threads).
    B1,
    /// Retained history, the second engine of P only.
    B2,
    /// The placer over two engines.
    P,
    /// One process per stream.
    B3,
    /// llama.cpp's own llama-server, prompt caching on, one slot per stream, driven naively:
    /// each question resends every frame of its stream, so the server encodes at question time.
    #[serde(rename = "PEER")]
    Peer,
    /// The same server driven as a user who knows it would: every frame sent as it is captured
    /// (a 1-token request with the stream's history on its slot), the question only on top.
    #[serde(rename = "PEER-WARM")]
    PeerWarm,
}

pub const ALL_CONFIGS: [Config; 7] =
    [Config::B0, Config::B1, Config::B2, Config::P, Config::B3, Config::Peer, Config::PeerWarm];

impl Config {
    pub fn name(self) -> &'static str {
        match self {
            Config::B0 => "B0",
            Config::B1 => "B1",
            Config::B2 => "B2",
            Config::P => "P",
            Config::B3 => "B3",
            Config::Peer => "PEER",
            Config::PeerWarm => "PEER-WARM",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Config::B0 => "retain=false (re-prefill), one engine",
            Config::B1 => "retained, one engine",
            Config::B2 => "retained, second engine only",
            Config::P => "placer over both engines",
            Config::B3 => "one process per stream",
            Config::Peer => "llama-server, naive client: every frame resent with each question",
            Config::PeerWarm => "llama-server, warm client: each frame sent as captured, question on its slot",
        }
    }

    /// One of llama-server's clients (no worker process of the runtime).
    pub fn is_peer(self) -> bool {
        matches!(self, Config::Peer | Config::PeerWarm)
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Config {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ALL_CONFIGS
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| format!("unknown configuration {s:?} (expected B0, B1, B2, P, B3, PEER or PEER-WARM)"))
    }
}

/// One answered (or failed) question.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AnswerRecord {
    pub stream: usize,
    /// Question number within its stream.
    pub index: usize,
    /// The frame (1-based) it was asked right after.
    pub after_frame: usize,
    /// Arrival, from the first frame of the window (ms).
    pub arrival_ms: f64,
    /// Capture of the frame the question is about (`after_frame`): its due time on the live
    /// source, from the first frame of the window (ms). None where no live source ran (the
    /// history curve).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture_ms: Option<f64>,
    /// Arrival until the answer was started with its version published (runtime only).
    pub wait_ms: Option<f64>,
    /// From the answer's start on its engine to its first token: making the history ready
    /// (branch, import or replay), the question's prefill and the first decode (runtime only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prepare_ms: Option<f64>,
    /// The headline clock: from the capture of the frame the question is about (its due time)
    /// to the first token, so its encoding, ingestion and the question's wait all count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_from_capture_ms: Option<f64>,
    /// From the question's arrival to the first token (the runtime asks right after the frame's
    /// registration; the peers at the frame's due time).
    #[serde(alias = "ttft_ms")]
    pub ttft_from_question_ms: f64,
    /// The question's arrival minus the capture of the newest frame in the history its answer
    /// read (ms): how old a picture the answer describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness_ms: Option<f64>,
    /// Arrival to last token.
    pub total_ms: f64,
    /// Tokens generated.
    pub tokens: u32,
    /// resident / import / replay (runtime only).
    pub path: Option<String>,
    pub engine: Option<String>,
    /// Frames in the bound version (runtime) or images sent (peer).
    pub frames: u64,
    /// History curve only: time to bring the history to this question's frames from the
    /// previous point, frames given as fast as they are taken (runtime: encoding and ingestion
    /// until the version is published; server: one request carrying the new frames).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prime_ms: Option<f64>,
    pub error: Option<String>,
}

impl AnswerRecord {
    /// A question asked at `arrival_ms` and ended `total_ms` later, before its outcome is known.
    pub fn asked(stream: usize, index: usize, after_frame: usize, arrival_ms: f64, total_ms: f64) -> AnswerRecord {
        AnswerRecord {
            stream,
            index,
            after_frame,
            arrival_ms,
            capture_ms: None,
            wait_ms: None,
            prepare_ms: None,
            ttft_from_capture_ms: None,
            ttft_from_question_ms: 0.0,
            staleness_ms: None,
            total_ms,
            tokens: 0,
            path: None,
            engine: None,
            frames: 0,
            prime_ms: None,
            error: None,
        }
    }
}

impl AnswerRecord {
    /// Decode time of this answer after its first token (s).
    pub fn decode_seconds(&self) -> f64 {
        ((self.total_ms - self.ttft_from_question_ms) / 1e3).max(0.0)
    }

    /// Set the capture clock: the frame the question is about was due at `capture_ms` and the
    /// newest frame its answer read at `newest_ms` (both from the window's start). Call once
    /// `ttft_from_question_ms` is known.
    pub fn set_capture(&mut self, capture_ms: f64, newest_ms: Option<f64>) {
        self.capture_ms = Some(capture_ms);
        if self.error.is_none() {
            self.ttft_from_capture_ms = Some(self.arrival_ms - capture_ms + self.ttft_from_question_ms);
        }
        self.staleness_ms = newest_ms.map(|n| self.arrival_ms - n);
    }
}

/// Decode steps run while frames waited for ingestion (busy) and with none waiting (idle), and
/// where the engine threads' time went (`vlm_runtime::TimeSplit`, summed over the engines).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct DecodeSplit {
    pub busy_steps: u64,
    pub busy_ms: f64,
    pub idle_steps: u64,
    pub idle_ms: f64,
    #[serde(default)]
    pub engine_time: EngineTime,
}

impl DecodeSplit {
    pub fn add(&mut self, other: &DecodeSplit) {
        self.busy_steps += other.busy_steps;
        self.busy_ms += other.busy_ms;
        self.idle_steps += other.idle_steps;
        self.idle_ms += other.idle_ms;
        self.engine_time = self.engine_time.plus(&other.engine_time, 1.0);
    }
}

/// Where engine threads' time went (ms; see `vlm_runtime::TimeSplit`), and the inputs their
/// ingestion prefilled.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct EngineTime {
    pub wall_ms: f64,
    pub decode_ms: f64,
    pub start_ms: f64,
    pub ingest_ms: f64,
    pub ingest_inputs: f64,
    pub jobs_ms: f64,
    pub idle_ms: f64,
}

impl EngineTime {
    pub fn of(t: &vlm_runtime::TimeSplit) -> EngineTime {
        EngineTime {
            wall_ms: t.wall_ms,
            decode_ms: t.decode_ms,
            start_ms: t.start_ms,
            ingest_ms: t.ingest_ms,
            ingest_inputs: t.ingest_inputs as f64,
            jobs_ms: t.jobs_ms,
            idle_ms: t.idle_ms,
        }
    }

    /// `self + sign * other`, field by field (-1: the time between two readings).
    pub fn plus(&self, other: &EngineTime, sign: f64) -> EngineTime {
        EngineTime {
            wall_ms: self.wall_ms + sign * other.wall_ms,
            decode_ms: self.decode_ms + sign * other.decode_ms,
            start_ms: self.start_ms + sign * other.start_ms,
            ingest_ms: self.ingest_ms + sign * other.ingest_ms,
            ingest_inputs: self.ingest_inputs + sign * other.ingest_inputs,
            jobs_ms: self.jobs_ms + sign * other.jobs_ms,
            idle_ms: self.idle_ms + sign * other.idle_ms,
        }
    }
}

/// Ingestion lag, sampled right after every frame registration.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct LagStats {
    pub samples: u64,
    /// Most frames registered but not yet published.
    pub max_frames: u64,
    /// Oldest unpublished frame's age, at most and summed over the samples (ms).
    pub max_ms: f64,
    pub sum_ms: f64,
    /// Frames the stream skipped under its overload policy.
    pub skipped: u64,
}

impl LagStats {
    pub fn add(&mut self, other: &LagStats) {
        self.samples += other.samples;
        self.max_frames = self.max_frames.max(other.max_frames);
        self.max_ms = self.max_ms.max(other.max_ms);
        self.sum_ms += other.sum_ms;
        self.skipped += other.skipped;
    }

    pub fn mean_ms(&self) -> f64 {
        if self.samples == 0 { 0.0 } else { self.sum_ms / self.samples as f64 }
    }
}

/// How the live sources' frames got in: feed lateness (a frame's registration, after its
/// encoding, minus its due time; the warm peer: its frame request answered, so encoded and
/// prefilled, minus its due time) and the vision encoder's busy time.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct FeedStats {
    /// Frames fed (registered, or the warm peer's frame requests answered).
    pub frames: u64,
    pub late_sum_ms: f64,
    pub late_max_ms: f64,
    /// Frames the runtime's encoder encoded in the window, and its busy time (ms); the server's
    /// encoder is not timed apart.
    pub encoded: u64,
    pub encode_ms: f64,
    /// The warm peer: frame requests dropped unsent because a newer request or a question,
    /// which carries their frames, was due before they could be sent.
    #[serde(default)]
    pub superseded: u64,
}

impl FeedStats {
    pub fn add(&mut self, o: &FeedStats) {
        self.frames += o.frames;
        self.superseded += o.superseded;
        self.late_sum_ms += o.late_sum_ms;
        self.late_max_ms = self.late_max_ms.max(o.late_max_ms);
        self.encoded += o.encoded;
        self.encode_ms += o.encode_ms;
    }

    /// One frame fed `late_ms` after its due time.
    pub fn fed(&mut self, late_ms: f64) {
        self.frames += 1;
        self.late_sum_ms += late_ms;
        self.late_max_ms = self.late_max_ms.max(late_ms);
    }

    pub fn late_mean_ms(&self) -> Option<f64> {
        (self.frames > 0).then(|| self.late_sum_ms / self.frames as f64)
    }

    /// Frames the encoder encodes per second of its busy time (its throughput when it never
    /// idles).
    pub fn encoder_fps(&self) -> Option<f64> {
        (self.encoded > 0 && self.encode_ms > 0.0).then(|| 1e3 * self.encoded as f64 / self.encode_ms)
    }
}

/// Where one frame's time went from its capture to its published version (runtime
/// configurations; ms from the window's start).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct FrameTiming {
    pub stream: usize,
    /// The frame's number in its stream (1-based).
    pub frame: usize,
    /// Its capture: the due time on the live source.
    pub due_ms: f64,
    /// The encode call began (the feeder's thread got to it) and returned; the call includes
    /// any wait for an encoder busy with another stream's frame.
    pub encode_start_ms: f64,
    pub encode_end_ms: f64,
    /// Registration returned (it blocks past max-pending when the overload policy blocks).
    pub registered_ms: f64,
    /// Its version published (polled every 5 ms); None when skipped or not seen in the window.
    pub published_ms: Option<f64>,
    pub skipped: bool,
}

/// The KV memory of a runtime worker's engines.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct KvStats {
    /// Bytes of KV cells the contexts allocated.
    pub allocated_bytes: u64,
    /// Most bytes of cells in use at once, sampled every 20 ms over the window (a cell shared
    /// by several sequences counted once).
    pub peak_in_use_bytes: u64,
    /// Bytes of one cell (K and V rows of every layer).
    pub cell_bytes: u64,
}

impl KvStats {
    pub fn add(&mut self, o: &KvStats) {
        self.allocated_bytes += o.allocated_bytes;
        self.peak_in_use_bytes += o.peak_in_use_bytes;
        self.cell_bytes = self.cell_bytes.max(o.cell_bytes);
    }
}

/// One configuration in one round.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRecord {
    pub config: Config,
    pub round: usize,
    /// Processes that ran it (B3: one per stream; the peer: the server).
    pub processes: usize,
    /// Model load and warm-up, outside the window (ms; B3: the slowest process).
    pub load_ms: f64,
    /// Peak RSS (KiB): the worker process, the sum over B3's processes, or the server's.
    pub peak_rss_kib: u64,
    /// Peak GPU memory (MiB) of the same processes, as `nvidia-smi` saw it every 250 ms (none
    /// without `nvidia-smi`, or where they used no GPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_gpu_mib: Option<u64>,
    /// First frame to last answer (ms).
    pub window_ms: f64,
    pub answers: Vec<AnswerRecord>,
    /// Runtime configurations only: the engines' decode steps during the window.
    pub decode_split: Option<DecodeSplit>,
    pub lag: Option<LagStats>,
    /// Feed lateness and encoder time (runtime configurations and the warm peer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feed: Option<FeedStats>,
    /// Every frame's way from capture to published version (runtime configurations).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frame_timings: Vec<FrameTiming>,
    /// The engines' KV memory (runtime configurations; B3: summed over its processes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv: Option<KvStats>,
    /// KV cells one frame fills, as the runtime measured it (runtime configurations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frame_cells: Option<u32>,
    /// The KV layout and encoder contexts the runtime's workers ran with (`--kv-layout auto` and
    /// `--encoder-contexts 0` resolved; runtime configurations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoder_contexts: Option<usize>,
    /// CPU that other processes on the machine used during the run (percent of all cores):
    /// a run sharing the machine with other work shows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub foreign_cpu_pct: Option<f64>,
    /// Earlier runs of the same configuration discarded because other processes used this share
    /// of the CPU during them (`--retry-busy-pct`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub discarded_busy_pct: Vec<f64>,
    pub error: Option<String>,
}

impl RunRecord {
    /// A run of `config` that has measured nothing yet.
    pub fn empty(config: Config, round: usize, processes: usize) -> RunRecord {
        RunRecord {
            config,
            round,
            processes,
            load_ms: 0.0,
            peak_rss_kib: 0,
            peak_gpu_mib: None,
            window_ms: 0.0,
            answers: vec![],
            decode_split: None,
            lag: None,
            feed: None,
            frame_timings: vec![],
            kv: None,
            frame_cells: None,
            kv_layout: None,
            encoder_contexts: None,
            foreign_cpu_pct: None,
            discarded_busy_pct: vec![],
            error: None,
        }
    }
}

/// Lines a worker process writes on its stdout, one JSON object each.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerMsg {
    /// Engines started, calibrated and warmed up; waiting for the start time on stdin.
    Ready {
        load_ms: f64,
        /// KV cells one frame fills (the warm-up frame's).
        #[serde(default)]
        frame_cells: Option<u32>,
        /// The KV layout its engines use and the encoder contexts loaded.
        #[serde(default)]
        kv_layout: Option<String>,
        #[serde(default)]
        encoder_contexts: Option<usize>,
    },
    Answer(AnswerRecord),
    /// A frame's way from capture to its version, once published (or skipped).
    Frame(FrameTiming),
    Done {
        window_ms: f64,
        peak_rss_kib: u64,
        #[serde(default)]
        kv: KvStats,
        decode_split: DecodeSplit,
        lag: LagStats,
        #[serde(default)]
        feed: FeedStats,
        /// The encoder contexts loaded at the end (automatic ones grow with the load).
        #[serde(default)]
        encoder_contexts: Option<usize>,
    },
    Failed {
        error: String,
    },
}
