//! llama.cpp's `rpc-server`, started for a test.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// llama.cpp's `rpc-server` on a free port of 127.0.0.1 (ggml's RPC protocol has no
/// authentication: tests never bind another address), killed when dropped. The binary is
/// `VLM_RPC_SERVER` (scripts/test.sh sets it), else where `scripts/build-llama-server.sh rpc`
/// puts it.
pub struct RpcServer {
    child: Child,
    pub endpoint: String,
    /// Its output, shown when a test fails while it runs.
    log: PathBuf,
}

impl RpcServer {
    pub fn start() -> RpcServer {
        let bin = std::env::var_os("VLM_RPC_SERVER").map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(std::env::var("PEER_CACHE").unwrap_or_else(|_| "/var/tmp/gst-vlm-peer".into()))
                .join("11434.0.0/build-cpu/bin/ggml-rpc-server")
        });
        assert!(bin.exists(), "no rpc-server at {}: `scripts/build-llama-server.sh rpc` builds it", bin.display());
        // The free port may be taken between the probe and the server's bind (tests run side by
        // side): a server that exits before it listens is started again on another.
        for _ in 0..3 {
            let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let log = std::env::temp_dir().join(format!("vlm-rpc-server-{}-{port}.log", std::process::id()));
            let out = std::fs::File::create(&log).unwrap();
            let mut child = Command::new(&bin)
                .args(["-H", "127.0.0.1", "-p", &port.to_string(), "-t", "1"])
                .stdout(out.try_clone().unwrap())
                .stderr(out)
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
            let endpoint = format!("127.0.0.1:{port}");
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                if TcpStream::connect(&endpoint).is_ok() {
                    return RpcServer { child, endpoint, log };
                }
                assert!(Instant::now() < deadline, "rpc-server did not listen on {endpoint} within 60 s");
                std::thread::sleep(Duration::from_millis(50));
            }
            eprintln!(
                "rpc-server on {endpoint} exited before listening: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        panic!("rpc-server did not start (3 attempts)");
    }

    /// Send the server a signal (`kill -SIG`: STOP, CONT, ...).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill").arg(format!("-{signal}")).arg(self.child.id().to_string()).status().unwrap();
        assert!(status.success(), "kill -{signal} {} failed", self.child.id());
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            eprintln!("rpc-server on {} said:\n{log}", self.endpoint);
        }
        let _ = std::fs::remove_file(&self.log);
    }
}
