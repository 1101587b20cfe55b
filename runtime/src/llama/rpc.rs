//! llama.cpp's RPC backend (ggml-rpc): devices served by `rpc-server`s on other machines (or on
//! this one), and containing their failure.
//!
//! ggml-rpc has no error path. A server that cannot be reached, that dies, or that answers
//! something malformed ends in `GGML_ABORT`, i.e. `abort()` of the whole process, on the thread
//! that noticed it: usually the endpoint's dispatcher thread, while the thread that issued the
//! command (an engine thread) waits for it for ever. Here a process-wide abort hook (installed
//! when the first RPC engine is set up, matching only ggml-rpc's transport failures) turns such an
//! abort into an event instead: the failing thread is parked for good, the failure is recorded
//! and waiters are woken ([`wait_failure`]); the engine watchdog (`crate::engine`) then declares
//! the engines stuck on it failed. What such an engine holds (its context, its copy of the
//! weights, the parked threads) is leaked on purpose: freeing it would talk to the dead server,
//! and ggml-rpc keeps one connection per endpoint for the life of the process, so a failed
//! endpoint is not used again until the process restarts. Other aborts keep llama.cpp's
//! behaviour (an abort callback installed before ours, else the message and ggml's backtrace on
//! stderr; then `abort()`).
//!
//! ggml's RPC protocol has no authentication and no encryption: anyone who reaches the port can
//! run computations and read or write the server's memory. Reach a remote server over an SSH
//! tunnel or a private network, never an open port (docs/deploy.md, "A remote engine").

use std::ffi::{CStr, CString, c_char};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::{OnceLock, mpsc};
use std::time::{Duration, Instant};

use llama_cpp_sys_2 as sys;
use parking_lot::{Condvar, Mutex};

use super::{LogLevel, init_backend, log};
use crate::error::{Error, Result};

/// How long the check that an endpoint accepts connections waits.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the handshake check ([`handshake`]) waits for the server's answer.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the setup of an RPC engine (the handshakes, the weights sent to the servers, the
/// context) may take before it is given up (the server stopped without closing its connection):
/// `VLM_RPC_SETUP_TIMEOUT_S` seconds, default 300.
const SETUP_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a setup may still go on after an RPC failure that names no endpoint while its own
/// servers accept connections (the failure was probably another endpoint's).
const UNATTRIBUTED_LIMIT: Duration = Duration::from_secs(30);
/// ggml-rpc's protocol (ggml-rpc.h and ggml-rpc.cpp of the pinned llama.cpp): the HELLO command,
/// the size of its connection capabilities, and the version a client of this build accepts
/// (the same major version, a minor version no newer).
const RPC_CMD_HELLO: u8 = 14;
const RPC_CONN_CAPS_SIZE: usize = 24;
const RPC_PROTO_MAJOR_VERSION: u8 = 7;
const RPC_PROTO_MINOR_VERSION: u8 = 0;
/// How long work that talks to RPC servers may still go on after an RPC failure before it is
/// taken to be stuck on it.
pub(crate) const FAILURE_GRACE: Duration = Duration::from_secs(1);

/// RPC failures so far: (count, the newest one's message).
static FAILURES: (Mutex<(u64, String)>, Condvar) = (Mutex::new((0, String::new())), Condvar::new());
/// Endpoints an engine failed on (not used again in this process).
static FAILED_ENDPOINTS: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// Endpoints in use by a loaded model of this process, and how many models use each: ggml-rpc
/// holds a connection to them, and an rpc-server serves one client at a time, so no handshake
/// check is made there (it would wait for that connection to close).
static IN_USE: Mutex<Vec<(String, usize)>> = Mutex::new(Vec::new());

/// A loaded model's use of its endpoints (released when dropped, after the model is freed).
pub(super) struct Lease(Vec<String>);

impl Drop for Lease {
    fn drop(&mut self) {
        let mut in_use = IN_USE.lock();
        for endpoint in &self.0 {
            if let Some(i) = in_use.iter().position(|(e, _)| e == endpoint) {
                in_use[i].1 -= 1;
                if in_use[i].1 == 0 {
                    in_use.swap_remove(i);
                }
            }
        }
    }
}

fn lease(endpoints: &[String]) -> Lease {
    let mut in_use = IN_USE.lock();
    for endpoint in endpoints {
        match in_use.iter_mut().find(|(e, _)| e == endpoint) {
            Some((_, n)) => *n += 1,
            None => in_use.push((endpoint.clone(), 1)),
        }
    }
    Lease(endpoints.to_vec())
}

