//! The engine's configuration: [`EngineConfig`], its defaults, the [`KvLayout`] and the parsing
//! of engine lists.

use crate::engine_spec::SpecDevice;
use crate::error::{Error, Result};
use crate::llama::{Device, Gpu, KvType};

/// How an engine is built.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The name questions and `placement` refer to (`cpu`, `gpu`, ...).
    pub name: String,
    pub device: Device,
    pub threads: i32,
    /// KV cells per sequence: the longest history (plus question and answer) a stream can hold.
    pub context_per_sequence: u32,
    pub max_streams: u32,
    /// Answers generated at once (each needs a sequence of its own).
    pub max_branches: u32,
    /// Flash attention: faster KV export on GPUs, but V is stored untransposed, so snapshots
    /// only move between engines that agree on it.
    pub flash_attention: bool,
    /// How the KV cells of streams and answers are laid out.
    pub kv_layout: KvLayout,
    /// Element type of K and V (quantized types need flash attention).
    pub kv_type: KvType,
    /// Which GPU, and how many layers on it, for the `gpu` engines of a list (vlmcontext's
    /// `gpu-device` and `gpu-layers`).
    pub gpu: Gpu,
    /// With [`KvLayout::Unified`]: the cells an answer may take beyond the version it reads
    /// (its question and its tokens).
    pub answer_cells: u32,
    /// CPU cores the engine's threads run on (none: wherever the OS puts them).
    pub cores: Vec<usize>,
    /// Most prefill (ms, from measured rates) run between two decode steps.
    pub step_budget_ms: f64,
    /// Share of the engine's time frame ingestion gets while answers are decoding.
    pub ingest_share: f64,
    /// Ingest a frame of several segments (image rows with wrapper text) as one batch of
    /// embedding rows, its text as the tokens' rows (`Some(true)`), or segment by segment.
    /// `None`: where a decode costs about the same for a few inputs as for hundreds (GPU and RPC
    /// engines: kernel launches, round trips), not on the CPU. Either way only for a model whose
    /// rows the calibration run found to decode as its tokens (`crate::llama::Model::rows_agree`).
    pub merge_frames: Option<bool>,
    /// On the CPU, while vision encodes need the cores (the encoders' threads and this engine's
    /// are more than the cores), answers that already have their first token pause until the
    /// next encode ends, each at most once: the next frame is encoded sooner, and a token after
    /// the first waits at most one encode ([`DEFAULT_ENCODE_FIRST`] says what it costs).
    pub encode_first: bool,
}

/// Default most prefill between two decode steps (ms). Measured on the 2-core CI machine
/// (`cargo run -p vlm-runtime --example chunks`): a 12-token chunk (~38 ms) costs 7% more per
/// token than a whole 36-token frame, a 6-token one 21% more; under a live load the switches
/// between decode steps, chunks and streams (graph rebuilds) cost more again: two streams'
/// frames took ~435 ms to ingest at 40 ms, ~350 ms at 100 ms and ~320 ms whole. At 150 ms a
/// 36-token frame goes whole even while an answer decodes (a split one cost ~165 ms against
/// ~130 ms): with 2 streams at 2 frames/s and 16-token answers, mean TTFT was 22% lower than at
/// 100 ms (4 alternating runs, lower in each), with 128-token answers level.
pub const DEFAULT_STEP_BUDGET_MS: f64 = 150.0;
/// Default share of the engine's time that ingestion gets while answers decode.
pub const DEFAULT_INGEST_SHARE: f64 = 0.25;

/// Default of [`EngineConfig::encode_first`]: off. Measured on the 2-core machine, W1 with
/// SmolVLM-256M's shapes (docs/benchmarks.md, "The bound with every frame encoded, and
/// `encode-first`"): mean TTFT from capture 3% lower with it (the second stream's frame is
/// encoded 0.3 s sooner), but the answers paused meanwhile end about 4 s later (5.8 s from the
/// first token to the last instead of 1.9 s).
pub const DEFAULT_ENCODE_FIRST: bool = false;

/// Most of `threads` a `gpu` engine with every layer on the GPU takes unless its entry names a
/// count: its CPU threads only gather token embeddings (llama.cpp keeps the input layer on the
/// CPU), so more of them only compete for the cores that the encoders' picture preparation and
/// the other engines need. Measured on an H200 (16 cores), 32 live
/// SmolVLM-500M cameras on two GPU engines, 4 threads against 16 in alternating runs: p95 TTFT
/// 905 and 1385 ms against 1627 and 2088, frames skipped 34 and 152 against 126 and 216; at 16
/// staggered streams (capacity, from capture) level (p95 474 and 447 ms against 550 and 434).
pub const GPU_ENGINE_THREADS: i32 = 4;

/// The threads an engine on `device` takes of `threads` when it is given no count of its own:
/// at most [`GPU_ENGINE_THREADS`] on a GPU holding every layer, all of them elsewhere.
pub fn default_threads(device: &Device, threads: i32) -> i32 {
    match device {
        Device::Gpu(Gpu { layers: None, .. }) => threads.min(GPU_ENGINE_THREADS),
        _ => threads,
    }
}

