//! SECTION:element-vlmpublish
//! @see_also: vlmquery
//!
//! `vlmpublish` publishes every line of its text input as one MQTT message, so each JSON answer
//! and each `vlm-alert` line of `vlmquery output-format=json` reaches an MQTT broker (as DL
//! Streamer's `gvametapublish method=mqtt` does) with no `mosquitto_pub` behind stdout. Its sink
//! pad takes `text/x-raw, format=utf8` (what `vlmquery` pushes; other text through a capsfilter);
//! each buffer is split on newlines, a trailing `\r` removed and blank lines skipped.
//!
//! Each line goes to `topic` with `{stream}` replaced by the line's `"stream"` field and `{type}`
//! by `answer` (a JSON object without `"type":"alert"`: answers, streamed pieces and failed
//! answers), `alert` (`"type":"alert"`) or `text` (a line that is not a JSON object, e.g. from
//! `output-format=text`: published as it is). A line without `"stream"` takes the stream of the
//! buffer's `VlmAnswerMeta`, else `unknown`. A substituted stream is one topic level: `/`, `+`
//! and `#` in it become `_`.
//!
//! `render` never waits for the network. Each message joins a buffer of at most `max-buffered`
//! messages, which the element's own thread publishes from: it connects, and after a failure or a
//! lost connection reconnects with backoff (100 ms, doubling up to 5 s). A message stays buffered
//! until it is delivered: written to the connection at `mqtt-qos=0`, acknowledged by the broker
//! (PUBACK) at `mqtt-qos=1`. When the connection is lost, every message not yet acknowledged is
//! published again after reconnecting, so at QoS 1 a broker restart loses nothing that fits in
//! the buffer; delivery is at least once (a message the broker took just before it went away may
//! arrive twice). The element keeps those messages itself and connects with a clean session, so
//! this holds whether or not the broker keeps sessions across a restart. When the buffer is full,
//! the oldest message not yet handed to the connection is dropped (the new one when every
//! buffered message is in flight), counted in `messages-dropped`, with one WARNING per episode
//! (until the buffer empties again). A line over 1 MiB, or whose topic is over MQTT's 65535
//! bytes, is dropped with a WARNING; so is a message that awaited its acknowledgement at three
//! lost connections (a broker that drops the client over it).
//!
//! A broker that is not there never stalls the pipeline: the element starts and reaches PLAYING,
//! posts one WARNING naming the address and the system's error (e.g. "Connection refused (os error
//! 111)") and keeps retrying; a lost connection posts one WARNING too, and `connected` says where
//! it stands. A broker that hangs with the connection open is given up, and reconnected to, when a
//! write or a connection attempt has waited 5 s or a keep-alive ping (sent every 30 s) is still
//! unanswered at the next one. A broker that refuses the client (bad user name or password, not
//! authorized, client id rejected) is an ERROR and is not retried. At EOS the element waits up to
//! `flush-timeout` for the buffer to empty, then lets EOS go on (a WARNING says how many were not
//! delivered). The element connects at NULL→READY (as `filesink` opens its file): what applies at
//! start is refused from READY on. Stopping (READY→NULL) ends the thread within 2 s whatever the
//! broker does, sending a DISCONNECT when connected, and counts what is still buffered in
//! `messages-dropped`.
//!
//! ## Example pipelines
//!
//! Captions and alerts of a camera to a broker on this machine, one topic per stream and kind
//! (watch them with `mosquitto_sub -h localhost -t 'cameras/#' -v`):
//!
//! ```sh
//! gst-launch-1.0 videotestsrc pattern=ball num-buffers=300 ! videoconvert \
//!     ! vlmencode mmproj=models/test-mmproj-mlp.gguf ! vlmcontext model=models/SmolLM2-135M-Instruct.Q4_1.gguf \
//!     ! vlmquery caption-prompt="Describe the scene." caption-interval=2000000000 max-tokens=16 \
//!       alerts="ball:Is there a ball?" output-format=json \
//!     ! vlmpublish address=localhost:1883 topic="cameras/{stream}/{type}" mqtt-qos=1
//! ```
//!
//! With TLS and a user (the broker's certificate is checked against `ca-file`, its name against
//! the host of `address`):
//!
//! ```sh
//! ... ! vlmquery output-format=json ! vlmpublish address=broker.example.com:8883 tls=true \
//!     ca-file=/etc/ssl/broker-ca.pem username=camera1 password=secret client-id=camera1
//! ```
//!
//! ## Properties
//!
//! Every property below: Since: 0.1. All but `topic` and `flush-timeout` apply when the element
//! starts: setting one while it runs is refused with a WARNING. An invalid value (an address
//! without a port, an empty topic, ...) is refused with a WARNING (on stderr and on the bus) and
//! the previous value kept.
//!
//! - `address` (`localhost:1883`): the broker, `host:port` (the port required; an IPv6 address
//!   as `[address]:port`). A URL (`mqtt://...`) is refused: TLS is `tls=true`.
//! - `topic` (`gst-vlm/{stream}/{type}`): see above; settable while PLAYING. A wildcard (`+`,
//!   `#`) or a placeholder other than `{stream}` and `{type}` is refused.
//! - `mqtt-qos` (0-1, 1): the MQTT quality of service (`qos` is `GstBaseSink`'s boolean, QoS
//!   events upstream, which this sink leaves as it is).
//! - `client-id` (empty: `gst-vlm-<pid>-<element name>`); `username` (empty: none);
//!   `password` (write-only; needs a username).
//! - `tls` (false): TLS through rustls; `ca-file` (empty: the system's roots): the PEM
//!   certificates of the authorities trusted.
//! - `retain` (false): publish with the retain flag.
//! - `max-buffered` (1-1000000, 1000): messages kept until delivered.
//! - `flush-timeout` (ns, 5000000000): most time EOS waits for delivery; 0 = no wait.
//! - Read-only: `messages-published` (delivered), `messages-dropped` (the buffer full, a line over
//!   1 MiB, undelivered when the element stopped), `messages-buffered` (waiting or in flight),
//!   `connected`; each notified when it changes, kept after the element stops and zero again
//!   when it starts.
//! - From `GstBaseSink`: `sync` (false here: lines go out as they come), `async`,
//!   `max-lateness`, `ts-offset`, `enable-last-sample`, `last-sample`, `blocksize`,
//!   `render-delay`, `throttle-time`, `max-bitrate`, `processing-deadline`, `stats`.
//!
//! Debug category: `vlmpublish`.
//!
//! Since: 0.1

use gst::glib;
use gst::prelude::*;

mod imp;

glib::wrapper! {
    pub struct VlmPublish(ObjectSubclass<imp::VlmPublish>) @extends gst_base::BaseSink, gst::Element, gst::Object;
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    // The debug category exists from plugin load on (`gst-launch-1.0 --gst-debug-help` lists it).
    std::sync::LazyLock::force(&imp::CAT);
    gst::Element::register(Some(plugin), "vlmpublish", gst::Rank::NONE, VlmPublish::static_type())
}