fn in_use(endpoint: &str) -> bool {
    IN_USE.lock().iter().any(|(e, _)| e == endpoint)
}

/// ggml-rpc's own handshake (HELLO, then the server's version), made on a connection of our own
/// with timeouts before ggml-rpc is called: ggml-rpc connects and shakes hands while it holds
/// process-wide locks (`get_dispatcher`, `ggml_backend_rpc_add_server`) and aborts when that
/// fails; its thread, parked by the abort hook, would keep those locks and block every later RPC
/// engine of the process. A server that accepts and closes (a wrong port, a server dying during
/// its handshake), answers another protocol version, or does not answer (stopped, or serving
/// another client: an rpc-server serves one at a time) is refused here, naming it.
pub(crate) fn handshake(endpoint: &str) -> std::result::Result<(), String> {
    use std::io::{ErrorKind, Read, Write};
    let addrs: Vec<_> = endpoint.to_socket_addrs().map_err(|e| e.to_string())?.collect();
    let mut last = "the name resolves to no address".to_owned();
    let mut stream = None;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = e.to_string(),
        }
    }
    let mut stream = stream.ok_or(last)?;
    let io = |e: std::io::Error| match e.kind() {
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
            "it closed the connection during ggml-rpc's handshake (not an rpc-server, or one that failed)".to_owned()
        }
        ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
            "it did not answer ggml-rpc's handshake within {} s (stopped, or serving another client: an rpc-server \
             serves one at a time)",
            HANDSHAKE_TIMEOUT.as_secs()
        ),
        _ => format!("ggml-rpc's handshake failed: {e}"),
    };
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(io)?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(io)?;
    // | cmd (1 byte) | request size (8 bytes, little endian as ggml-rpc writes it on the hosts it
    // runs on) | request: the connection capabilities (none asked for) |
    let mut request = vec![RPC_CMD_HELLO];
    request.extend_from_slice(&(RPC_CONN_CAPS_SIZE as u64).to_le_bytes());
    request.extend_from_slice(&[0; RPC_CONN_CAPS_SIZE]);
    stream.write_all(&request).map_err(io)?;
    // | response size (8 bytes) | major, minor, patch, padding, capabilities |
    let mut size = [0u8; 8];
    stream.read_exact(&mut size).map_err(io)?;
    let size = u64::from_le_bytes(size);
    if size != 4 + RPC_CONN_CAPS_SIZE as u64 {
        return Err(format!("it answered ggml-rpc's handshake with {size} bytes: not an rpc-server of this version"));
    }
    let mut response = [0u8; 4 + RPC_CONN_CAPS_SIZE];
    stream.read_exact(&mut response).map_err(io)?;
    let (major, minor, patch) = (response[0], response[1], response[2]);
    if major != RPC_PROTO_MAJOR_VERSION || minor > RPC_PROTO_MINOR_VERSION {
        return Err(format!(
            "it speaks RPC protocol {major}.{minor}.{patch}, this build {RPC_PROTO_MAJOR_VERSION}.{RPC_PROTO_MINOR_VERSION}.x \
             (build the server from the same llama.cpp: scripts/build-llama-server.sh rpc)"
        ));
    }
    Ok(())
}

/// ggml-rpc's source files, as `__FILE__` ends in ggml's abort messages.
const RPC_SOURCES: [&str; 2] = ["ggml-rpc/ggml-rpc.cpp", "ggml-rpc/transport.cpp"];
/// The starts of ggml-rpc's abort messages that mean a lost or failed connection to a server
/// (`RPC_STATUS_ASSERT` and `rpc_dispatcher::start` in ggml-rpc.cpp): only these are parked. A
/// GGML_ASSERT in ggml-rpc's own code (a client-side bug) and every other abort keep ggml's
/// behaviour.
const TRANSPORT_FAILURES: [&str; 4] = [
    "Remote RPC server crashed or returned malformed response",
    "Failed to connect to ",
    "RPC handshake failed for ",
    "RPC transport initialization failed",
];

/// What the abort hook does with an abort message.
#[derive(Debug, PartialEq, Eq)]
enum OnAbort<'a> {
    /// A transport failure of ggml-rpc: park the thread; the reason (the message without the
    /// source location).
    Park(&'a str),
    /// Anything else: what ggml does without this hook (or the hook installed before it).
    Pass,
}

