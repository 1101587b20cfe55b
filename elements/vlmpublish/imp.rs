use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::prelude::*;
use gst_base::subclass::prelude::*;
use parking_lot::Mutex;

// The link to the broker (the bounded buffer and the connection's thread) and what is decided
// without one (addresses, topics, lines). Properties, TLS and the base class's calls stay here.
mod link;
mod route;

pub(crate) static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new("vlmpublish", gst::DebugColorFlags::empty(), Some("gst-vlm MQTT publisher"))
});

const DEFAULT_ADDRESS: &str = "localhost:1883";
const DEFAULT_TOPIC: &str = "gst-vlm/{stream}/{type}";
const DEFAULT_QOS: u32 = 1;
const DEFAULT_MAX_BUFFERED: u32 = 1000;
const DEFAULT_FLUSH_TIMEOUT: u64 = 5_000_000_000;
/// The largest line published; a longer one is dropped with a warning.
const MAX_PAYLOAD: usize = 1 << 20;
/// Seconds between keep-alive pings when nothing else is sent (a vanished broker is noticed
/// within 1.5 times that).
const KEEP_ALIVE_S: u64 = 30;

/// Properties read at start (address, client, TLS, qos, retain, buffer) and live (topic,
/// flush-timeout).
#[derive(Debug, Clone)]
struct Settings {
    address: String,
    topic: String,
    qos: u32,
    client_id: String,
    username: String,
    password: String,
    tls: bool,
    ca_file: String,
    retain: bool,
    max_buffered: u32,
    flush_timeout: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            address: DEFAULT_ADDRESS.into(),
            topic: DEFAULT_TOPIC.into(),
            qos: DEFAULT_QOS,
            client_id: String::new(),
            username: String::new(),
            password: String::new(),
            tls: false,
            ca_file: String::new(),
            retain: false,
            max_buffered: DEFAULT_MAX_BUFFERED,
            flush_timeout: DEFAULT_FLUSH_TIMEOUT,
        }
    }
}

#[derive(Default)]
pub struct VlmPublish {
    settings: Mutex<Settings>,
    running: Mutex<Option<link::Running>>,
    stats: Arc<link::Stats>,
    /// The EOS flush left messages and said so (not said again at stop).
    undelivered_said: Mutex<bool>,
}

impl VlmPublish {
    /// Refuse a value with a message, as GLib reports an invalid property value: on stderr,
    /// where gst-launch-1.0 shows it (an element configured from a launch line has no bus yet),
    /// and on the bus for an application that sets it later.
    fn refuse(&self, message: String) {
        glib::g_warning!("vlmpublish", "{}: {message}", self.obj().name());
        gst::element_imp_warning!(self, gst::LibraryError::Settings, ("{}", message));
    }

    fn link(&self) -> Option<Arc<link::Link>> {
        self.running.lock().as_ref().map(|r| Arc::clone(&r.link))
    }

    /// The connection options of `s`, TLS included, or why they cannot be made.
    fn options(&self, s: &Settings) -> Result<rumqttc::MqttOptions, gst::ErrorMessage> {
        let (host, port) = route::parse_address(&s.address)
            .map_err(|e| gst::error_msg!(gst::ResourceError::Settings, ("address: {}", e)))?;
        let client_id =
            if s.client_id.is_empty() { default_client_id(&self.obj().name()) } else { s.client_id.clone() };
        let mut options = rumqttc::MqttOptions::new(client_id, host, port);
        options
            .set_clean_session(true)
            .set_keep_alive(Duration::from_secs(KEEP_ALIVE_S))
            .set_max_packet_size(64 * 1024, MAX_PAYLOAD + 70 * 1024);
        if !s.username.is_empty() {
            options.set_credentials(s.username.clone(), s.password.clone());
        } else if !s.password.is_empty() {
            return Err(gst::error_msg!(gst::ResourceError::Settings, ("password is set without a username")));
        }
        if s.tls {
            let config = tls_config(&s.ca_file)?;
            options.set_transport(rumqttc::Transport::tls_with_config(rumqttc::TlsConfiguration::Rustls(Arc::new(
                config,
            ))));
        } else if !s.ca_file.is_empty() {
            gst::warning!(CAT, imp = self, "ca-file is set but tls is false: connecting without TLS");
        }
        Ok(options)
    }

    /// EOS: wait for the buffer to empty, at most `flush-timeout`.
    fn flush_on_eos(&self) {
        let Some(link) = self.link() else { return };
        let timeout = Duration::from_nanos(self.settings.lock().flush_timeout);
        if let Some(left) = link.wait_empty(timeout).filter(|left| *left > 0) {
            *self.undelivered_said.lock() = true;
            gst::element_imp_warning!(
                self,
                gst::ResourceError::Write,
                ("{} messages not delivered to the MQTT broker at {} at EOS", left, link.address()),
                ["flush-timeout ({:?}) passed; they are dropped when the element stops", timeout]
            );
        }
    }
}

