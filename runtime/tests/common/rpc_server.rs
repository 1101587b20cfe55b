//! llama.cpp's `rpc-server`, started for a test.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// llama.cpp's `rpc-server` on a free port of 127.0.0.1 (ggml's RPC protocol has no
/// authentication: tests never bind another address), killed when dropped. The binary is
/// `VLM_RPC_SERVER` (scripts/test.sh sets it), else where `scripts/build-llama-server.sh rpc`
/// puts it.
pub struct RpcServer {
    child: Child,
    pub endpoint: String,
}

impl RpcServer {
    pub fn start() -> RpcServer {
        let bin = std::env::var_os("VLM_RPC_SERVER").map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(std::env::var("PEER_CACHE").unwrap_or_else(|_| "/var/tmp/gst-vlm-peer".into()))
                .join("11434.0.0/build-cpu/bin/ggml-rpc-server")
        });
        assert!(bin.exists(), "no rpc-server at {}: `scripts/build-llama-server.sh rpc` builds it", bin.display());
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(&bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string(), "-t", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let endpoint = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(&endpoint).is_err() {
            assert!(Instant::now() < deadline, "rpc-server did not listen on {endpoint} within 60 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        RpcServer { child, endpoint }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.kill();
    }
}
