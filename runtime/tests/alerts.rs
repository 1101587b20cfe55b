//! Standing questions against real llama.cpp: the forced choice of an alert read on the
//! stream's branch equals the same two tokens' logits on a branch that re-prefills the whole
//! history (bit for bit, on the CPU backend), evaluations queued together share one decode, and
//! cancelled evaluations end.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use common::*;
use vlm_runtime::PreparePath;
use vlm_runtime::alert::{self, AlertSpec, YesNo};

fn alerts() -> Vec<AlertSpec> {
    alert::parse_alerts("door:Is the door open?;person:Is there a person in the picture?;red:Is it red?").unwrap()
}

#[test]
fn the_forced_choice_equals_the_logits_of_a_re_prefilled_branch() {
    let engine = engine("cpu");
    let enc = encoder();
    let stream = open(&engine, "s", true);
    let never = Arc::new(AtomicBool::new(false));
    let version = with_frames(&stream, &enc, 2);
    let yes_no = YesNo::find(engine.model()).expect("the test model has yes and no tokens");
    assert_ne!(yes_no.yes, yes_no.no);
    let alerts = alerts();
    let branched = alert::evaluate(&version, &alerts, yes_no, &never).unwrap();
    let replayed = alert::evaluate_on(&version, &alerts, yes_no, &engine, PreparePath::Replay, &never).unwrap();
    for ((a, b), spec) in branched.into_iter().zip(replayed).zip(&alerts) {
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.id, spec.id);
        assert_eq!((a.path, b.path), (PreparePath::Resident, PreparePath::Replay));
        assert_eq!((a.frame, a.frames), (2, 2));
        eprintln!("{}: yes {} no {} p {:.4}", a.id, a.choice.yes_logit, a.choice.no_logit, a.choice.probability());
        assert_eq!(
            (a.choice.yes_logit.to_bits(), a.choice.no_logit.to_bits()),
            (b.choice.yes_logit.to_bits(), b.choice.no_logit.to_bits()),
            "alert {}: branch {:?} vs re-prefilled {:?}",
            a.id,
            a.choice,
            b.choice
        );
        assert_eq!(a.choice.state(), a.choice.yes_logit > a.choice.no_logit);
        assert_eq!(a.choice.probability(), b.choice.probability());
    }
    // The same version evaluated again gives the same choice (no sampling).
    let again = alert::evaluate(&version, &alerts[..1], yes_no, &never).unwrap().remove(0).unwrap();
    let first = alert::evaluate(&version, &alerts[..1], yes_no, &never).unwrap().remove(0).unwrap();
    assert_eq!(again.choice, first.choice);
}

#[test]
fn cancelled_evaluations_end_with_cancelled() {
    let engine = engine("cpu");
    let enc = encoder();
    let stream = open(&engine, "s", true);
    let never = Arc::new(AtomicBool::new(false));
    stream.register(frame(&enc, 0), &never).unwrap();
    let version = stream.wait_version(1, &never).unwrap();
    let yes_no = YesNo::find(engine.model()).unwrap();
    let cancel = Arc::new(AtomicBool::new(true));
    let results = alert::evaluate(&version, &alerts(), yes_no, &cancel).unwrap();
    assert_eq!(results.len(), 3);
    for r in results {
        assert!(matches!(r, Err(vlm_runtime::Error::Cancelled)), "{r:?}");
    }
}

/// A question a user asks goes before the alert evaluations waiting on the same engine: with the
/// engine held while eight evaluations and then a one-token question are queued, the question is
/// answered before any evaluation ends (both ends measured on the engine thread).
#[test]
fn a_users_question_goes_before_waiting_evaluations() {
    let engine = engine("cpu");
    let enc = encoder();
    let stream = open(&engine, "s", true);
    let never = Arc::new(AtomicBool::new(false));
    stream.register(frame(&enc, 0), &never).unwrap();
    let version = stream.wait_version(1, &never).unwrap();
    let yes_no = YesNo::find(engine.model()).unwrap();
    let list = (0..8).map(|i| format!("a{i}:Is there a thing number {i}?")).collect::<Vec<_>>().join(";");
    let alerts = alert::parse_alerts(&list).unwrap();
    // Hold the engine thread until everything is queued.
    let (release, holder) = hold(&engine);
    let backlog = |above: f64| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while engine.start_backlog_ms() <= above {
            assert!(std::time::Instant::now() < deadline, "the work was not queued");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        engine.start_backlog_ms()
    };
    std::thread::scope(|scope| {
        let evaluations = scope.spawn(|| alert::evaluate(&version, &alerts, yes_no, &never).unwrap());
        let before = backlog(0.0);
        // Every evaluation was submitted by now (the engine's backlog counts them).
        let submitted_by = std::time::Instant::now();
        let question = question("Say yes.", 1);
        let arrival = question.arrival;
        let (version, never) = (&version, &never);
        let answer = scope.spawn(move || vlm_runtime::answer(version, &question, never, |_| {}).unwrap());
        backlog(before);
        release.send(()).unwrap();
        let answer = answer.join().unwrap();
        let answered = arrival + std::time::Duration::from_secs_f64(answer.total_ms / 1e3);
        for e in evaluations.join().unwrap() {
            let e = e.unwrap();
            // An evaluation's time counts from its submission, before `submitted_by`: its end
            // is at the latest this (no wall-clock luck in the bound; the slack is the few
            // milliseconds of queueing, an evaluation's prefill takes far more).
            let ended = submitted_by + std::time::Duration::from_secs_f64(e.total_ms / 1e3);
            assert!(answered < ended, "evaluation {} ended before the user's question was answered", e.id);
        }
    });
    holder.join().unwrap();
}