/// A rustls client configuration (the ring provider) trusting `ca_file`'s PEM certificates, or
/// the system's roots when it is empty.
fn tls_config(ca_file: &str) -> Result<rustls::ClientConfig, gst::ErrorMessage> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    if ca_file.is_empty() {
        let found = rustls_native_certs::load_native_certs();
        roots.add_parsable_certificates(found.certs);
        if roots.is_empty() {
            return Err(gst::error_msg!(
                gst::ResourceError::Settings,
                ("tls: no CA certificates found in the system's store: set ca-file")
            ));
        }
    } else {
        let certs = CertificateDer::pem_file_iter(ca_file)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| gst::error_msg!(gst::ResourceError::OpenRead, ("ca-file {}: {}", ca_file, e)))?;
        roots.add_parsable_certificates(certs);
        if roots.is_empty() {
            return Err(gst::error_msg!(
                gst::ResourceError::OpenRead,
                ("ca-file {}: no PEM certificate in it", ca_file)
            ));
        }
    }
    // ring (not rustls' default aws-lc-rs, a much longer build): classic key exchange (X25519,
    // ECDHE), which is what MQTT brokers offer; rustls deprecates it for lacking post-quantum
    // key exchange, which needs aws-lc-rs.
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| gst::error_msg!(gst::ResourceError::Settings, ("tls: {}", e)))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

#[glib::object_subclass]
impl ObjectSubclass for VlmPublish {
    const NAME: &'static str = "GstVlmPublish";
    type Type = super::VlmPublish;
    type ParentType = gst_base::BaseSink;
}

impl ObjectImpl for VlmPublish {
    fn constructed(&self) {
        self.parent_constructed();
        // Answers go out as they come, not at their running time (as filesink).
        self.obj().set_sync(false);
    }