/// Classify ggml's abort message, `"{__FILE__}:{__LINE__}: {message}"` (ggml_abort in ggml.c):
/// the location must be one of ggml-rpc's sources and the message one of its transport failures.
/// A build path that merely contains "ggml-rpc" (a checkout under such a directory) or a
/// GGML_ASSERT inside ggml-rpc is not a transport failure.
fn on_abort_message(text: &str) -> OnAbort<'_> {
    // The location ends at the first ":<digits>: ".
    let bytes = text.as_bytes();
    let mut split = None;
    for (i, _) in text.match_indices(':') {
        let digits = bytes[i + 1..].iter().take_while(|b| b.is_ascii_digit()).count();
        if digits > 0 && text[i + 1 + digits..].starts_with(": ") {
            split = Some((i, i + 1 + digits + 2));
            break;
        }
    }
    let Some((file_end, message_start)) = split else { return OnAbort::Pass };
    let file = text[..file_end].replace('\\', "/");
    let message = text[message_start..].trim();
    let from_rpc = RPC_SOURCES.iter().any(|source| file == *source || file.ends_with(&format!("/{source}")));
    if from_rpc && TRANSPORT_FAILURES.iter().any(|failure| message.starts_with(failure)) {
        OnAbort::Park(message)
    } else {
        OnAbort::Pass
    }
}

/// The abort callback that was installed before ours (chained for every other abort).
static PREVIOUS_ABORT: OnceLock<sys::ggml_abort_callback_t> = OnceLock::new();

unsafe extern "C" {
    /// ggml's own backtrace on abort (ggml.c; declared in its private ggml-impl.h, exported by
    /// libggml-base): what ggml prints when no abort callback is set.
    fn ggml_print_backtrace();
}

/// Install the abort hook, once per process, before the first call into ggml-rpc: only a process
/// that creates an RPC engine has it. The callback installed before it (if any) is kept and
/// called for every abort that is not an RPC transport failure.
pub(super) fn install_abort_hook() {
    init_backend();
    PREVIOUS_ABORT.get_or_init(|| {
        // SAFETY: ggml_set_abort_callback swaps a plain function pointer; ours lives for the process.
        unsafe { sys::ggml_set_abort_callback(Some(on_abort)) }
    });
}

/// ggml's abort hook (installed by [`install_abort_hook`]).
unsafe extern "C" fn on_abort(message: *const c_char) {
    let text = if message.is_null() {
        String::new()
    } else {
        // SAFETY: ggml passes its NUL-terminated message buffer, valid for the call.
        unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned()
    };
    if let OnAbort::Park(reason) = on_abort_message(&text) {
        log(LogLevel::Error, &format!("RPC failure (this thread is parked, not aborting the process): {reason}"));
        {
            let mut failures = FAILURES.0.lock();
            failures.0 += 1;
            failures.1 = reason.to_owned();
        }
        FAILURES.1.notify_all();
        // Returning would abort the process. The thread's own state (a socket, a queue) is
        // unusable and everything that waits on it is abandoned with it.
        loop {
            std::thread::park();
        }
    }
    match PREVIOUS_ABORT.get().copied().flatten() {
        // SAFETY: the callback that was installed before ours, with the message ggml gave us.
        Some(previous) => unsafe { previous(message) },
        None => {
            // ggml's default without a callback: the message, then its backtrace.
            eprintln!("{text}");
            // SAFETY: a function of ggml taking and returning nothing; ggml calls it here itself.
            unsafe { ggml_print_backtrace() }
        }
    }
    // ggml calls abort() when this returns.
}

/// The number of RPC failures so far (what [`wait_failure`] counts from).
pub(crate) fn failures() -> u64 {
    FAILURES.0.lock().0
}

/// Wait up to `timeout` for an RPC failure after the first `seen`; its count and message.
pub(crate) fn wait_failure(seen: u64, timeout: Duration) -> Option<(u64, String)> {
    let deadline = Instant::now() + timeout;
    let mut failures = FAILURES.0.lock();
    while failures.0 <= seen {
        if FAILURES.1.wait_until(&mut failures, deadline).timed_out() {
            return None;
        }
    }
    Some(failures.clone())
}