/// Most inputs one `llama_decode` of an engine on `device` serving `max_streams` streams takes
/// (its `n_batch` and `n_ubatch`). On a GPU 2048 for many streams and 1024 for a few (at most
/// [`FEW_GPU_STREAMS`]): a SmolVLM-500M frame (862 rows) then goes in one decode instead of two,
/// measured with `examples/ingest_rate.rs` on an H100 (the frame after a 2,048-row history, a
/// per-sequence context of 24 sequences as an engine's, flash attention): 21.5 ms a frame at 2048
/// and 22.3 ms at 1024 against 28.5 ms at 512, 1.33x the rows a second. The compute buffer holds
/// a row of logits for every input of a decode, so a few streams, where ingestion is not what
/// bounds the engine, take the smaller batch for 4% of a frame's ingestion: W1 on an H100, 96 MiB
/// less GPU memory (docs/benchmarks.md, "W1's memory on a GPU with the defaults"). Elsewhere 512 (not measured with more; on the CPU
/// the compute buffer it sizes stays small).
pub fn decode_batch(device: &Device, max_streams: u32) -> u32 {
    match device {
        Device::Gpu(_) if max_streams <= FEW_GPU_STREAMS => 1024,
        Device::Gpu(_) => 2048,
        Device::Cpu | Device::Rpc(_) => 512,
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            name: "cpu".into(),
            device: Device::Cpu,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get() as i32),
            context_per_sequence: 2048,
            max_streams: 2,
            max_branches: 8,
            flash_attention: false,
            kv_layout: KvLayout::PerSequence,
            kv_type: KvType::F16,
            gpu: Gpu::default(),
            answer_cells: 256,
            cores: Vec::new(),
            step_budget_ms: DEFAULT_STEP_BUDGET_MS,
            ingest_share: DEFAULT_INGEST_SHARE,
            merge_frames: None,
            encode_first: DEFAULT_ENCODE_FIRST,
        }
    }
}

/// How an engine's KV cells are laid out (llama.cpp's `kv_unified`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvLayout {
    /// A buffer of `context_per_sequence` cells for every stream and every answer: a branch
    /// copies its version's prefix; retained, branched and re-prefilled histories give
    /// bit-identical logits.
    #[default]
    PerSequence,
    /// One pool for all: a branch shares its version's prefix cells (it costs its suffix), the
    /// pool is sized from the streams and answers (`context_per_sequence` per stream and one
    /// more for versions held over a restart or an import, `answer_cells` per answer). Attention
    /// then runs over the pool's cells in pool order, so greedy tokens agree with a re-prefill
    /// closely but not bit for bit (docs/benchmarks.md, "Memory").
    Unified,
}

/// Most streams for which a list with a GPU engine counts as serving a few: `kv-layout=auto`
/// keeps its engines in the unified pool, and its GPU engines decode at most 1024 inputs at once
/// ([`decode_batch`]). W1 (2 live SmolVLM-500M streams at 2 frames/s, 128-token answers) on one H100
/// GPU engine: the same TTFT from capture as per-sequence KV (143 ms mean, rounds 142 and 144,
/// against 141 and 145) at 3,466 MiB of GPU memory against 5,572; at 4 streams the pool's
/// attention over every stream's cells costs 294 ms against 254 (docs/benchmarks.md, "W1's memory
/// on a GPU with the defaults"; at 8 and 16 streams 337 against 238 and 3,170 against 535 ms,
/// "The KV layout on the GPU").
pub const FEW_GPU_STREAMS: u32 = 2;

impl KvLayout {
    /// What `kv-layout=auto` is for engines on `devices` serving `max_streams` streams: the
    /// unified pool where every engine is on the CPU (W1's peak RSS under llama-server's, TTFT no
    /// worse: docs/benchmarks.md, "Defaults"), or on the CPU and GPUs for at most
    /// [`FEW_GPU_STREAMS`] streams; per-sequence KV otherwise, and with a remote engine
    /// (not measured in the pool).
    pub fn auto(devices: &[SpecDevice], max_streams: u32) -> KvLayout {
        let on = |d: fn(&SpecDevice) -> bool| devices.iter().any(d);
        if on(|d| matches!(d, SpecDevice::Rpc(_))) {
            KvLayout::PerSequence
        } else if !on(|d| *d == SpecDevice::Gpu) || max_streams <= FEW_GPU_STREAMS {
            KvLayout::Unified
        } else {
            KvLayout::PerSequence
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvLayout::PerSequence => "per-sequence",
            KvLayout::Unified => "unified",
        }
    }

    pub fn parse(name: &str) -> Option<KvLayout> {
        [KvLayout::PerSequence, KvLayout::Unified].into_iter().find(|l| l.name() == name)
    }
}