/// A frame registered while evaluations wait to start takes turns with them: a history keeps up
/// with its camera for the alerts read from it (they thin out instead). Eight evaluations that
/// each re-prefill the history (replays: one after another, none sharing a decode) are queued
/// on a held engine, then a frame; when the frame's version is published, the evaluations have
/// not all ended (before the change they all went first).
#[test]
fn a_frame_does_not_wait_behind_every_waiting_evaluation() {
    let engine = engine("cpu");
    let enc = encoder();
    let stream = open(&engine, "s", true);
    let never = Arc::new(AtomicBool::new(false));
    let version = with_frames(&stream, &enc, 3);
    let yes_no = YesNo::find(engine.model()).unwrap();
    let list = (0..8).map(|i| format!("a{i}:Is there a thing number {i}?")).collect::<Vec<_>>().join(";");
    let alerts = alert::parse_alerts(&list).unwrap();
    let (release, holder) = hold(&engine);
    std::thread::scope(|scope| {
        let evaluations = scope
            .spawn(|| alert::evaluate_on(&version, &alerts, yes_no, &engine, PreparePath::Replay, &never).unwrap());
        while engine.start_backlog_ms() <= 0.0 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        stream.register(frame(&enc, 3), &never).unwrap();
        release.send(()).unwrap();
        stream.wait_version(4, &never).unwrap();
        assert!(!evaluations.is_finished(), "every evaluation ended before the frame joined the history");
        let done = evaluations.join().unwrap();
        assert!(done.iter().all(|e| e.as_ref().is_ok_and(|e| e.frame == 3)), "each evaluation read its version");
    });
    holder.join().unwrap();
}

/// The yes and no tokens come from each model's own vocabulary; a model without single-token
/// answers is a clear error naming it.
#[test]
fn yes_and_no_are_found_in_each_vocabulary_or_refused_by_name() {
    let (mut found, mut refused) = (0, 0);
    for name in ["test-idefics3-lm.gguf", "test-qwen2vl-lm.gguf", "test-gemma3-lm.gguf", "test-notemplate-lm.gguf"] {
        let path = models_dir().join(name);
        let model = vlm_runtime::models::model(&path, &vlm_runtime::Device::Cpu).unwrap();
        match YesNo::find(&model) {
            Ok(y) => {
                eprintln!("{name}: yes {} no {}", y.yes, y.no);
                assert_ne!(y.yes, y.no);
                let (yes, no) = (model.token_bytes(y.yes), model.token_bytes(y.no));
                assert!(String::from_utf8_lossy(&yes).trim().eq_ignore_ascii_case("yes"), "{name}: {yes:?}");
                assert!(String::from_utf8_lossy(&no).trim().eq_ignore_ascii_case("no"), "{name}: {no:?}");
                found += 1;
            }
            Err(e) => {
                eprintln!("{name}: {e}");
                assert!(e.to_string().contains(name) && e.to_string().contains("\"yes\""), "{e}");
                refused += 1;
            }
        }
    }
    // (The generated pairs' small vocabularies: both cases occur.)
    assert!(found > 0 && refused > 0, "{found} found, {refused} refused");
}

