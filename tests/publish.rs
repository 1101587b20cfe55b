//! `vlmpublish` against a real Mosquitto (Debian's `mosquitto`, installed by scripts/setup.sh):
//! each test starts its own broker on a free loopback port, with its own configuration and its
//! persistence in a temporary directory, and subscribes with a persistent session (clean session
//! off, QoS 1), so that what reaches the broker while the subscriber is away is kept for it.
//! Checked: lines arrive on their substituted topics; at QoS 1 a broker restart (messages in
//! flight and buffered), restarts while a producer pushes, and a hung broker lose nothing within
//! the buffer (at least once: duplicates are allowed, every message must arrive); with no broker
//! the pipeline still plays and ends, warns once and drops the oldest beyond `max-buffered`; bad
//! settings are refused; TLS; a user and password, and a refused one; and a real vlmquery
//! pipeline's answers and alerts. Every wait is for a condition, with a 60 s guard against hangs
//! only.

mod common;

use std::collections::BTreeSet;
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::*;
use gst::prelude::*;

/// A guard against hangs, never the thing asserted.
const GUARD: Duration = Duration::from_secs(60);

/// Wait until `cond` holds; a test failure naming `what` after `GUARD`.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + GUARD;
    while !cond() {
        assert!(Instant::now() < deadline, "not within {GUARD:?}: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A temporary directory, removed on drop, that the broker can write to (as root, Mosquitto
/// runs as the `mosquitto` user).
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("vlmpublish-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What a broker has beside its anonymous listener on `port`.
#[derive(Clone, Copy, PartialEq)]
enum Second {
    None,
    /// None, and the main listener refuses (drops the client over) packets over 2 KiB.
    SmallPackets,
    /// A TLS listener (a CA and a server certificate for localhost and 127.0.0.1, made with
    /// openssl in its directory: `ca.pem`).
    Tls,
    /// A listener for user `camera`, password `secret`, only.
    Password,
}

/// A Mosquitto broker on 127.0.0.1:`port` (and a second listener on `second_port`), its
/// persistence in its directory.
struct Broker {
    dir: TempDir,
    port: u16,
    second_port: Option<u16>,
    child: Option<Child>,
}

impl Broker {
    fn start(name: &str) -> Broker {
        Broker::configure(name, Second::None)
    }

    fn configure(name: &str, second: Second) -> Broker {
        let dir = TempDir::new(name);
        let port = free_port();
        let d = dir.0.display().to_string();
        let mut conf = format!(
            "per_listener_settings true\npersistence true\npersistence_location {d}/\n\
             log_dest stderr\nlog_type error\nlog_type warning\nlog_type notice\n\
             listener {port} 127.0.0.1\nallow_anonymous true\n"
        );
        if second == Second::SmallPackets {
            conf += "max_packet_size 2048\n";
        }
        let second_port = matches!(second, Second::Tls | Second::Password).then(|| {
            let second_port = free_port();
            conf += &format!("listener {second_port} 127.0.0.1\n");
            if second == Second::Tls {
                make_certificates(&dir.0);
                conf += &format!(
                    "allow_anonymous true\ncafile {d}/ca.pem\ncertfile {d}/server.pem\nkeyfile {d}/server.key\n"
                );
            } else {
                let passwords = dir.0.join("passwords");
                let out = Command::new("mosquitto_passwd")
                    .arg("-b")
                    .arg("-c")
                    .arg(&passwords)
                    .args(["camera", "secret"])
                    .output();
                let out = out.expect("mosquitto_passwd (Debian's mosquitto)");
                assert!(out.status.success(), "mosquitto_passwd: {}", String::from_utf8_lossy(&out.stderr));
                std::fs::set_permissions(&passwords, std::fs::Permissions::from_mode(0o644)).unwrap();
                conf += &format!("allow_anonymous false\npassword_file {d}/passwords\n");
            }
            second_port
        });
        std::fs::write(dir.0.join("mosquitto.conf"), conf).unwrap();
        let mut broker = Broker { dir, port, second_port, child: None };
        broker.spawn();
        broker
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("mosquitto.log")).unwrap_or_default()
    }

    /// Start `mosquitto` and wait until it accepts connections.
    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.0.join("mosquitto.log")).unwrap();
        let child = Command::new("mosquitto")
            .arg("-c")
            .arg(self.dir.0.join("mosquitto.conf"))
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run mosquitto (scripts/setup.sh installs Debian's mosquitto): {e}"));
        self.child = Some(child);
        let ports = [Some(self.port), self.second_port];
        wait_until("mosquitto accepts connections", || {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("mosquitto exited ({status}): {}", self.log());
            }
            ports.iter().flatten().all(|p| TcpStream::connect(("127.0.0.1", *p)).is_ok())
        });
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("mosquitto runs").id().to_string();
        let status = Command::new("kill").arg(format!("-{signal}")).arg(pid).status().unwrap();
        assert!(status.success(), "kill -{signal} mosquitto");
    }

    /// SIGTERM (Mosquitto saves its persistence then; a frozen one is woken to do it), and wait
    /// for it to exit.
    fn stop(&mut self) {
        self.signal("TERM");
        self.signal("CONT");
        let mut child = self.child.take().unwrap();
        let deadline = Instant::now() + GUARD;
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("mosquitto did not exit on SIGTERM within {GUARD:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A CA and a server certificate (localhost, 127.0.0.1) signed by it, in `dir`.
fn make_certificates(dir: &Path) {
    let run = |args: &[&str]| {
        let out = Command::new("openssl").args(args).current_dir(dir).output().expect("openssl (scripts/setup.sh)");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    run(&[
        &["req", "-x509", "-days", "2", "-subj", "/CN=gst-vlm test CA", "-keyout", "ca.key", "-out", "ca.pem"][..],
        &ec,
    ]
    .concat());
    run(&[&["req", "-subj", "/CN=localhost", "-keyout", "server.key", "-out", "server.csr"][..], &ec].concat());
    std::fs::write(dir.join("san.ext"), "subjectAltName=DNS:localhost,IP:127.0.0.1\n").unwrap();
    run(&[
        "x509",
        "-req",
        "-days",
        "2",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-extfile",
        "san.ext",
        "-out",
        "server.pem",
    ]);
    for f in ["ca.pem", "server.pem", "server.key"] {
        std::fs::set_permissions(dir.join(f), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
}

/// A persistent MQTT session (clean session off) subscribed at QoS 1 to a filter: what it
/// receives, in order, as (topic, payload). It reconnects by itself after a broker restart.
/// (topic, payload) of each message received, in order.
type Messages = Vec<(String, String)>;

struct Subscriber {
    got: Arc<(Mutex<Messages>, Condvar)>,
    stop: Arc<AtomicBool>,
    client: rumqttc::Client,
}

impl Subscriber {
    fn connect(port: u16, id: &str, filter: &str) -> Subscriber {
        let mut options = rumqttc::MqttOptions::new(id, "127.0.0.1", port);
        options.set_clean_session(false).set_keep_alive(Duration::from_secs(5)).set_max_packet_size(1 << 20, 1 << 20);
        let (client, mut connection) = rumqttc::Client::new(options, 64);
        let got = Arc::new((Mutex::new(vec![]), Condvar::new()));
        let subscribed = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (g, s, st, c, filter) = (got.clone(), subscribed.clone(), stop.clone(), client.clone(), filter.to_string());
        std::thread::spawn(move || {
            for event in connection.iter() {
                use rumqttc::{Event, Incoming, Outgoing};
                match event {
                    Ok(Event::Incoming(Incoming::ConnAck(_))) => {
                        let _ = c.try_subscribe(filter.clone(), rumqttc::QoS::AtLeastOnce);
                    }
                    Ok(Event::Incoming(Incoming::SubAck(_))) => s.store(true, Ordering::Release),
                    Ok(Event::Incoming(Incoming::Publish(p))) => {
                        let payload = String::from_utf8(p.payload.to_vec()).unwrap();
                        g.0.lock().unwrap().push((p.topic.clone(), payload));
                        g.1.notify_all();
                    }
                    Ok(Event::Outgoing(Outgoing::Disconnect)) => break,
                    Ok(_) => {}
                    Err(_) if st.load(Ordering::Acquire) => break,
                    Err(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            }
        });
        wait_until("the subscription is acknowledged", || subscribed.load(Ordering::Acquire));
        Subscriber { got, stop, client }
    }

    fn messages(&self) -> Messages {
        self.got.0.lock().unwrap().clone()
    }

    /// Wait until `cond` holds on what arrived.
    fn wait(&self, what: &str, cond: impl Fn(&[(String, String)]) -> bool) -> Messages {
        let deadline = Instant::now() + GUARD;
        let mut got = self.got.0.lock().unwrap();
        while !cond(&got) {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "not within {GUARD:?}: {what}; got {:?}", *got);
            got = self.got.1.wait_timeout(got, left).unwrap().0;
        }
        got.clone()
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.client.try_disconnect();
    }
}

/// `appsrc ! vlmpublish` with `props`, playing.
struct Publisher {
    pipeline: gst::Element,
    src: gst_app::AppSrc,
    sink: gst::Element,
}

impl Publisher {
    fn new(props: &str) -> Publisher {
        let pipeline =
            launch(&format!("appsrc name=src format=time caps=text/x-raw,format=utf8 ! vlmpublish name=pub {props}"));
        let bin = pipeline.downcast_ref::<gst::Bin>().unwrap();
        let src = bin.by_name("src").unwrap().downcast::<gst_app::AppSrc>().unwrap();
        let sink = bin.by_name("pub").unwrap();
        pipeline.set_state(gst::State::Playing).expect("to PLAYING");
        Publisher { pipeline, src, sink }
    }

    fn push(&self, text: &str) {
        self.src.push_buffer(gst::Buffer::from_slice(text.as_bytes().to_vec())).unwrap();
    }

    fn count(&self, name: &str) -> u64 {
        self.sink.property::<u64>(name)
    }

    fn connected(&self) -> bool {
        self.sink.property::<bool>("connected")
    }

    /// EOS, and what the bus said until it left the pipeline (still PLAYING).
    fn finish(&self) -> Run {
        self.src.end_of_stream().unwrap();
        run_to_eos(&self.pipeline, GUARD.as_secs())
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.pipeline.set_state(gst::State::Null);
    }
}

fn answer(id: &str, stream: &str) -> String {
    format!(r#"{{"id":"{id}","stream":"{stream}","status":"answered","text":"Answer {id}.","pts":0}}"#)
}

fn alert(id: &str, stream: &str, state: bool) -> String {
    format!(r#"{{"type":"alert","id":"{id}","stream":"{stream}","state":{state},"probability":0.75}}"#)
}

#[test]
fn lines_arrive_on_their_substituted_topics() {
    init();
    let broker = Broker::start("topics");
    let sub = Subscriber::connect(broker.port, "sub-topics", "t1/#");
    let p = Publisher::new(&format!("address={} topic=t1/{{stream}}/{{type}} mqtt-qos=1", broker.address()));
    p.push(&format!("{}\n", answer("q1", "door")));
    // Two lines (and a blank one) in one buffer, the second of another stream.
    p.push(&format!("{}\n\n{}\r\n", alert("person", "yard", true), answer("q2", "yard")));
    // A stream name that is not one topic level.
    p.push(&format!("{}\n", alert("person", "cam/1", false)));
    // Not JSON: published as it is, its stream from the buffer's VlmAnswerMeta, else unknown.
    let mut text = gst::Buffer::from_slice(b"A plain answer.\n".to_vec());
    gst_vlm_elements::meta::add_answer_meta(text.get_mut().unwrap(), "q3", "porch", "answered");
    p.src.push_buffer(text).unwrap();
    p.push("no stream here\n");
    let expected: Messages = [
        ("t1/door/answer", answer("q1", "door")),
        ("t1/yard/alert", alert("person", "yard", true)),
        ("t1/yard/answer", answer("q2", "yard")),
        ("t1/cam_1/alert", alert("person", "cam/1", false)),
        ("t1/porch/text", "A plain answer.".into()),
        ("t1/unknown/text", "no stream here".into()),
    ]
    .into_iter()
    .map(|(t, m)| (t.to_string(), m))
    .collect();
    let got = sub.wait("every line arrives", |got| got.len() >= expected.len());
    // One publisher connection and no reconnection: each once, in order.
    assert_eq!(got, expected);
    let run = p.finish();
    assert!(run.errors.is_empty() && run.warnings.is_empty(), "{run:?}");
    assert_eq!((p.count("messages-published"), p.count("messages-dropped"), p.count("messages-buffered")), (6, 0, 0));
    assert!(p.connected());
}

#[test]
fn a_broker_restart_at_qos_1_loses_nothing_within_the_buffer() {
    init();
    let mut broker = Broker::start("restart");
    let sub = Subscriber::connect(broker.port, "sub-restart", "t2/#");
    let p = Publisher::new(&format!("address={} topic=t2/{{stream}}/{{type}} mqtt-qos=1", broker.address()));
    let line = |i: usize| answer(&format!("a{i}"), "cam");
    for i in 0..10 {
        p.push(&format!("{}\n", line(i)));
    }
    sub.wait("the first 10", |got| got.len() >= 10);
    wait_until("the first 10 acknowledged", || p.count("messages-published") == 10);
    // The broker freezes (SIGSTOP): the next 10 are written and wait for their PUBACK.
    broker.signal("STOP");
    for i in 10..20 {
        p.push(&format!("{}\n", line(i)));
    }
    wait_until("10 messages in flight", || p.count("messages-buffered") == 10);
    // It goes away (saving the subscriber's session): the element notices, buffers.
    broker.stop();
    wait_until("vlmpublish sees the connection lost", || !p.connected());
    for i in 20..30 {
        p.push(&format!("{}\n", line(i)));
    }
    wait_until("the 20 messages are buffered", || p.count("messages-published") + p.count("messages-buffered") == 30);
    // Back on the same port: everything buffered arrives (at least once; a message may arrive
    // twice at QoS 1, e.g. one the broker took just before it went away).
    broker.spawn();
    let all: BTreeSet<String> = (0..30).map(line).collect();
    let got = sub.wait("all 30 messages, at least once", |got| all.iter().all(|m| got.iter().any(|(_, g)| g == m)));
    assert!(got.iter().all(|(t, m)| t == "t2/cam/answer" && all.contains(m)), "{got:?}");
    let run = p.finish();
    assert!(run.errors.is_empty(), "{run:?}");
    assert_eq!((p.count("messages-published"), p.count("messages-dropped")), (30, 0));
    let lost: Vec<_> = run.warnings.iter().filter(|w| w.contains("Lost the connection")).collect();
    assert_eq!(lost.len(), 1, "one warning for the lost connection: {:?}", run.warnings);
    assert!(lost[0].contains(&broker.address()), "{lost:?}");
}

#[test]
fn restarts_while_publishing_lose_nothing_at_qos_1() {
    init();
    let mut broker = Broker::start("restarts");
    let sub = Subscriber::connect(broker.port, "sub-restarts", "t8/#");
    let p = Publisher::new(&format!("address={} topic=t8/{{stream}} mqtt-qos=1", broker.address()));
    const N: usize = 300;
    let line = |i: usize| answer(&format!("r{i}"), "cam");
    // A producer pushes while the broker is restarted three times, each after 50 more
    // acknowledgements: some messages are in flight, some written to a dying connection.
    let src = p.src.clone();
    let producer = std::thread::spawn(move || {
        for i in 0..N {
            src.push_buffer(gst::Buffer::from_slice(format!("{}\n", line(i)).into_bytes())).unwrap();
            std::thread::sleep(Duration::from_millis(2));
        }
    });
    for round in 1..=3 {
        wait_until("50 more acknowledged", || p.count("messages-published") >= round * 50);
        broker.stop();
        wait_until("vlmpublish sees the connection lost", || !p.connected());
        broker.spawn();
    }
    producer.join().unwrap();
    every_line_arrived(&sub, &p, (0..N).map(line).collect());
}

/// Every one of `lines` reached `sub` at least once (QoS 1), the run ended without an error or
/// a message left undelivered, and `p` counted them all published, none dropped or buffered.
fn every_line_arrived(sub: &Subscriber, p: &Publisher, lines: BTreeSet<String>) {
    sub.wait("every message, at least once", |got| {
        let got: BTreeSet<&String> = got.iter().map(|(_, m)| m).collect();
        lines.iter().all(|m| got.contains(m))
    });
    let run = p.finish();
    assert!(run.errors.is_empty(), "{run:?}");
    assert!(!run.warnings.iter().any(|w| w.contains("not delivered")), "{:?}", run.warnings);
    let counts = ["messages-published", "messages-dropped", "messages-buffered"].map(|c| p.count(c));
    assert_eq!(counts, [lines.len() as u64, 0, 0]);
}

#[test]
fn a_hung_broker_never_blocks_the_pipeline_and_loses_nothing() {
    init();
    let broker = Broker::start("hung");
    let sub = Subscriber::connect(broker.port, "sub-hung", "t9/#");
    let p = Publisher::new(&format!("address={} topic=t9/{{stream}} mqtt-qos=1", broker.address()));
    wait_until("vlmpublish connects", || p.connected());
    // The broker hangs with its connections open (SIGSTOP): 25 MB fill the sockets' buffers and
    // the client's write waits; every push returns at once all the same.
    broker.signal("STOP");
    const N: usize = 150;
    let filler = "x".repeat(170 * 1024);
    let line = |i: usize| format!(r#"{{"id":"h{i}","stream":"cam","text":"{filler}"}}"#);
    for i in 0..N {
        p.push(&format!("{}\n", line(i)));
    }
    wait_until("every message rendered (none waits for the broker)", || p.count("messages-buffered") == N as u64);
    // The write times out (rumqttc's 5 s): the connection is given up, then made again once the
    // broker wakes up, and everything not acknowledged is published again.
    wait_until("vlmpublish gives the hung connection up", || !p.connected());
    broker.signal("CONT");
    every_line_arrived(&sub, &p, (0..N).map(line).collect());
}

#[test]
fn no_broker_plays_warns_once_and_drops_the_oldest_beyond_max_buffered() {
    init();
    let port = free_port();
    let p = Publisher::new(&format!("address=127.0.0.1:{port} max-buffered=5 flush-timeout=300000000"));
    for i in 0..12 {
        p.push(&format!("{}\n", answer(&format!("n{i}"), "cam")));
    }
    let (ret, state, _) = p.pipeline.state(gst::ClockTime::from_seconds(GUARD.as_secs()));
    assert_eq!((ret, state), (Ok(gst::StateChangeSuccess::Success), gst::State::Playing));
    wait_until("12 lines rendered into a buffer of 5", || p.count("messages-dropped") == 7);
    assert_eq!(p.count("messages-buffered"), 5);
    let run = p.finish();
    assert!(run.errors.is_empty(), "{run:?}");
    let count = |what: &str| run.warnings.iter().filter(|w| w.contains(what)).count();
    // Retries do not repeat the warning; nor does every dropped message.
    assert_eq!(count(&format!("Cannot connect to the MQTT broker at 127.0.0.1:{port}")), 1, "{:?}", run.warnings);
    assert_eq!(count("Connection refused"), 1, "the system's error: {:?}", run.warnings);
    assert_eq!(count("buffer is full"), 1, "{:?}", run.warnings);
    assert_eq!(count("5 messages not delivered"), 1, "EOS says what is left: {:?}", run.warnings);
    assert_eq!(p.count("messages-published"), 0);
    p.pipeline.set_state(gst::State::Null).unwrap();
    assert_eq!((p.count("messages-dropped"), p.count("messages-buffered")), (12, 0), "undelivered at stop");
}

#[test]
fn a_broker_that_comes_later_gets_the_newest_messages() {
    init();
    // The subscriber's session is saved by a broker that then goes away.
    let mut broker = Broker::start("later");
    let sub = Subscriber::connect(broker.port, "sub-later", "t3/#");
    broker.stop();
    let p = Publisher::new(&format!("address={} topic=t3/{{stream}} max-buffered=5", broker.address()));
    let line = |i: usize| answer(&format!("l{i}"), "cam");
    for i in 0..12 {
        p.push(&format!("{}\n", line(i)));
    }
    wait_until("12 lines rendered into a buffer of 5", || p.count("messages-dropped") == 7);
    broker.spawn();
    let newest: Vec<String> = (7..12).map(line).collect();
    let got = sub.wait("the 5 newest", |got| got.len() >= 5);
    assert_eq!(got.iter().map(|(_, m)| m.clone()).collect::<Vec<_>>(), newest, "the oldest were dropped");
    let run = p.finish();
    assert!(run.errors.is_empty(), "{run:?}");
    assert_eq!((p.count("messages-published"), p.count("messages-dropped")), (5, 7));
}

/// A line whose topic (its stream's name put in) is over what MQTT encodes (65535 bytes) is
/// dropped with a WARNING and counted; the lines after it are published. (Its length was written
/// in two bytes, wrapped, and the broker read a cut topic and garbage.)
#[test]
fn a_line_whose_topic_is_too_long_is_dropped_and_the_next_published() {
    init();
    let broker = Broker::start("long-topic");
    let sub = Subscriber::connect(broker.port, "sub-long-topic", "t9/#");
    let p = Publisher::new(&format!("address={} topic=t9/{{stream}}", broker.address()));
    p.push(&format!("{}\n{}\n", answer("long", &"a".repeat(70_000)), answer("next", "cam")));
    sub.wait("the next line", |got| got.iter().any(|(t, m)| t == "t9/cam" && m.contains("next")));
    let run = p.finish();
    assert_eq!((p.count("messages-published"), p.count("messages-dropped")), (1, 1));
    assert!(run.warnings.iter().any(|w| w.contains("topic of 70003 bytes")), "{:?}", run.warnings);
}

/// A broker that drops the client over one message (here: a packet over its `max_packet_size`)
/// made the element send that message first after every reconnect, about ten times a second for
/// good, and nothing after it. After it was in flight at three lost connections it is dropped,
/// counted and said, and the messages after it are published.
#[test]
fn a_message_the_broker_drops_the_client_over_is_dropped_after_three_losses() {
    init();
    let broker = Broker::configure("small-packets", Second::SmallPackets);
    let sub = Subscriber::connect(broker.port, "sub-small", "t10/#");
    let p = Publisher::new(&format!("address={} topic=t10/{{stream}}", broker.address()));
    let big = format!(r#"{{"id":"big","stream":"cam","text":"{}"}}"#, "x".repeat(4000));
    p.push(&format!("{big}\n"));
    wait_until("the big message dropped", || p.count("messages-dropped") == 1);
    p.push(&format!("{}\n", answer("after", "cam")));
    sub.wait("the message after it", |got| got.iter().any(|(_, m)| m.contains("after")));
    let run = p.finish();
    assert_eq!((p.count("messages-published"), p.count("messages-dropped")), (1, 1));
    let dropped: Vec<_> = run.warnings.iter().filter(|w| w.contains("was dropped")).collect();
    assert_eq!(dropped.len(), 1, "{:?}", run.warnings);
    assert!(dropped[0].contains("t10/cam") && dropped[0].contains("lost 3 times"), "{dropped:?}");
}

#[test]
fn bad_settings_are_refused() {
    init();
    // Out of range in a launch line: GLib refuses them, the defaults stay.
    let pipeline = launch("appsrc ! vlmpublish name=pub mqtt-qos=2 max-buffered=0");
    let sink = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("pub").unwrap();
    assert_eq!((sink.property::<u32>("mqtt-qos"), sink.property::<u32>("max-buffered")), (1, 1000));
    let bus = pipeline.bus().unwrap();
    let refused = |property: &str, value: &str, keeps: &str| {
        sink.set_property(property, value);
        assert_eq!(sink.property::<String>(property), keeps, "{property}={value:?}");
        // (Skipping the running element's own warnings: no broker is there.)
        loop {
            let msg =
                bus.timed_pop_filtered(gst::ClockTime::from_seconds(GUARD.as_secs()), &[gst::MessageType::Warning]);
            let gst::MessageView::Warning(w) = msg.as_ref().expect("a warning").view() else { unreachable!() };
            if w.error().matches(gst::LibraryError::Settings) {
                return w.error().to_string();
            }
        }
    };
    for (value, says) in [("", "empty"), ("a/+/b", "wildcard"), ("cam/{camera}", "placeholder")] {
        let w = refused("topic", value, "gst-vlm/{stream}/{type}");
        assert!(w.contains(says), "{w}");
    }
    for (value, says) in
        [("localhost", "no port"), ("mqtt://localhost:1883", "URL"), ("localhost:0", "port"), ("::1:1883", "IPv6")]
    {
        let w = refused("address", value, "localhost:1883");
        assert!(w.contains(says), "{w}");
    }
    sink.set_property("address", "[::1]:1883");
    assert_eq!(sink.property::<String>("address"), "[::1]:1883");
    // While it runs (no broker there: it runs all the same), what applies at start is refused;
    // the topic is not.
    sink.set_property("address", format!("127.0.0.1:{}", free_port()));
    pipeline.set_state(gst::State::Paused).unwrap();
    let w = refused("client-id", "another", "");
    assert!(w.contains("while the element runs"), "{w}");
    sink.set_property("topic", "cams/{stream}");
    assert_eq!(sink.property::<String>("topic"), "cams/{stream}");
    // READY too: the connection starts at NULL→READY (a value set there was kept and never used).
    pipeline.set_state(gst::State::Ready).unwrap();
    let w = refused("username", "camera", "");
    assert!(w.contains("while the element runs"), "{w}");
    pipeline.set_state(gst::State::Null).unwrap();
    // TLS with a CA file that is not there: the start fails, naming it.
    sink.set_property("tls", true);
    sink.set_property("ca-file", "/nonexistent/ca.pem");
    assert!(pipeline.set_state(gst::State::Paused).is_err());
    let msg = bus.timed_pop_filtered(gst::ClockTime::from_seconds(GUARD.as_secs()), &[gst::MessageType::Error]);
    let gst::MessageView::Error(e) = msg.as_ref().expect("an error").view() else { unreachable!() };
    // (In the message, which applications show, not only in the debug text.)
    assert!(e.error().to_string().contains("/nonexistent/ca.pem"), "{e:?}");
    pipeline.set_state(gst::State::Null).unwrap();
}

#[test]
fn tls_with_a_ca_file() {
    init();
    let broker = Broker::configure("tls", Second::Tls);
    let sub = Subscriber::connect(broker.port, "sub-tls", "t6/#");
    let ca = broker.dir.0.join("ca.pem");
    let p = Publisher::new(&format!(
        "address=localhost:{} tls=true ca-file={} topic=t6/{{stream}}/{{type}}",
        broker.second_port.unwrap(),
        ca.display()
    ));
    p.push(&format!("{}\n", alert("door", "gate", true)));
    let got = sub.wait("the alert, through TLS", |got| !got.is_empty());
    assert_eq!(got, [("t6/gate/alert".to_string(), alert("door", "gate", true))]);
    let run = p.finish();
    assert!(run.errors.is_empty() && run.warnings.is_empty(), "{run:?}");
    assert_eq!(p.count("messages-published"), 1);
}

#[test]
fn a_vlmquery_pipeline_publishes_its_answers_and_alerts() {
    init();
    let broker = Broker::start("pipeline");
    let sub = Subscriber::connect(broker.port, "sub-pipeline", "t5/#");
    let pipeline = launch(&format!(
        "videotestsrc pattern=ball num-buffers=10 ! video/x-raw,width=96,height=96,framerate=5/1 ! videoconvert \
         ! vlmencode mmproj=models/test-mmproj-mlp.gguf interval=0 min-change=0 \
         ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
         ! vlmquery caption-prompt=\"Describe the picture.\" caption-interval=1000000000 max-tokens=4 \
           alerts=\"ball:Is there a ball?\" output-format=json \
         ! vlmpublish name=pub address={} topic=t5/{{stream}}/{{type}} mqtt-qos=1",
        broker.address()
    ));
    let run = run_to_eos(&pipeline, 240);
    let sink = pipeline.downcast_ref::<gst::Bin>().unwrap().by_name("pub").unwrap();
    let published = sink.property::<u64>("messages-published");
    pipeline.set_state(gst::State::Null).unwrap();
    assert!(run.errors.is_empty(), "{run:?}");
    let answers = run.messages.iter().filter(|m| m.name() == "vlm-answer").count();
    let alerts = run.messages.iter().filter(|m| m.name() == "vlm-alert").count();
    assert!(answers >= 1 && alerts >= 1, "{run:?}");
    // EOS left vlmpublish once every line was acknowledged: all are on their way.
    assert_eq!(published as usize, answers + alerts);
    let got = sub.wait("every published line", |got| got.len() >= answers + alerts);
    assert_eq!(got.len(), answers + alerts, "{got:?}");
    let mut kinds = (0, 0);
    for (topic, payload) in &got {
        let j: serde_json::Value = serde_json::from_str(payload).unwrap_or_else(|e| panic!("{payload}: {e}"));
        let stream = j["stream"].as_str().expect("a stream");
        if j["type"] == "alert" {
            assert_eq!(*topic, format!("t5/{stream}/alert"));
            assert_eq!(j["id"], "ball");
            kinds.1 += 1;
        } else {
            assert_eq!(*topic, format!("t5/{stream}/answer"));
            assert_eq!(j["status"], "answered", "{j}");
            assert_eq!(j["question"], "Describe the picture.");
            kinds.0 += 1;
        }
    }
    assert_eq!(kinds, (answers, alerts));
    assert!(sub.messages().len() == got.len());
}

#[test]
fn a_user_and_password_are_sent_and_a_refusal_is_an_error() {
    init();
    let broker = Broker::configure("password", Second::Password);
    let sub = Subscriber::connect(broker.port, "sub-password", "t7/#");
    let address = format!("127.0.0.1:{}", broker.second_port.unwrap());
    let p = Publisher::new(&format!("address={address} username=camera password=secret topic=t7/{{stream}}"));
    p.push(&format!("{}\n", answer("q1", "gate")));
    let got = sub.wait("the answer, from a user", |got| !got.is_empty());
    assert_eq!(got, [("t7/gate".to_string(), answer("q1", "gate"))]);
    let run = p.finish();
    assert!(run.errors.is_empty() && run.warnings.is_empty(), "{run:?}");
    drop(p);
    // A wrong password: an error on the bus, not retries.
    let p = Publisher::new(&format!("address={address} username=camera password=wrong"));
    p.push(&format!("{}\n", answer("q2", "gate")));
    let run = run_to_eos(&p.pipeline, GUARD.as_secs());
    assert_eq!(run.errors.len(), 1, "{run:?}");
    assert!(run.errors[0].contains("refused the connection") && run.errors[0].contains(&address), "{run:?}");
}