    fn properties() -> &'static [glib::ParamSpec] {
        static PROPS: LazyLock<Vec<glib::ParamSpec>> = LazyLock::new(|| {
            let count = |name: &str, nick: &str, blurb: &str| {
                glib::ParamSpecUInt64::builder(name).nick(nick).blurb(blurb).read_only().build()
            };
            vec![
                glib::ParamSpecString::builder("address")
                    .nick("Address")
                    .blurb("The MQTT broker, host:port (IPv6: [address]:port); TLS with tls=true")
                    .default_value(Some(DEFAULT_ADDRESS))
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("topic")
                    .nick("Topic")
                    .blurb("Topic of each line: {stream} becomes the line's stream, {type} answer, alert or text (a line that is not a JSON object)")
                    .default_value(Some(DEFAULT_TOPIC))
                    .mutable_playing()
                    .build(),
                // (Not `qos`: that is BaseSink's boolean, QoS events upstream, left as it is.)
                glib::ParamSpecUInt::builder("mqtt-qos")
                    .nick("MQTT QoS")
                    .blurb("MQTT quality of service: 0 (at most once) or 1 (at least once: kept until the broker acknowledges, sent again after a reconnection)")
                    .maximum(1)
                    .default_value(DEFAULT_QOS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("client-id")
                    .nick("Client id")
                    .blurb("MQTT client identifier; empty: gst-vlm-<host>-<pid>-<element name>-<8 random hex digits>")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("username")
                    .nick("Username")
                    .blurb("User name for the broker; empty: none")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("password")
                    .nick("Password")
                    .blurb("Password for the broker (with username); write-only")
                    .write_only()
                    .mutable_ready()
                    .build(),
                glib::ParamSpecBoolean::builder("tls")
                    .nick("TLS")
                    .blurb("Connect with TLS (rustls), the broker's certificate checked against ca-file or the system's roots")
                    .default_value(false)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("ca-file")
                    .nick("CA file")
                    .blurb("PEM file of the certificate authorities trusted with tls=true; empty: the system's roots")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecBoolean::builder("retain")
                    .nick("Retain")
                    .blurb("Publish with the retain flag (the broker keeps each topic's last message for new subscribers)")
                    .default_value(false)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("max-buffered")
                    .nick("Max buffered")
                    .blurb("Messages kept until delivered (written at QoS 0, acknowledged at QoS 1); when full the oldest not yet sent is dropped")
                    .minimum(1)
                    .maximum(1_000_000)
                    .default_value(DEFAULT_MAX_BUFFERED)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder("flush-timeout")
                    .nick("Flush timeout")
                    .blurb("Most time (ns) EOS waits for the buffered messages to be delivered; 0 = no wait")
                    .maximum(gst::ClockTime::MAX.nseconds())
                    .default_value(DEFAULT_FLUSH_TIMEOUT)
                    .mutable_playing()
                    .build(),
                count("messages-published", "Messages published", "Messages delivered: written at QoS 0, acknowledged by the broker at QoS 1"),
                count("messages-dropped", "Messages dropped", "Messages given up: the buffer full, a line over 1 MiB, or still undelivered when the element stopped"),
                count("messages-buffered", "Messages buffered", "Messages waiting or in flight now"),
                glib::ParamSpecBoolean::builder("connected")
                    .nick("Connected")
                    .blurb("Whether the broker has accepted the connection (false while reconnecting)")
                    .read_only()
                    .build(),
            ]
        });
        PROPS.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        let name = pspec.name();
        if crate::refused_while_running(self.obj().upcast_ref(), pspec) {
            return;
        }
        // (The connection starts at NULL→READY, as `filesink` opens its file: from READY on, what
        // applies at start is refused too.)
        if pspec.flags().contains(gst::PARAM_FLAG_MUTABLE_READY) && self.running.lock().is_some() {
            self.refuse(format!(
                "{name} cannot change while the element runs (from READY on): it applies when it starts"
            ));
            return;
        }
        let string = || value.get::<Option<String>>().unwrap().unwrap_or_default();
        let mut s = self.settings.lock();
        match name {
            "address" => {
                let address = string();
                if let Err(e) = route::parse_address(&address) {
                    let keep = s.address.clone();
                    drop(s);
                    self.refuse(format!("invalid address: {e}; keeping {keep}"));
                    return;
                }
                s.address = address;
            }
            "topic" => {
                let topic = string();
                if let Err(e) = route::check_topic(&topic) {
                    let keep = s.topic.clone();
                    drop(s);
                    self.refuse(format!("invalid topic: {e}; keeping {keep}"));
                    return;
                }
                s.topic = topic;
            }
            "mqtt-qos" => s.qos = value.get().unwrap(),
            "client-id" => s.client_id = string(),
            "username" => s.username = string(),
            "password" => s.password = string(),
            "tls" => s.tls = value.get().unwrap(),
            "ca-file" => s.ca_file = string(),
            "retain" => s.retain = value.get().unwrap(),
            "max-buffered" => s.max_buffered = value.get().unwrap(),
            "flush-timeout" => s.flush_timeout = value.get().unwrap(),
            _ => unreachable!(),
        }
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        let st = &self.stats;
        match pspec.name() {
            "messages-published" => return st.published.load(Ordering::Relaxed).to_value(),
            "messages-dropped" => return st.dropped.load(Ordering::Relaxed).to_value(),
            "messages-buffered" => return st.buffered.load(Ordering::Relaxed).to_value(),
            "connected" => return st.connected.load(Ordering::Relaxed).to_value(),
            _ => {}
        }
        let s = self.settings.lock();
        match pspec.name() {
            "address" => s.address.to_value(),
            "topic" => s.topic.to_value(),
            "mqtt-qos" => s.qos.to_value(),
            "client-id" => s.client_id.to_value(),
            "username" => s.username.to_value(),
            "tls" => s.tls.to_value(),
            "ca-file" => s.ca_file.to_value(),
            "retain" => s.retain.to_value(),
            "max-buffered" => s.max_buffered.to_value(),
            "flush-timeout" => s.flush_timeout.to_value(),
            _ => unreachable!(),
        }
    }
}

impl GstObjectImpl for VlmPublish {}

impl ElementImpl for VlmPublish {
    fn metadata() -> Option<&'static gst::subclass::ElementMetadata> {
        static META: LazyLock<gst::subclass::ElementMetadata> = LazyLock::new(|| {
            gst::subclass::ElementMetadata::new(
                "VLM MQTT publisher",
                "Sink/Network",
                "Publishes each text line (vlmquery's JSON answers and alerts) as one MQTT message",
                "gst-vlm developers",
            )
        });
        Some(&*META)
    }

    fn pad_templates() -> &'static [gst::PadTemplate] {
        static TEMPLATES: LazyLock<Vec<gst::PadTemplate>> = LazyLock::new(|| {
            let caps = gst::Caps::builder("text/x-raw").field("format", "utf8").build();
            vec![gst::PadTemplate::new("sink", gst::PadDirection::Sink, gst::PadPresence::Always, &caps).unwrap()]
        });
        TEMPLATES.as_ref()
    }
}

