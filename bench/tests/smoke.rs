//! The benchmark's seconds-long smoke run (what CI runs): one configuration, 2 frames, 1 question
//! per stream, 8 tokens, through the real binary, its worker process and the test models.

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
    for answer in report["runs"][0]["answers"].as_array().unwrap() {
        assert!(answer["ttft_ms"].as_f64().unwrap() > 0.0);
        assert!(answer["total_ms"].as_f64().unwrap() >= answer["ttft_ms"].as_f64().unwrap());
    }
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
    }
    let history = report["history"].as_array().unwrap();
    assert_eq!(history.len(), 2, "points 2 and 4 of B1");
    for (point, frames) in history.iter().zip([2, 4]) {
        assert_eq!((point["frames"].as_u64(), point["answered"].as_u64()), (Some(frames), Some(1)));
        assert!(point["ttft_median_ms"].as_f64().unwrap() > 0.0 && point["prime_ms"].as_f64().unwrap() > 0.0);
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
