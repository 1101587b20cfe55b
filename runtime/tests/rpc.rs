//! The `rpc` engine: an engine whose layers run on llama.cpp's `rpc-server` (built from the same
//! llama.cpp source by `scripts/build-llama-server.sh rpc`; `VLM_RPC_SERVER` names another),
//! started here on 127.0.0.1 only (ggml's RPC protocol has no authentication). It answers like a
//! local engine of the same backend kind (CPU on both sides here), takes snapshots from one, and
//! when its server goes away the answer running there fails naming the endpoint, the placer
//! moves on, the streams that lived there move to the local engine and nothing hangs.

mod common;

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use vlm_runtime::prompt::{DEFAULT_SYSTEM_PROMPT, Prompt};
use vlm_runtime::{Device, Engine, EngineConfig, PreparePath, Stream, StreamConfig, answer_on, answer_placed};

fn config(name: &str, device: Device) -> EngineConfig {
    EngineConfig {
        name: name.into(),
        device,
        threads: 1,
        context_per_sequence: 1024,
        max_streams: 2,
        max_branches: 2,
        ..EngineConfig::default()
    }
}

fn never() -> Arc<AtomicBool> {
    Arc::new(AtomicBool::new(false))
}

/// A stream resident on `resident` that `peers` may answer, holding `frames` frames.
fn stream_on(resident: &Arc<Engine>, peers: &[&Arc<Engine>], name: &str, frames: u32) -> Arc<Stream> {
    let prompt = Arc::new(Prompt::new(resident.model(), DEFAULT_SYSTEM_PROMPT).unwrap());
    let peers = peers.iter().map(|e| Arc::clone(e)).collect();
    let stream =
        Stream::open(resident, prompt, StreamConfig { retain: true, peers, ..StreamConfig::new(name) }).unwrap();
    let enc = encoder();
    for v in 0..frames {
        stream.register(frame(&enc, v), &never()).unwrap();
    }
    stream
}