impl BaseSinkImpl for VlmPublish {
    fn start(&self) -> Result<(), gst::ErrorMessage> {
        let s = self.settings.lock().clone();
        let options = self.options(&s)?;
        let qos = if s.qos == 0 { rumqttc::QoS::AtMostOnce } else { rumqttc::QoS::AtLeastOnce };
        self.stats.reset();
        *self.undelivered_said.lock() = false;
        for name in ["messages-published", "messages-dropped", "messages-buffered", "connected"] {
            self.obj().notify(name);
        }
        let running = link::Link::start(
            &self.obj(),
            options,
            s.address.clone(),
            qos,
            s.retain,
            s.max_buffered as usize,
            Arc::clone(&self.stats),
        )
        .map_err(|e| gst::error_msg!(gst::CoreError::Failed, ("{}", e)))?;
        gst::info!(CAT, imp = self, "publishing to {} (qos {}, topic {})", s.address, s.qos, s.topic);
        *self.running.lock() = Some(running);
        Ok(())
    }

    fn stop(&self) -> Result<(), gst::ErrorMessage> {
        let Some(running) = self.running.lock().take() else { return Ok(()) };
        let address = running.link.address().to_string();
        let left = running.stop();
        if left > 0 {
            self.obj().notify("messages-dropped");
            if !std::mem::take(&mut *self.undelivered_said.lock()) {
                gst::element_imp_warning!(
                    self,
                    gst::ResourceError::Write,
                    ("{} messages not delivered to the MQTT broker at {} when the element stopped", left, address),
                    ["counted in messages-dropped"]
                );
            }
        }
        self.obj().notify("messages-buffered");
        self.obj().notify("connected");
        Ok(())
    }

    fn render(&self, buffer: &gst::Buffer) -> Result<gst::FlowSuccess, gst::FlowError> {
        let Some(link) = self.link() else { return Err(gst::FlowError::Flushing) };
        let template = self.settings.lock().topic.clone();
        // The stream of a line that names none: the answer meta vlmquery puts on text buffers.
        let meta_stream =
            crate::meta::answer_of(buffer.as_ref()).and_then(|a| a.get::<String>("stream").ok()).unwrap_or_default();
        let map = buffer.map_readable().map_err(|_| {
            gst::element_imp_error!(self, gst::StreamError::Failed, ["cannot map a buffer"]);
            gst::FlowError::Error
        })?;
        for line in route::lines(map.as_slice()) {
            if line.len() > MAX_PAYLOAD {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                self.obj().notify("messages-dropped");
                gst::element_imp_warning!(
                    self,
                    gst::StreamError::Format,
                    ("A line of {} bytes is over the {} bytes published: dropped", line.len(), MAX_PAYLOAD)
                );
                continue;
            }
            let (kind, stream) = route::classify(line);
            let topic = route::topic_for(&template, stream.as_deref().unwrap_or(&meta_stream), kind);
            if topic.len() > route::MAX_TOPIC {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                self.obj().notify("messages-dropped");
                gst::element_imp_warning!(
                    self,
                    gst::StreamError::Format,
                    ("A line's topic of {} bytes is over MQTT's {} bytes: dropped", topic.len(), route::MAX_TOPIC)
                );
                continue;
            }
            gst::trace!(CAT, imp = self, "{} bytes to {topic}", line.len());
            link.push(topic, line.to_vec());
        }
        Ok(gst::FlowSuccess::Ok)
    }

    fn event(&self, event: gst::Event) -> bool {
        if let gst::EventView::Eos(_) = event.view() {
            self.flush_on_eos();
        }
        self.parent_event(event)
    }

    fn unlock(&self) -> Result<(), gst::ErrorMessage> {
        if let Some(link) = self.link() {
            link.set_unlocked(true);
        }
        Ok(())
    }

    fn unlock_stop(&self) -> Result<(), gst::ErrorMessage> {
        if let Some(link) = self.link() {
            link.set_unlocked(false);
        }
        Ok(())
    }
}

/// The client id when none is set: unique per connection, so that two clients never take each
/// other's session (a broker drops the older connection of an id): camera boxes whose pipelines
/// run as their containers' first process (pid 1), two pipelines of one process with a
/// `vlmpublish` of the same name.
fn default_client_id(element: &str) -> String {
    format!("gst-vlm-{}-{}-{element}-{:08x}", glib::host_name(), std::process::id(), glib::random_int())
}

#[cfg(test)]
mod client_id_tests {
    #[test]
    fn default_client_ids_differ_between_elements_of_one_name() {
        let (a, b) = (super::default_client_id("pub"), super::default_client_id("pub"));
        assert!(a.starts_with("gst-vlm-") && a.contains("-pub-"), "{a}");
        assert_ne!(a, b);
    }
}
