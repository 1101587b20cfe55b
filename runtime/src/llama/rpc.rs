//! llama.cpp's RPC backend (ggml-rpc): devices served by `rpc-server`s on other machines (or on
//! this one), and containing their failure.
//!
//! ggml-rpc has no error path. A server that cannot be reached, that dies, or that answers
//! something malformed ends in `GGML_ABORT`, i.e. `abort()` of the whole process, on the thread
//! that noticed it: usually the endpoint's dispatcher thread, while the thread that issued the
//! command (an engine thread) waits for it for ever. Here a process-wide abort hook turns such an
//! abort into an event instead: the failing thread is parked for good, the failure is recorded
//! and waiters are woken ([`wait_failure`]); the engine watchdog (`crate::engine`) then declares
//! the engines stuck on it failed. What such an engine holds (its context, its copy of the
//! weights, the parked threads) is leaked on purpose: freeing it would talk to the dead server,
//! and ggml-rpc keeps one connection per endpoint for the life of the process, so a failed
//! endpoint is not used again until the process restarts. Other aborts keep llama.cpp's
//! behaviour (the message on stderr, then `abort()`).
//!
//! ggml's RPC protocol has no authentication and no encryption: anyone who reaches the port can
//! run computations and read or write the server's memory. Reach a remote server over an SSH
//! tunnel or a private network, never an open port (README, "A remote engine").

use std::ffi::{CStr, CString, c_char};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use llama_cpp_sys_2 as sys;
use parking_lot::{Condvar, Mutex};

use super::{LogLevel, init_backend, log};
use crate::error::{Error, Result};

/// How long the check that an endpoint accepts connections waits.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long work that talks to RPC servers may still go on after an RPC failure before it is
/// taken to be stuck on it.
pub(crate) const FAILURE_GRACE: Duration = Duration::from_secs(1);

/// RPC failures so far: (count, the newest one's message).
static FAILURES: (Mutex<(u64, String)>, Condvar) = (Mutex::new((0, String::new())), Condvar::new());
/// Endpoints an engine failed on (not used again in this process).
static FAILED_ENDPOINTS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// ggml's abort hook (installed by `init_backend`).
pub(super) unsafe extern "C" fn on_abort(message: *const c_char) {
    let text = if message.is_null() {
        String::new()
    } else {
        // SAFETY: ggml passes its NUL-terminated message buffer, valid for the call.
        unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned()
    };
    // ggml's messages start with the source file: ggml/src/ggml-rpc/ggml-rpc.cpp or transport.cpp.
    if text.contains("ggml-rpc") {
        let reason = text.split_once(": ").map_or(text.as_str(), |(_, m)| m).trim().to_owned();
        log(LogLevel::Error, &format!("RPC failure (this thread is parked, not aborting the process): {reason}"));
        {
            let mut failures = FAILURES.0.lock();
            failures.0 += 1;
            failures.1 = reason;
        }
        FAILURES.1.notify_all();
        // Returning would abort the process. The thread's own state (a socket, a queue) is
        // unusable and everything that waits on it is abandoned with it.
        loop {
            std::thread::park();
        }
    }
    eprintln!("{text}");
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
pub(super) fn devices(endpoints: &[String]) -> Result<Vec<sys::ggml_backend_dev_t>> {
    init_backend();
    for endpoint in endpoints {
        if failed(std::slice::from_ref(endpoint)) {
            return Err(Error::Engine(format!(
                "the RPC server at {endpoint} failed earlier in this process (ggml-rpc keeps one connection per \
                 endpoint: restart the process to use it again)"
            )));
        }
        reachable(endpoint)
            .map_err(|e| Error::Engine(format!("the RPC server at {endpoint} is not reachable: {e}")))?;
    }
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
    Ok(devices)
}

/// Run `work`, which talks to the RPC servers at `endpoints`, on a thread of its own and wait for
/// it: when an RPC failure happens meanwhile and `work` has not returned [`FAILURE_GRACE`]
/// later, give up with an error naming the endpoints (the thread, parked on the failure, is
/// abandoned with what it holds).
pub(crate) fn guarded<T: Send + 'static>(
    endpoints: &[String],
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let seen = failures();
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
        match failed_at {
            None if failures() > seen => failed_at = Some(Instant::now()),
            Some(at) if Instant::elapsed(&at) >= FAILURE_GRACE => {
                mark_failed(endpoints);
                return Err(Error::Engine(failure_reason(endpoints)));
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
