//! Every command in README.md runs as written. The `gst-launch-1.0` lines of its `sh` blocks are
//! expanded by bash (quotes, `$(...)`) into the arguments gst-launch-1.0 would get and built with
//! `gst::parse::launchv`, as gst-launch-1.0 builds them, then run to EOS; only what this machine
//! lacks is replaced, and said here: the camera (`v4l2src`: a bounded `videotestsrc`), the display
//! (`autovideosink`: `fakesink`), the placeholder model files (the test pair), the files the
//! commands name (`questions.srt`: pipelines/questions.srt; an output file: a temporary one) and
//! the MQTT broker (a port where none listens).
//! Every other command must be run elsewhere, and [`RUN_ELSEWHERE`] says where: a command added
//! to the README that is neither fails this test.

mod common;

use common::*;

/// README commands that other runs execute, with where.
const RUN_ELSEWHERE: &[(&str, &str)] = &[
    ("scripts/demo.sh", "scripts/test.sh runs the demo and checks its three answers"),
    ("scripts/test.sh", ".ci/run"),
    ("export GST_PLUGIN_PATH=", "an environment setting (the plugin here is registered statically)"),
    ("GST_PLUGIN_PATH=target/debug /usr/bin/python3 examples/ask.py", "scripts/test.sh"),
    ("cargo run -p gst-plugin-vlm --example ask", "scripts/test.sh"),
];

/// The commands of README.md's `sh` blocks, continuation lines joined, comments dropped.
fn readme_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let mut commands = Vec::new();
    let mut in_sh = false;
    let mut command = String::new();
    for line in readme.lines() {
        if line.starts_with("```") {
            in_sh = !in_sh && line == "```sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        let line = line.split(" #").next().unwrap().trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(head) => command.push_str(head),
            None => {
                command.push_str(line);
                commands.push(std::mem::take(&mut command));
            }
        }
    }
    commands
}

/// A README pipeline made runnable here (see the module's comment), with `output` for a file it
/// writes.
fn runnable_here(command: &str, output: &std::path::Path) -> String {
    let camera = "videotestsrc pattern=ball num-buffers=110 ! video/x-raw,width=160,height=120,framerate=10/1";
    command
        .replace("v4l2src", camera)
        .replace("autovideosink", "fakesink")
        .replace("mmproj=mmproj.gguf", &format!("mmproj={}", mmproj()))
        .replace("model=model.gguf", &format!("model={}", model()))
        .replace("location=questions.srt", "location=pipelines/questions.srt")
        .replace("location=alerts.jsonl", &format!("location={}", output.display()))
        // No broker of the user's is written to: nothing listens on port 1 (vlmpublish warns
        // and the pipeline runs on, as it must without a broker).
        .replace("address=localhost:1883", "address=127.0.0.1:1")
}

/// The arguments bash gives gst-launch-1.0 for `args` (quotes removed, `$(...)` expanded).
fn shell_words(args: &str) -> Vec<String> {
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!("printf '%s\\0' {args}"))
        .current_dir(root())
        .output()
        .unwrap();
    assert!(out.status.success(), "bash could not expand {args}: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout.split(|&b| b == 0).filter(|w| !w.is_empty()).map(|w| String::from_utf8(w.to_vec()).unwrap()).collect()
}

#[test]
fn every_readme_command_runs() {
    init();
    let commands = readme_commands();
    assert!(commands.len() >= 6, "README.md lost its commands: {commands:?}");
    let dir = std::env::temp_dir().join(format!("gst-vlm-readme-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut launched = 0;
    for (i, command) in commands.iter().enumerate() {
        let Some(args) = command.strip_prefix("gst-launch-1.0 ") else {
            assert!(
                RUN_ELSEWHERE.iter().any(|(c, _)| command.starts_with(c)),
                "README.md's command `{command}` is neither a gst-launch-1.0 pipeline nor run elsewhere"
            );
            continue;
        };
        let output = dir.join(format!("output-{i}"));
        let words: Vec<String> = shell_words(&runnable_here(args, &output)).into_iter().filter(|w| w != "-m").collect();
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        let pipeline =
            gst::parse::launchv(&words).unwrap_or_else(|e| panic!("README.md's `{command}` does not parse: {e}"));
        eprintln!("[readme] {}", words.join(" "));
        let run = run(&pipeline);
        assert!(run.errors.is_empty(), "README.md's `{command}` failed: {:?}", run.errors);
        if command.contains("questions.srt") {
            // One answer per subtitle of pipelines/questions.srt, each from the frames before it.
            assert_eq!(run.answers.len(), 3, "`{command}`: {:?}", run.answers);
            for a in &run.answers {
                assert_eq!(a.get::<&str>("status").unwrap(), "answered", "`{command}`: {a}");
                assert!(a.get::<u64>("frames").unwrap() > 0, "`{command}`: {a}");
            }
        }
        if let Some(list) = command.split("alerts=\"").nth(1).and_then(|rest| rest.split('"').next()) {
            // A vlm-alert with each alert's first state.
            let alerts: Vec<_> = run.messages.iter().filter(|m| m.name() == "vlm-alert").collect();
            for id in list.split(';').filter_map(|a| a.split(':').next()) {
                assert!(
                    alerts.iter().any(|a| a.get::<&str>("id").unwrap() == id),
                    "`{command}`: no vlm-alert for {id}"
                );
            }
        }
        if command.contains("location=alerts.jsonl") {
            let lines = std::fs::read_to_string(&output).unwrap();
            assert!(lines.lines().count() >= 2, "`{command}` wrote {lines:?}");
            for line in lines.lines() {
                let json: serde_json::Value = serde_json::from_str(line).unwrap();
                assert_eq!(json["type"], "alert", "{line}");
            }
        }
        launched += 1;
    }
    assert!(launched >= 4, "README.md's gst-launch-1.0 pipelines: {launched}");
    std::fs::remove_dir_all(&dir).ok();
}
