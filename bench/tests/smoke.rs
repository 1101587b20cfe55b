//! The benchmark's seconds-long smoke run (what CI runs): one configuration, 2 frames, 1 question
//! per stream, 8 tokens, through the real binary, its worker process and the test models; the
//! clocks its JSON names; and the requests llama-server's two clients plan (no server needed).

use std::path::{Path, PathBuf};
use std::process::Command;

fn model_file(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var).map_or_else(|| manifest_dir().join("../models").join(default), PathBuf::from)
}

/// This package's directory, as cargo names it when it runs the test (the one compiled in is
/// only a fallback: a target directory shared by two checkouts may hold a binary built in the other).
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// Run `vlm-bench ARGS` on the test models, writing its JSON to `json` and plots to `plots`, its
/// logs to `dir`; the report and the program's stderr.
fn smoke(args: &[&str], dir: &Path, json: &Path, plots: &Path) -> (serde_json::Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vlm-bench"))
        .args(args)
        .arg("--model")
        .arg(model_file("VLM_MODEL", "SmolLM2-135M-Instruct.Q4_1.gguf"))
        .arg("--mmproj")
        .arg(model_file("VLM_MMPROJ", "test-mmproj-mlp.gguf"))
        .arg("--json")
        .arg(json)
        .arg("--plots")
        .arg(plots)
        .arg("--log-dir")
        .arg(dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "vlm-bench {args:?} failed: {stderr}");
    (serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap(), stderr)
}

/// Every key of `v` that holds a TTFT names its clock (from capture or from the question).
fn assert_ttft_clocks_named(v: &serde_json::Value, path: &str) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                if k.contains("ttft") && !k.starts_with("markdown") {
                    assert!(
                        k.contains("from_capture") || k.contains("from_question") || k.contains("over"),
                        "{path}.{k}: a TTFT field that does not name its clock"
                    );
                }
                assert_ttft_clocks_named(v, &format!("{path}.{k}"));
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| assert_ttft_clocks_named(v, path)),
        _ => {}
    }
}

fn f64_of(v: &serde_json::Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {v}"))
}