impl EngineConfig {
    /// Whether frames go as one batch of rows ([`EngineConfig::merge_frames`]).
    pub fn merges_frames(&self) -> bool {
        self.merge_frames.unwrap_or(self.device != Device::Cpu)
    }

    /// Cells of the unified pool (`None` for per-sequence buffers).
    pub fn unified_cells(&self) -> Option<u32> {
        (self.kv_layout == KvLayout::Unified)
            .then(|| (self.max_streams + 1) * self.context_per_sequence + self.max_branches * self.answer_cells)
    }
}

impl EngineConfig {
    /// Engines from a list such as `cpu`, `cpu,gpu`, `big:cpu:4:4-7,little:cpu:4:0-3` or
    /// `cpu,far:rpc:10.0.0.2:50052`: each entry is `NAME[:DEVICE[:THREADS[:CORES]]]`, DEVICE `cpu`
    /// or `gpu` (default: `gpu` for a name starting with "gpu", else `cpu`), THREADS defaulting to
    /// `base.threads` ([`default_threads`]), CORES a list of cores and ranges joined by `+`
    /// (`0-3`, `4+6`), or
    /// `NAME:rpc:HOST:PORT[+HOST:PORT...]` (llama.cpp `rpc-server`s). Other fields come from
    /// `base` (a `gpu` engine's GPU and layers from `base.gpu`). The parsing itself is [`crate::engine_spec::parse_list`].
    pub fn parse_list(spec: &str, base: &EngineConfig) -> Result<Vec<EngineConfig>> {
        let specs = crate::engine_spec::parse_list(spec).map_err(Error::Config)?;
        Ok(specs
            .into_iter()
            .map(|e| {
                let device = match e.device {
                    SpecDevice::Cpu => Device::Cpu,
                    SpecDevice::Gpu => Device::Gpu(base.gpu.clone()),
                    SpecDevice::Rpc(endpoints) => Device::Rpc(endpoints),
                };
                let threads = e.threads.unwrap_or_else(|| default_threads(&device, base.threads));
                EngineConfig { name: e.name, device, threads, cores: e.cores, ..base.clone() }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_layout_is_the_pool_on_cpus_and_for_few_streams_on_a_gpu() {
        let rpc = || SpecDevice::Rpc(vec!["10.0.0.2:50052".into()]);
        assert_eq!(KvLayout::auto(&[SpecDevice::Cpu, SpecDevice::Cpu], 64), KvLayout::Unified);
        assert_eq!(KvLayout::auto(&[SpecDevice::Gpu], 1), KvLayout::Unified);
        assert_eq!(KvLayout::auto(&[SpecDevice::Cpu, SpecDevice::Gpu], FEW_GPU_STREAMS), KvLayout::Unified);
        assert_eq!(KvLayout::auto(&[SpecDevice::Cpu, SpecDevice::Gpu], FEW_GPU_STREAMS + 1), KvLayout::PerSequence);
        assert_eq!(KvLayout::auto(&[SpecDevice::Cpu, rpc()], 1), KvLayout::PerSequence);
    }

    #[test]
    fn engine_lists_parse_and_bad_ones_are_refused() {
        let base = EngineConfig { threads: 2, ..EngineConfig::default() };
        let e = EngineConfig::parse_list("cpu", &base).unwrap();
        assert_eq!((e.len(), e[0].name.as_str(), &e[0].device, e[0].threads), (1, "cpu", &Device::Cpu, 2));
        let e = EngineConfig::parse_list("big:cpu:1, little:cpu:1,gpu", &base).unwrap();
        assert_eq!(
            e.iter().map(|e| (e.name.as_str(), e.device.name(), e.threads)).collect::<Vec<_>>(),
            [("big", "cpu", 1), ("little", "cpu", 1), ("gpu", "gpu", 2)]
        );
        let e = EngineConfig::parse_list("big:cpu:2:2-3+6,little:cpu:1:0", &base).unwrap();
        assert_eq!((e[0].cores.clone(), e[1].cores.clone()), (vec![2, 3, 6], vec![0]));
        // A GPU engine with every layer on the GPU takes at most GPU_ENGINE_THREADS unless named.
        let wide = EngineConfig { threads: 16, ..EngineConfig::default() };
        let e = EngineConfig::parse_list("cpu,gpu,g:gpu:16", &wide).unwrap();
        assert_eq!(e.iter().map(|e| e.threads).collect::<Vec<_>>(), [16, GPU_ENGINE_THREADS, 16]);
        let partial = EngineConfig { gpu: Gpu { index: 0, layers: Some(8) }, ..wide };
        assert_eq!(EngineConfig::parse_list("gpu", &partial).unwrap()[0].threads, 16, "CPU layers keep every thread");
        for bad in ["", "a:tpu", "a:cpu:0", "a,a", "auto", "a b", "a:cpu:1:3-2", "a:cpu:1:x", "a:cpu:1:0:9"] {
            assert!(EngineConfig::parse_list(bad, &base).is_err(), "{bad:?} must be refused");
        }
    }
}