/// Whether `endpoint` accepts a TCP connection now (the connection is closed at once).
pub(crate) fn reachable(endpoint: &str) -> std::io::Result<()> {
    let addrs: Vec<_> = endpoint.to_socket_addrs()?.collect();
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "the name resolves to no address");
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(_) => return Ok(()),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Remember that an engine failed on these endpoints.
pub(crate) fn mark_failed(endpoints: &[String]) {
    let mut failed = FAILED_ENDPOINTS.lock();
    for e in endpoints {
        if !failed.contains(e) {
            failed.push(e.clone());
        }
    }
}

/// Whether an engine failed on one of `endpoints` (ggml-rpc's connection to it is dead).
pub(crate) fn failed(endpoints: &[String]) -> bool {
    let failed = FAILED_ENDPOINTS.lock();
    endpoints.iter().any(|e| failed.contains(e))
}

/// Free something held on the RPC servers at `endpoints` (`free` tells them): where a failure
/// meanwhile cannot hang the caller, and not at all on a server that already failed (that would
/// wait for ever; what it held there is gone with it, what it held here is leaked).
pub(super) fn free(endpoints: &[String], free: impl FnOnce() + Send + 'static) {
    if !failed(endpoints) {
        let _ = guarded(endpoints, move || {
            free();
            Ok(())
        });
    }
}

/// llama.cpp's devices on the `rpc-server`s at `endpoints` (every device each one serves).
/// Call through [`guarded`]: a server that fails during the handshake parks the calling thread.
pub(super) fn devices(endpoints: &[String]) -> Result<(Vec<sys::ggml_backend_dev_t>, Lease)> {
    install_abort_hook();
    for endpoint in endpoints {
        // ggml-rpc splits at the first ':' and aborts the process on a port it cannot parse (an
        // IPv6 address in brackets, for one).
        let port = endpoint.split_once(':').map(|(host, port)| (host.is_empty(), port));
        if !port.is_some_and(|(no_host, port)| !no_host && port.parse::<u16>().is_ok_and(|p| p > 0)) {
            return Err(Error::Config(format!(
                "bad RPC endpoint {endpoint:?}: ggml-rpc takes HOST:PORT with a host name or IPv4 address"
            )));
        }
        if failed(std::slice::from_ref(endpoint)) {
            return Err(Error::Engine(format!(
                "the RPC server at {endpoint} failed earlier in this process (ggml-rpc keeps one connection per \
                 endpoint: restart the process to use it again)"
            )));
        }
        reachable(endpoint)
            .map_err(|e| Error::Engine(format!("the RPC server at {endpoint} is not reachable: {e}")))?;
        if !in_use(endpoint) {
            handshake(endpoint).map_err(|e| Error::Engine(format!("the RPC server at {endpoint} is refused: {e}")))?;
        }
    }
    // Taken before ggml-rpc connects: a second engine's setup meanwhile makes no handshake check
    // that the server (busy with this one's connection) could not answer.
    let lease = lease(endpoints);
    // SAFETY: the registry is initialised; the name is a NUL-terminated literal.
    let reg = unsafe { sys::ggml_backend_reg_by_name(c"RPC".as_ptr()) };
    if reg.is_null() {
        return Err(Error::Config("this build of llama.cpp has no RPC backend (build it with GGML_RPC=ON)".into()));
    }
    // SAFETY: a registered backend's lookup by name; null when it has no such function.
    let add = unsafe { sys::ggml_backend_reg_get_proc_address(reg, c"ggml_backend_rpc_add_server".as_ptr()) };
    if add.is_null() {
        return Err(Error::Config("llama.cpp's RPC backend has no ggml_backend_rpc_add_server".into()));
    }
    // SAFETY: ggml-rpc.h declares `ggml_backend_reg_t ggml_backend_rpc_add_server(const char *)`.
    let add: unsafe extern "C" fn(*const c_char) -> sys::ggml_backend_reg_t = unsafe { std::mem::transmute(add) };
    let mut devices = vec![];
    for endpoint in endpoints {
        let c = CString::new(endpoint.as_str()).map_err(|_| Error::Config(format!("bad RPC endpoint {endpoint:?}")))?;
        // SAFETY: a NUL-terminated endpoint; the registry entry returned lives for the process.
        let server = unsafe { add(c.as_ptr()) };
        // SAFETY: devices of a valid registry entry.
        let count = if server.is_null() { 0 } else { unsafe { sys::ggml_backend_reg_dev_count(server) } };
        if count == 0 {
            return Err(Error::Engine(format!("the RPC server at {endpoint} serves no device")));
        }
        // SAFETY: indices below the count.
        devices.extend((0..count).map(|i| unsafe { sys::ggml_backend_reg_dev_get(server, i) }));
    }
    Ok((devices, lease))
}