/// Alerts on one frame share one decode: four evaluations queued together prefill their
/// question suffixes in one batch, each on its own branch (counted by the engine). Per-sequence
/// KV: each choice is the one the same alert gets evaluated alone, bit for bit. The unified
/// pool: the suffixes' common first tokens are decoded once for all the branches (a trie; the
/// engine counts the inputs it did not decode again, and the count is the one the tokens give),
/// and each choice stays the one the alert gets alone up to the pool's summation order (measured:
/// the logits move by 0.02-0.1, as other branches in the pool move them; the test model's yes
/// and no are that close, so the bound is on the logits and P(yes), not on the state).
fn evaluations_queued_together_share_one_decode(kv_layout: vlm_runtime::KvLayout) {
    let config = vlm_runtime::EngineConfig {
        name: "cpu".into(),
        context_per_sequence: 1024,
        max_streams: 1,
        max_branches: 4,
        kv_layout,
        ..vlm_runtime::EngineConfig::default()
    };
    let engine = vlm_runtime::Engine::start(&model_path(), config).expect("engine");
    let enc = encoder();
    let stream = open(&engine, "s", true);
    let never = Arc::new(AtomicBool::new(false));
    stream.register(frame(&enc, 0), &never).unwrap();
    let version = stream.wait_version(1, &never).unwrap();
    let yes_no = YesNo::find(engine.model()).unwrap();
    let alerts = alert::parse_alerts("a:Is the door open?;b:Is there a person?;c:Is it red?;d:Is it night?").unwrap();
    let alone: Vec<_> = alerts
        .iter()
        .map(|a| alert::evaluate(&version, std::slice::from_ref(a), yes_no, &never).unwrap().remove(0).unwrap())
        .collect();
    assert_eq!((engine.widest_start(), engine.shared_inputs()), (0, 0), "one at a time shares nothing");
    let suffixes: Vec<Vec<vlm_runtime::llama::Token>> = alerts
        .iter()
        .map(|a| version.stream.prompt().question_tokens(engine.model(), &alert::alert_prompt(&a.question)).unwrap())
        .collect();
    // Hold the engine thread until the four are queued, so that they start together.
    let (release, holder) = hold(&engine);
    let together = std::thread::scope(|scope| {
        let evaluations = scope.spawn(|| alert::evaluate(&version, &alerts, yes_no, &never).unwrap());
        // Queued: the engine's start backlog holds each one's suffix at the prefill rate.
        let rate = engine.rates().prefill_ms_per_token;
        let inputs: usize = suffixes.iter().map(Vec::len).sum();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while engine.start_backlog_ms() < inputs as f64 * rate * (1.0 - 1e-9) {
            assert!(std::time::Instant::now() < deadline, "the evaluations were not queued");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        release.send(()).unwrap();
        evaluations.join().unwrap()
    });
    holder.join().unwrap();
    assert_eq!(engine.widest_start(), alerts.len(), "the four suffixes were not prefilled in one decode");
    // Inputs the trie saves: every token minus the distinct prefixes.
    let prefixes: std::collections::HashSet<&[_]> =
        suffixes.iter().flat_map(|s| (1..=s.len()).map(move |n| &s[..n])).collect();
    let common = suffixes.iter().map(Vec::len).sum::<usize>() - prefixes.len();
    let unified = kv_layout == vlm_runtime::KvLayout::Unified;
    assert!(common > 0, "the four suffixes open alike");
    assert_eq!(engine.shared_inputs(), if unified { common } else { 0 }, "inputs decoded once for several");
    for (t, a) in together.into_iter().zip(&alone) {
        let t = t.unwrap();
        eprintln!("{kv_layout:?} {}: together {:?} alone {:?}", t.id, t.choice, a.choice);
        if unified {
            let moved =
                (t.choice.yes_logit - a.choice.yes_logit).abs().max((t.choice.no_logit - a.choice.no_logit).abs());
            let p = (t.choice.probability() - a.choice.probability()).abs();
            assert!(moved < 0.25 && p < 0.05, "alert {}: together {:?}, alone {:?}", t.id, t.choice, a.choice);
            continue;
        }
        assert_eq!(
            (t.choice.yes_logit.to_bits(), t.choice.no_logit.to_bits()),
            (a.choice.yes_logit.to_bits(), a.choice.no_logit.to_bits()),
            "alert {}: together {:?}, alone {:?}",
            t.id,
            t.choice,
            a.choice
        );
    }
}

#[test]
fn evaluations_queued_together_share_one_decode_per_sequence() {
    evaluations_queued_together_share_one_decode(vlm_runtime::KvLayout::PerSequence);
}

#[test]
fn evaluations_queued_together_share_their_common_words_in_the_unified_pool() {
    evaluations_queued_together_share_one_decode(vlm_runtime::KvLayout::Unified);
}