/// A 2,000-token answer over `version` replayed on `far`, on a thread of its own, once it has
/// produced text: the receiver of its result.
fn long_answer_started(
    version: &vlm_runtime::Version,
    far: &Arc<Engine>,
) -> mpsc::Receiver<vlm_runtime::Result<vlm_runtime::AnswerReport>> {
    let (text_tx, text_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    let (version, far) = (version.clone(), Arc::clone(far));
    std::thread::spawn(move || {
        let long = vlm_runtime::Question { ignore_eos: true, ..question("Describe the picture at length.", 2000) };
        let result = answer_on(&version, &long, &far, PreparePath::Replay, &never(), |_| {
            let _ = text_tx.send(());
        });
        let _ = done_tx.send(result);
    });
    text_rx.recv_timeout(Duration::from_secs(120)).expect("the RPC engine produced no text");
    done_rx
}

#[test]
fn an_rpc_engine_answers_like_a_local_one_both_ways_and_imports_its_snapshots() {
    let server = RpcServer::start();
    let local = Engine::start(&model_path(), config("local", Device::Cpu)).unwrap();
    let far = Engine::start(&model_path(), config("far", Device::Rpc(vec![server.endpoint.clone()]))).unwrap();
    assert_eq!(far.config().device.name(), "rpc");
    assert!(far.rates().decode_ms_per_step > 0.0, "the RPC engine's rates are measured like any engine's");
    let q = question("What is in the picture?", 12);

    // Resident locally: answered there, and on the RPC engine after an import and a replay.
    let s = stream_on(&local, &[&local, &far], "local-home", 3);
    let version = s.wait_version(3, &never()).unwrap();
    let resident = answer_on(&version, &q, &local, PreparePath::Resident, &never(), |_| {}).unwrap();
    let imported = answer_on(&version, &q, &far, PreparePath::Import, &never(), |_| {}).unwrap();
    let replayed = answer_on(&version, &q, &far, PreparePath::Replay, &never(), |_| {}).unwrap();
    assert!(resident.tokens > 0);
    assert_eq!((imported.engine.as_str(), imported.path), ("far", PreparePath::Import));
    assert_eq!((replayed.engine.as_str(), replayed.path), ("far", PreparePath::Replay));
    assert_eq!(imported.text, resident.text, "a snapshot imported into the RPC engine answered differently");
    assert_eq!(replayed.text, resident.text, "a history replayed on the RPC engine answered differently");

    // Resident on the RPC engine (its frames ingested there): the same answer, and a snapshot
    // exported from it feeds the local engine.
    let t = stream_on(&far, &[&far, &local], "far-home", 3);
    let there_version = t.wait_version(3, &never()).unwrap();
    let there = answer_on(&there_version, &q, &far, PreparePath::Resident, &never(), |_| {}).unwrap();
    let back = answer_on(&there_version, &q, &local, PreparePath::Import, &never(), |_| {}).unwrap();
    assert_eq!(there.engine, "far");
    assert_eq!(there.text, resident.text, "a history ingested on the RPC engine answered differently");
    assert_eq!(back.text, resident.text, "a snapshot exported from the RPC engine answered differently");

    // The server goes away while the engines are idle: stopping finds out (when the engine frees
    // its context there) and does not hang.
    drop(server);
    let (stopped_tx, stopped_rx) = mpsc::channel();
    std::thread::spawn(move || {
        drop((version, there_version, s, t, far, local));
        let _ = stopped_tx.send(());
    });
    stopped_rx.recv_timeout(Duration::from_secs(30)).expect("stopping an engine whose server went away hung");
}

#[test]
fn an_rpc_server_that_is_not_there_is_an_error_naming_it() {
    // A port nothing listens on (bound, then released).
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let endpoint = format!("127.0.0.1:{port}");
    let err = Engine::start(&model_path(), config("far", Device::Rpc(vec![endpoint.clone()]))).unwrap_err();
    let err = err.to_string();
    assert!(err.contains(&endpoint) && err.contains("not reachable"), "{err}");
    let err = EngineConfig::parse_list("far:rpc:127.0.0.1", &EngineConfig::default()).unwrap_err().to_string();
    assert!(err.contains("bad RPC endpoint list"), "{err}");
    // What ggml-rpc could not parse (it would abort the process) is refused before it is called.
    for bad in ["[::1]:50052", "127.0.0.1", ":50052", "h:0", "h:99999"] {
        let err = Engine::start(&model_path(), config("far", Device::Rpc(vec![bad.into()]))).unwrap_err().to_string();
        assert!(err.contains("bad RPC endpoint"), "{bad}: {err}");
    }
}

#[test]
fn an_rpc_server_that_dies_mid_answer_fails_that_answer_and_the_placer_moves_on() {
    let mut server = RpcServer::start();
    let endpoint = server.endpoint.clone();
    let local = Engine::start(&model_path(), config("local", Device::Cpu)).unwrap();
    let far = Engine::start(&model_path(), config("far", Device::Rpc(vec![endpoint.clone()]))).unwrap();
    let s = stream_on(&local, &[&local, &far], "local-home", 2);
    let stranded = stream_on(&far, &[&far, &local], "far-home", 1);
    let version = s.wait_version(2, &never()).unwrap();
    stranded.wait_version(1, &never()).unwrap();

    // A long answer on the RPC engine; the server is killed once it has produced text.
    let done_rx = long_answer_started(&version, &far);
    server.kill();
    let result = done_rx.recv_timeout(Duration::from_secs(60)).expect("the answer on the dead server never ended");
    let err = result.expect_err("an answer whose server died cannot succeed").to_string();
    assert!(err.contains(&endpoint) && err.contains("stopped answering"), "{err}");
    let failure = far.failure().expect("the engine is declared failed");
    assert!(failure.contains(&endpoint), "{failure}");

    // The placer passes it over; naming it is refused with the reason.
    let q = question("What is in the picture?", 8);
    let report = answer_placed(&version, &q, "auto", &never(), |_| {}).unwrap();
    assert_eq!(report.engine, "local");
    let err = answer_placed(&version, &q, "far", &never(), |_| {}).unwrap_err().to_string();
    assert!(err.contains(&endpoint), "{err}");
    // The stream that lived there has moved to the local engine (its history ingested there
    // again from the retained frames) and goes on: a new frame, answered resident there as a
    // replay of the same version answers.
    assert_eq!(stranded.engine().name(), "local");
    stranded.register(frame(&encoder(), 7), &never()).unwrap();
    let moved = stranded.wait_version(2, &never()).unwrap();
    let resident = answer_on(&moved, &q, &local, PreparePath::Resident, &never(), |_| {}).unwrap();
    let replayed = answer_on(&moved, &q, &local, PreparePath::Replay, &never(), |_| {}).unwrap();
    assert_eq!(resident.path, PreparePath::Resident);
    assert_eq!(resident.text, replayed.text, "the moved history answers unlike its replay");
    assert!(s.register(frame(&encoder(), 8), &never()).is_ok());
    // The endpoint is not used again in this process, and stopping abandons the stuck thread.
    let err = Engine::start(&model_path(), config("again", Device::Rpc(vec![endpoint.clone()]))).unwrap_err();
    assert!(err.to_string().contains("failed earlier"), "{err}");
    let (stopped_tx, stopped_rx) = mpsc::channel();
    std::thread::spawn(move || {
        far.stop();
        drop((far, stranded));
        let _ = stopped_tx.send(());
    });
    stopped_rx.recv_timeout(Duration::from_secs(30)).expect("stopping a failed engine hung");
}

/// A listener that accepts connections and closes them at once (a wrong port, a server dying
/// during its handshake) fails its engine within seconds, naming it; a healthy `rpc-server`
/// started after it in the same process then starts and answers. (ggml-rpc connects and shakes
/// hands under process-wide locks and aborts when that fails: the endpoint is checked with
/// ggml-rpc's handshake before ggml-rpc is called, so a failed setup never parks a thread holding
/// them.)
#[test]
fn an_endpoint_that_accepts_and_closes_fails_clearly_and_a_healthy_one_still_starts() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let bad = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for connection in listener.incoming() {
            drop(connection);
        }
    });
    let started = Instant::now();
    let err = Engine::start(&model_path(), config("bad", Device::Rpc(vec![bad.clone()]))).unwrap_err().to_string();
    assert!(err.contains(&bad) && err.contains("closed the connection"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(15), "the bad endpoint took {:?} to fail", started.elapsed());

    let server = RpcServer::start();
    let endpoint = server.endpoint.clone();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(Engine::start(&model_path(), config("good", Device::Rpc(vec![endpoint]))));
    });
    let far = rx
        .recv_timeout(Duration::from_secs(180))
        .expect("a healthy RPC engine did not start after a bad endpoint failed (ggml-rpc's locks held?)")
        .expect("the healthy RPC engine");
    let s = stream_on(&far, &[&far], "s", 1);
    let version = s.wait_version(1, &never()).unwrap();
    let q = vlm_runtime::Question { ignore_eos: true, ..question("What is in the picture?", 4) };
    let report = answer_on(&version, &q, &far, PreparePath::Resident, &never(), |_| {}).unwrap();
    assert_eq!((report.engine.as_str(), report.tokens), ("good", 4));
    drop(s);
    far.stop();
    drop(server);
}