/// The setup deadline: `VLM_RPC_SETUP_TIMEOUT_S` (seconds), else [`SETUP_TIMEOUT`].
fn setup_timeout() -> Duration {
    std::env::var("VLM_RPC_SETUP_TIMEOUT_S")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map_or(SETUP_TIMEOUT, Duration::from_secs_f64)
}

/// Whether an RPC failure's message names an endpoint, and not one of `endpoints` (ggml-rpc names
/// the endpoint when it cannot connect or shake hands, not when a connection fails later).
fn names_another_endpoint(reason: &str, endpoints: &[String]) -> bool {
    ["Failed to connect to ", "RPC handshake failed for "]
        .iter()
        .find_map(|start| reason.strip_prefix(start))
        .is_some_and(|named| !endpoints.iter().any(|e| e == named.trim()))
}

/// Run `work`, which talks to the RPC servers at `endpoints`, on a thread of its own and wait for
/// it, at most the setup deadline (`VLM_RPC_SETUP_TIMEOUT_S`, 300 s). When an RPC failure
/// happens meanwhile and `work` has not returned [`FAILURE_GRACE`] later, give up with an error
/// naming the endpoints if the failure is theirs: one of them refuses connections, or the failure
/// names no other endpoint (another endpoint's failure during this setup does not fail a healthy
/// one). The thread, parked on the failure or stuck on a silent server, is abandoned with what it
/// holds.
pub(crate) fn guarded<T: Send + 'static>(
    endpoints: &[String],
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let mut seen = failures();
    let started = Instant::now();
    let deadline = setup_timeout();
    let (tx, rx) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("vlm-rpc-setup".into())
        .spawn(move || {
            block_sigpipe();
            let _ = tx.send(work());
        })
        .map_err(|e| Error::Engine(format!("cannot start a thread: {e}")))?;
    let mut failed_at = None;
    loop {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(result) => return result,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(Error::Engine("the RPC setup thread ended without a result".into()));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if started.elapsed() >= deadline {
            mark_failed(endpoints);
            return Err(Error::Engine(format!(
                "the RPC server at {} did not complete the setup within {} s (stopped, or the network is down; \
                 VLM_RPC_SETUP_TIMEOUT_S sets the limit)",
                endpoints.join(" + "),
                deadline.as_secs_f64()
            )));
        }
        match failed_at {
            None if failures() > seen => failed_at = Some(Instant::now()),
            Some(at) if Instant::elapsed(&at) >= FAILURE_GRACE => {
                let reason = FAILURES.0.lock().1.clone();
                if names_another_endpoint(&reason, endpoints) {
                    // Another endpoint's failure: this setup goes on (until its deadline).
                    seen = failures();
                    failed_at = None;
                    continue;
                }
                // A failure naming no endpoint (a connection lost after its handshake) is this
                // setup's when one of its servers refuses connections now, or when the setup
                // still has not returned [`UNATTRIBUTED_LIMIT`] later.
                let ours = endpoints.iter().any(|e| reason.contains(e.as_str()))
                    || endpoints.iter().any(|e| reachable(e).is_err())
                    || Instant::elapsed(&at) >= UNATTRIBUTED_LIMIT;
                if ours {
                    mark_failed(endpoints);
                    return Err(Error::Engine(failure_reason(endpoints)));
                }
            }
            _ => {}
        }
    }
}