#[test]
fn smoke_run_answers_every_question_with_the_exact_length() {
    let dir = std::env::temp_dir().join(format!("vlm-bench-smoke-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("report.json");
    let plots = dir.join("plots");
    let (report, stderr) = smoke(&["--smoke"], &dir, &json, &plots);
    let s = &report["summaries"][0];
    assert_eq!(s["config"], "B1");
    assert_eq!((s["answered"].as_u64(), s["expected"].as_u64()), (Some(2), Some(2)));
    assert_eq!((s["length_min"].as_u64(), s["length_max"].as_u64()), (Some(8), Some(8)), "exact length");
    assert_eq!(s["path_resident"].as_u64(), Some(2));
    assert!(s["peak_rss_mib"].as_f64().unwrap() > 50.0, "the worker's RSS holds the model");
    assert!(s["load_ms"].as_f64().unwrap() > 0.0);
    // The clocks: from the frame's capture (the headline, encoding included) and from the
    // question's arrival (right after the frame's registration), staleness and feed lateness.
    assert_ttft_clocks_named(&report, "report");
    for answer in report["runs"][0]["answers"].as_array().unwrap() {
        let (capture, question) = (f64_of(answer, "ttft_from_capture_ms"), f64_of(answer, "ttft_from_question_ms"));
        assert!(question > 0.0 && capture >= question, "{answer}");
        assert!(f64_of(answer, "total_ms") >= question);
        assert_eq!(answer["capture_ms"].as_f64(), Some(500.0), "frame 2 at 2 frames/s is due 500 ms in");
        let arrival = f64_of(answer, "arrival_ms");
        assert!((capture - (arrival - 500.0 + question)).abs() < 1e-6, "{answer}");
        // The question binds to its own frame: staleness is the frame's encode and registration.
        assert!((f64_of(answer, "staleness_ms") - (arrival - 500.0)).abs() < 1e-6, "{answer}");
    }
    for key in ["ttft_from_capture_mean_ms", "ttft_from_capture_p95_ms", "ttft_from_question_mean_ms"] {
        assert!(f64_of(s, key) > 0.0, "{key}");
    }
    assert!(f64_of(s, "ttft_from_capture_mean_ms") >= f64_of(s, "ttft_from_question_mean_ms"));
    assert!(f64_of(s, "feed_late_max_ms") >= f64_of(s, "feed_late_mean_ms"));
    assert!(f64_of(s, "feed_late_mean_ms") > 0.0, "registration follows encoding");
    assert!(f64_of(s, "encoder_fps") > 0.0);
    assert!(s["staleness_mean_ms"].as_f64().is_some());
    // The defaults resolved by the worker: on CPU engines the unified pool and one encoder context.
    let run = &report["runs"][0];
    assert_eq!((run["kv_layout"].as_str(), run["encoder_contexts"].as_u64()), (Some("unified"), Some(1)), "{run}");
    let feed = &report["runs"][0]["feed"];
    assert_eq!((feed["frames"].as_u64(), feed["encoded"].as_u64()), (Some(4), Some(4)), "2 streams x 2 frames");
    assert!(report["markdown_table"].as_str().unwrap().contains("TTFT from capture mean"));
    // Each frame's way from capture to its published version (issue 28, item 4), per stream.
    let timings = report["runs"][0]["frame_timings"].as_array().unwrap();
    assert_eq!(timings.len(), 4, "{timings:?}");
    for t in timings {
        let (due, registered) = (f64_of(t, "due_ms"), f64_of(t, "registered_ms"));
        assert!(f64_of(t, "encode_start_ms") >= due && f64_of(t, "encode_end_ms") <= registered, "{t}");
        assert!(f64_of(t, "published_ms") >= registered, "every frame published: {t}");
    }
    let stages = s["frame_stages"].as_array().unwrap();
    assert_eq!(stages.len(), 2, "one row per stream");
    assert!(stages.iter().all(|st| f64_of(st, "capture_to_published_ms") > f64_of(st, "encode_ms")));
    // Plots need a TrueType font; the message says so when there is none.
    if plots.join("ttft.png").exists() {
        for name in ["ttft.png", "throughput.png", "decode.png"] {
            assert!(std::fs::metadata(plots.join(name)).unwrap().len() > 1000, "{name}");
        }
    } else {
        assert!(stderr.contains("no plots"), "{stderr}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn capacity_smoke_runs_two_levels_and_the_history_curve() {
    let dir = std::env::temp_dir().join(format!("vlm-bench-capacity-smoke-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("capacity.json");
    let plots = dir.join("plots");
    let (report, stderr) = smoke(&["capacity", "--smoke"], &dir, &json, &plots);
    assert_eq!(report["benchmark"], "vlm-bench capacity");
    let levels = report["levels"].as_array().unwrap();
    // S = 1 and 2, B1 alone (a CI machine that misses the 2 s target at S = 1 stops there).
    assert!(!levels.is_empty() && levels.len() <= 2, "{levels:?}");
    for (level, streams) in levels.iter().zip([1, 2]) {
        assert_eq!((level["streams"].as_u64(), level["config"].as_str()), (Some(streams), Some("B1")));
        let s = &level["summary"];
        assert_eq!(s["expected"].as_u64(), Some(2 * streams), "a question after frames 2 and 4 of each stream");
        assert_eq!(level["lost"].as_u64(), Some(0), "{level}");
        assert_eq!((s["length_min"].as_u64(), s["length_max"].as_u64()), (Some(8), Some(8)), "exact length");
        assert!(s["peak_rss_mib"].as_f64().unwrap() > 50.0, "the worker's own RSS");
        assert!(level["sustained"].is_boolean() && level["verdict"].is_string());
        assert!(f64_of(s, "ttft_from_capture_p95_ms") >= f64_of(s, "ttft_from_question_p95_ms"), "{s}");
        assert!(s["feed_late_max_ms"].as_f64().is_some() && s["encoder_fps"].as_f64().is_some(), "{s}");
    }
    assert_ttft_clocks_named(&report, "report");
    assert!(report["markdown_levels"].as_str().unwrap().contains("TTFT from capture"));
    let history = report["history"].as_array().unwrap();
    assert_eq!(history.len(), 2, "points 2 and 4 of B1");
    for (point, frames) in history.iter().zip([2, 4]) {
        assert_eq!((point["frames"].as_u64(), point["answered"].as_u64()), (Some(frames), Some(1)));
        assert!(f64_of(point, "ttft_from_question_median_ms") > 0.0 && f64_of(point, "prime_ms") > 0.0);
    }
    assert!(report["runs"][0]["record"]["frame_cells"].as_u64().is_some_and(|c| c > 0));
    // The plots, and their redraw from the JSON.
    if plots.join("capacity-ttft.png").exists() {
        let again = dir.join("again");
        let status = Command::new(env!("CARGO_BIN_EXE_vlm-bench"))
            .args(["plot", "--from"])
            .arg(&json)
            .arg("--plots")
            .arg(&again)
            .status()
            .unwrap();
        assert!(status.success());
        for name in ["capacity-ttft.png", "capacity-throughput.png", "capacity-rss.png", "history-ttft.png"] {
            assert!(std::fs::metadata(plots.join(name)).unwrap().len() > 1000, "{name}");
            assert!(std::fs::metadata(again.join(name)).unwrap().len() > 1000, "{name} redrawn");
        }
    } else {
        assert!(stderr.contains("no plots"), "{stderr}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The requests `vlm-bench --print-peer-plan MODE` plans over 2 streams x 3 frames at 2 frames/s,
/// a question after frame 2, 8 tokens.
fn peer_plan(mode: &str) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_vlm-bench"))
        .args(["--print-peer-plan", mode, "--streams", "2", "--frames", "3", "--fps", "2"])
        .args(["--ask-after", "2", "--questions", "1", "--tokens", "8"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(plan["mode"], mode);
    plan["requests"].as_array().unwrap().clone()
}

/// The images a planned request carries, by their placeholder names.
fn images(request: &serde_json::Value) -> Vec<String> {
    let content = request["body"]["messages"][1]["content"].as_array().unwrap();
    content.iter().filter_map(|c| c["image_url"]["url"].as_str().map(str::to_owned)).collect()
}

fn text(request: &serde_json::Value) -> Option<String> {
    let content = request["body"]["messages"][1]["content"].as_array().unwrap();
    content.iter().find_map(|c| c["text"].as_str().map(str::to_owned))
}

#[test]
fn the_warm_peer_sends_each_frame_as_captured_then_the_question_on_its_slot() {
    let requests = peer_plan("warm");
    // Per stream: frame 1's 1-token request at 0 ms, the question at frame 2's due time (500 ms)
    // carrying frames 1-2, frame 3's 1-token request at 1000 ms.
    assert_eq!(requests.len(), 6, "{requests:?}");
    for (stream, mine) in requests.chunks(3).enumerate() {
        let frames: Vec<(u64, Option<u64>, f64)> = mine
            .iter()
            .map(|r| (r["frame"].as_u64().unwrap(), r["question"].as_u64(), r["due_ms"].as_f64().unwrap()))
            .collect();
        assert_eq!(frames, vec![(1, None, 0.0), (2, Some(0), 500.0), (3, None, 1000.0)]);
        for (r, n) in mine.iter().zip(1..) {
            assert_eq!(r["stream"].as_u64(), Some(stream as u64));
            let body = &r["body"];
            assert_eq!(body["id_slot"].as_u64(), Some(stream as u64), "the stream's own slot");
            assert_eq!(body["cache_prompt"], true, "prompt cache on every request");
            let expected: Vec<String> = (1..=n).map(|k| format!("frame {stream}:{k}")).collect();
            assert_eq!(images(r), expected, "the stream's history so far, in order");
        }
        let (frame, question) = (&mine[0]["body"], &mine[1]["body"]);
        assert_eq!((frame["n_predict"].as_u64(), frame["stream"].as_bool()), (Some(1), Some(false)));
        assert_eq!(text(&mine[0]), None, "a frame's request carries no text");
        assert_eq!((question["n_predict"].as_u64(), question["stream"].as_bool()), (Some(8), Some(true)));
        assert_eq!((question["ignore_eos"].as_bool(), question["temperature"].as_f64()), (Some(true), Some(0.0)));
        assert!(text(&mine[1]).is_some_and(|t| !t.is_empty()));
        assert_eq!(mine[2]["body"]["n_predict"].as_u64(), Some(1));
    }
}

#[test]
fn the_naive_peer_sends_only_the_questions_with_every_frame() {
    let requests = peer_plan("naive");
    assert_eq!(requests.len(), 2, "one question per stream: {requests:?}");
    for (stream, r) in requests.iter().enumerate() {
        assert_eq!(
            (r["stream"].as_u64(), r["frame"].as_u64(), r["question"].as_u64()),
            (Some(stream as u64), Some(2), Some(0))
        );
        assert_eq!(r["due_ms"].as_f64(), Some(500.0));
        assert_eq!(images(r), vec![format!("frame {stream}:1"), format!("frame {stream}:2")]);
        assert_eq!(
            (r["body"]["id_slot"].as_u64(), r["body"]["cache_prompt"].as_bool()),
            (Some(stream as u64), Some(true))
        );
    }
}

/// `vlm-bench encoders --smoke` on the tiled idefics3 test pair: every context count at every
/// stream count, every frame's images counted, the one-context level the peer.
#[test]
fn encoders_smoke_measures_every_context_and_stream_count() {
    let dir = std::env::temp_dir().join(format!("vlm-bench-encoders-smoke-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("encoders.json");
    let models = manifest_dir().join("../models");
    let out = Command::new(env!("CARGO_BIN_EXE_vlm-bench"))
        .args(["encoders", "--smoke", "--model"])
        .arg(models.join("test-idefics3-lm.gguf"))
        .arg("--mmproj")
        .arg(models.join("test-idefics3-mmproj.gguf"))
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let tiles = report["tiles_a_frame"].as_u64().unwrap();
    assert!(tiles > 1, "a tiled projector: {report}");
    let levels = report["levels"].as_array().unwrap();
    let seen: Vec<_> =
        levels.iter().map(|l| (l["contexts"].as_u64().unwrap(), l["streams"].as_u64().unwrap())).collect();
    assert_eq!(seen, [(1, 1), (1, 2), (2, 1), (2, 2)]);
    for l in levels {
        let (streams, frames) = (l["streams"].as_u64().unwrap(), l["frames"].as_u64().unwrap());
        assert_eq!(frames, streams * 2, "{l}");
        assert_eq!(l["tiles"].as_u64(), Some(frames * tiles), "{l}");
        assert!(f64_of(l, "frames_per_s") > 0.0 && f64_of(l, "encode_p95_ms") > 0.0, "{l}");
        assert_eq!(l["speedup"].is_null(), l["contexts"].as_u64() == Some(1), "{l}");
        // The CPU encoder: resident memory once the level's contexts are warm.
        assert!(l["memory_mib"].as_u64().is_some_and(|m| m > 0), "{l}");
    }
    assert!(report["table"].as_str().unwrap().contains("peer: 1 context(s)"));
    assert!(report["table"].as_str().unwrap().contains("resident MiB"));
    std::fs::remove_dir_all(&dir).unwrap();
}