/// A server that stops answering without closing its connection (SIGSTOP: TCP would not give
/// up for about 15 minutes) is noticed by the watchdog: the answer running there fails naming
/// the endpoint within the stall limit plus a second or two, the engine is declared failed, and
/// stopping it does not wait for the server.
#[test]
fn a_stopped_rpc_server_fails_the_answer_naming_it_within_the_stall_limit() {
    const LIMIT: Duration = Duration::from_secs(5);
    vlm_runtime::engine::set_rpc_stall_limit(LIMIT);
    let server = RpcServer::start();
    let endpoint = server.endpoint.clone();
    let local = Engine::start(&model_path(), config("local", Device::Cpu)).unwrap();
    let far = Engine::start(&model_path(), config("far", Device::Rpc(vec![endpoint.clone()]))).unwrap();
    let s = stream_on(&local, &[&local, &far], "s", 1);
    let version = s.wait_version(1, &never()).unwrap();
    let done_rx = long_answer_started(&version, &far);
    server.signal("STOP");
    let stopped = Instant::now();
    let result = done_rx.recv_timeout(Duration::from_secs(60)).expect("the answer on the stopped server never ended");
    let took = stopped.elapsed();
    let err = result.expect_err("an answer whose server stopped cannot succeed").to_string();
    // The watchdog's stall ("has not answered"), or, when another test's server dies at the
    // same time, ggml-rpc's transport failure attributed to this silent endpoint ("stopped
    // answering"): either way the answer fails naming it, within the bound.
    assert!(
        err.contains(&endpoint) && (err.contains("has not answered") || err.contains("stopped answering")),
        "{err}"
    );
    assert!(took < LIMIT + Duration::from_secs(3), "noticed after {took:?} (limit {LIMIT:?})");
    eprintln!("the stopped server was noticed after {took:?} (stall limit {LIMIT:?})");
    assert!(far.failure().is_some_and(|f| f.contains(&endpoint)));
    // The placer passes it over; stopping it does not wait for the server.
    let report = answer_placed(&version, &question("What is in the picture?", 4), "auto", &never(), |_| {}).unwrap();
    assert_eq!(report.engine, "local");
    let (stopped_tx, stopped_rx) = mpsc::channel();
    std::thread::spawn(move || {
        far.stop();
        drop(far);
        let _ = stopped_tx.send(());
    });
    stopped_rx.recv_timeout(Duration::from_secs(30)).expect("stopping an engine whose server stopped hung");
    server.signal("CONT");
}

/// Stopping an RPC engine whose server has just stopped answering (before the watchdog has
/// declared it failed: the natural reaction when answers stop coming) returns once the stall
/// is declared, instead of waiting for the server for good.
#[test]
fn stopping_an_engine_whose_server_stalls_returns_once_the_stall_is_declared() {
    const LIMIT: Duration = Duration::from_secs(5);
    vlm_runtime::engine::set_rpc_stall_limit(LIMIT);
    let server = RpcServer::start();
    let local = Engine::start(&model_path(), config("local", Device::Cpu)).unwrap();
    let far = Engine::start(&model_path(), config("far", Device::Rpc(vec![server.endpoint.clone()]))).unwrap();
    let s = stream_on(&local, &[&local, &far], "s", 1);
    let version = s.wait_version(1, &never()).unwrap();
    let _answer = long_answer_started(&version, &far);
    server.signal("STOP");
    let (stopped_tx, stopped_rx) = mpsc::channel();
    std::thread::spawn(move || {
        far.stop();
        let _ = stopped_tx.send(());
    });
    let stopped = stopped_rx.recv_timeout(LIMIT * 4);
    server.signal("CONT");
    stopped.expect("stopping the engine waited for its stalled server");
}