/// Block SIGPIPE on the calling thread and the threads it starts. ggml-rpc writes to its socket
/// without MSG_NOSIGNAL, so a write to a server that went away would raise SIGPIPE, whose default
/// action ends the process (a C application such as gst-launch-1.0 keeps it); blocked, the
/// write fails with EPIPE instead, which is an RPC failure like any other. The endpoint's
/// dispatcher thread is started by the thread that first connects, and inherits its mask.
pub(crate) fn block_sigpipe() {
    // SAFETY: a zeroed sigset_t filled by sigemptyset/sigaddset; pthread_sigmask changes only the
    // calling thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGPIPE);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Why work on `endpoints` was lost to the newest RPC failure.
pub(crate) fn failure_reason(endpoints: &[String]) -> String {
    let reason = FAILURES.0.lock().1.clone();
    format!("the RPC server at {} stopped answering ({reason})", endpoints.join(" + "))
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;

    use super::{OnAbort, handshake, names_another_endpoint, on_abort_message};

    /// A one-connection server that reads the HELLO request and answers `version`.
    fn answering(version: [u8; 3]) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let mut request = [0u8; 1 + 8 + 24];
            c.read_exact(&mut request).unwrap();
            assert_eq!((request[0], u64::from_le_bytes(request[1..9].try_into().unwrap())), (14, 24));
            let mut response = 28u64.to_le_bytes().to_vec();
            response.extend_from_slice(&[version[0], version[1], version[2], 0]);
            response.extend_from_slice(&[0; 24]);
            c.write_all(&response).unwrap();
        });
        endpoint
    }

    #[test]
    fn the_handshake_check_speaks_ggml_rpcs_hello() {
        assert_eq!(handshake(&answering([7, 0, 3])), Ok(()));
        let err = handshake(&answering([6, 1, 0])).unwrap_err();
        assert!(err.contains("protocol 6.1.0"), "{err}");
        assert!(handshake(&answering([7, 1, 0])).is_err(), "a newer minor version is refused, as ggml-rpc does");
        let closing = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = closing.local_addr().unwrap().to_string();
        std::thread::spawn(move || drop(closing.accept()));
        let err = handshake(&endpoint).unwrap_err();
        assert!(err.contains("closed the connection"), "{err}");
    }

    /// A setup is failed by a failure that names its own endpoint or none, not by another
    /// endpoint's (a healthy server's setup overlapping another server's death).
    #[test]
    fn a_failure_naming_another_endpoint_is_not_this_setups() {
        let ours = ["127.0.0.1:5000".to_owned(), "10.0.0.2:50052".to_owned()];
        assert!(names_another_endpoint("Failed to connect to 127.0.0.1:6000", &ours));
        assert!(names_another_endpoint("RPC handshake failed for h:1", &ours));
        assert!(!names_another_endpoint("Failed to connect to 127.0.0.1:5000", &ours));
        assert!(!names_another_endpoint("RPC handshake failed for 10.0.0.2:50052", &ours));
        assert!(!names_another_endpoint("Remote RPC server crashed or returned malformed response", &ours));
    }

    #[test]
    fn only_ggml_rpcs_transport_failures_are_parked() {
        let src = "/home/ci/llama.cpp/ggml/src";
        for (message, reason) in [
            (
                format!("{src}/ggml-rpc/ggml-rpc.cpp:354: Remote RPC server crashed or returned malformed response"),
                "Remote RPC server crashed or returned malformed response",
            ),
            (
                format!("{src}/ggml-rpc/ggml-rpc.cpp:547: Failed to connect to 127.0.0.1:1\n"),
                "Failed to connect to 127.0.0.1:1",
            ),
            (
                format!("{src}/ggml-rpc/ggml-rpc.cpp:550: RPC handshake failed for h:2\n"),
                "RPC handshake failed for h:2",
            ),
            (
                "ggml-rpc/transport.cpp:9: RPC transport initialization failed".into(),
                "RPC transport initialization failed",
            ),
        ] {
            assert_eq!(on_abort_message(&message), OnAbort::Park(reason), "{message}");
        }
        for message in [
            // A checkout under a directory named ggml-rpc: a non-RPC assert names it in __FILE__.
            "/home/u/ggml-rpc/gst-vlm/llama.cpp/ggml/src/ggml.c:1234: GGML_ASSERT(ne % 2 == 0) failed".to_owned(),
            "/srv/ggml-rpc-build/ggml/src/ggml-cpu/ops.cpp:77: fatal error".into(),
            // The same path with a transport failure's words, from another file.
            "/home/u/ggml-rpc/ggml/src/ggml-backend.cpp:5: Failed to connect to nothing".into(),
            // A client-side assert in ggml-rpc itself is a bug, not a transport failure.
            format!("{src}/ggml-rpc/ggml-rpc.cpp:1222: GGML_ASSERT(ctx_ptr != nullptr) failed"),
            format!("{src}/ggml-rpc/ggml-rpc.cpp:460: GGML_ASSERT(queue.push(msg)) failed"),
            // A message that only mentions ggml-rpc.
            format!("{src}/ggml.c:10: unexpected ggml-rpc/ggml-rpc.cpp:354: Remote RPC server crashed"),
            "no location at all: Remote RPC server crashed or returned malformed response".into(),
            String::new(),
        ] {
            assert_eq!(on_abort_message(&message), OnAbort::Pass, "{message}");
        }
    }
}
