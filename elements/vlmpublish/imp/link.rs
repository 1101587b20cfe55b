//! The link to the broker: a bounded buffer of messages that `render` fills without waiting, and
//! a thread that owns the MQTT connection (rumqttc's event loop on a one-thread tokio runtime),
//! connects, reconnects with backoff and publishes from the buffer.
//!
//! Every message stays in the buffer until it is done: written to the connection at QoS 0,
//! acknowledged (PUBACK) at QoS 1. Messages move from `waiting` to `unwritten` when handed to
//! the client (at most `window` handed at once, only while connected), to `inflight` when the
//! event loop writes them (its `Outgoing::Publish` events come in the order they were handed,
//! which gives each its packet id), and leave at their PUBACK. When the connection is lost,
//! everything handed and not done goes back to the front of `waiting`, in order, and the client's
//! own copies are dropped: after reconnecting (a clean session) they are published again, so at
//! QoS 1 nothing in the buffer is lost, whether or not the broker kept a session.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gst::glib;
use gst::prelude::*;
use parking_lot::{Condvar, Mutex};
use rumqttc::{AsyncClient, ConnectReturnCode, ConnectionError, Event, EventLoop, Incoming, Outgoing, QoS};

use super::CAT;

/// First wait before reconnecting; doubled after each failure up to `RETRY_MAX`.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);
/// Most messages handed to the client at once (its request channel and in-flight window).
const WINDOW: usize = 100;
/// How long `stop` waits for the thread (a goodbye to the broker included) before leaving it.
const JOIN_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a stopping thread writes what the client holds and its DISCONNECT.
const GOODBYE_TIMEOUT: Duration = Duration::from_millis(500);
/// A connection that delivered a message, or lasted this long, was healthy: the next loss starts
/// the backoff again and is warned about. (One that the broker drops at once, as over a message
/// it refuses, is not: it is retried with a growing backoff and said once.)
const HEALTHY_AFTER: Duration = Duration::from_secs(10);
/// A message awaiting its acknowledgement when the connection was lost this many times is
/// dropped (counted, with a WARNING): a broker that drops the client over one message (its size,
/// its topic, a policy) would otherwise get it first after every reconnect, and nothing after it.
const MAX_LOSSES: u8 = 3;

/// One line to publish.
pub(super) struct Message {
    seq: u64,
    topic: String,
    payload: Vec<u8>,
    /// Lost connections while it awaited its acknowledgement.
    losses: u8,
}

/// The statistics (read-only properties): atomics, so reading them takes no lock; they outlive
/// a run (read after stopping) and start again at zero when the element starts.
#[derive(Default)]
pub(super) struct Stats {
    pub(super) published: AtomicU64,
    pub(super) dropped: AtomicU64,
    pub(super) buffered: AtomicU64,
    pub(super) connected: AtomicBool,
}

impl Stats {
    pub(super) fn reset(&self) {
        self.published.store(0, Ordering::Relaxed);
        self.dropped.store(0, Ordering::Relaxed);
        self.buffered.store(0, Ordering::Relaxed);
        self.connected.store(false, Ordering::Relaxed);
    }
}

#[derive(Default)]
struct Buffer {
    waiting: VecDeque<Message>,
    /// Handed to the client, not yet written, in order.
    unwritten: VecDeque<Message>,
    /// QoS 1, written, awaiting their PUBACK, by packet id.
    inflight: HashMap<u16, Message>,
    connected: bool,
    next_seq: u64,
    /// A warning about dropped messages was posted and the buffer has not emptied since.
    overflowing: bool,
    /// The base class's `unlock`: the EOS wait gives up.
    unlocked: bool,
    /// The element is stopping: nothing more is handed to the client.
    closing: bool,
}

impl Buffer {
    fn len(&self) -> usize {
        self.waiting.len() + self.unwritten.len() + self.inflight.len()
    }
}

/// A change that needs telling once the lock is released.
#[derive(Default)]
struct Changes {
    published: bool,
    dropped: bool,
    buffered: bool,
    connected: bool,
    warnings: Vec<(String, String)>,
}

pub(super) struct Link {
    buffer: Mutex<Buffer>,
    changed: Condvar,
    client: AsyncClient,
    qos: QoS,
    retain: bool,
    max: usize,
    window: usize,
    address: String,
    stats: Arc<Stats>,
    element: glib::WeakRef<crate::vlmpublish::VlmPublish>,
    stop: tokio::sync::Notify,
}

/// The running link: the thread and the way to end it.
pub(super) struct Running {
    pub(super) link: Arc<Link>,
    thread: std::thread::JoinHandle<()>,
    done: std::sync::mpsc::Receiver<()>,
}

impl Link {
    /// Start the thread that connects to `options`' broker (`address`, for messages).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start(
        element: &crate::vlmpublish::VlmPublish,
        mut options: rumqttc::MqttOptions,
        address: String,
        qos: QoS,
        retain: bool,
        max: usize,
        stats: Arc<Stats>,
    ) -> Result<Running, String> {
        let window = max.min(WINDOW);
        options.set_inflight(window as u16).set_request_channel_capacity(window);
        let (client, eventloop) = AsyncClient::new(options, window);
        let link = Arc::new(Link {
            buffer: Mutex::new(Buffer::default()),
            changed: Condvar::new(),
            client,
            qos,
            retain,
            max,
            window,
            address,
            stats,
            element: element.downgrade(),
            stop: tokio::sync::Notify::new(),
        });
        let (done_tx, done) = std::sync::mpsc::channel();
        let l = Arc::clone(&link);
        let thread = std::thread::Builder::new()
            .name("vlmpublish-mqtt".into())
            .spawn(move || {
                l.run(eventloop);
                let _ = done_tx.send(());
            })
            .map_err(|e| format!("cannot start the MQTT thread: {e}"))?;
        Ok(Running { link, thread, done })
    }

    /// Buffer a message (never waits): when the buffer is full, the oldest message not yet handed
    /// to the connection is dropped, or this one when every buffered message is in flight.
    pub(super) fn push(&self, topic: String, payload: Vec<u8>) {
        let mut c = Changes { buffered: true, ..Changes::default() };
        {
            let mut b = self.buffer.lock();
            let message = Message { seq: b.next_seq, topic, payload, losses: 0 };
            b.next_seq += 1;
            let mut keep = true;
            if b.len() >= self.max {
                if b.waiting.pop_front().is_none() {
                    keep = false;
                }
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                c.dropped = true;
                if !b.overflowing {
                    b.overflowing = true;
                    c.warnings.push((
                        format!("The MQTT buffer is full ({} messages): dropping the oldest", self.max),
                        format!(
                            "the broker at {} is {}; messages-dropped counts them (raise max-buffered to keep more)",
                            self.address,
                            if b.connected { "slower than the messages" } else { "not connected" }
                        ),
                    ));
                }
            }
            if keep {
                b.waiting.push_back(message);
            }
            self.hand_over(&mut b);
            self.stats.buffered.store(b.len() as u64, Ordering::Relaxed);
        }
        self.tell(c);
    }

    /// Hand waiting messages to the client while connected and the window has room.
    fn hand_over(&self, b: &mut Buffer) {
        while b.connected && !b.closing && b.unwritten.len() + b.inflight.len() < self.window {
            let Some(m) = b.waiting.pop_front() else { break };
            match self.client.try_publish(m.topic.clone(), self.qos, self.retain, m.payload.clone()) {
                Ok(()) => b.unwritten.push_back(m),
                Err(e) => {
                    // The request channel holds at most `window`, so this is not expected.
                    gst::warning!(CAT, "cannot hand message {} to the MQTT client: {e}", m.seq);
                    b.waiting.push_front(m);
                    break;
                }
            }
        }
    }

    /// A message done (written at QoS 0, acknowledged at QoS 1).
    fn done(&self, b: &mut Buffer, c: &mut Changes) {
        self.stats.published.fetch_add(1, Ordering::Relaxed);
        c.published = true;
        c.buffered = true;
        if b.len() == 0 {
            b.overflowing = false;
            self.changed.notify_all();
        }
    }

    /// Account for an event of the event loop: a publish written (its packet id) or
    /// acknowledged. `stale`: an event left queued when the connection failed, whose write may
    /// not have happened (a QoS 0 message is then sent again rather than counted).
    fn apply(&self, b: &mut Buffer, c: &mut Changes, event: &Event, stale: bool) {
        match *event {
            Event::Outgoing(Outgoing::Publish(pkid)) => {
                if self.qos == QoS::AtMostOnce {
                    if !stale && b.unwritten.pop_front().is_some() {
                        self.done(b, c);
                    }
                } else if let Some(m) = b.unwritten.pop_front()
                    && let Some(old) = b.inflight.insert(pkid, m)
                {
                    gst::warning!(CAT, "packet id {pkid} reused before its PUBACK (message {})", old.seq);
                }
            }
            Event::Incoming(Incoming::PubAck(ref ack)) => {
                let acked = b.inflight.remove(&ack.pkid);
                if acked.is_some() {
                    self.done(b, c);
                }
            }
            _ => {}
        }
    }

    /// Returns whether a message was done (the connection delivers).
    fn on_event(&self, event: Event) -> bool {
        let mut c = Changes::default();
        {
            let mut b = self.buffer.lock();
            if let Event::Incoming(Incoming::ConnAck(_)) = event {
                gst::info!(CAT, "connected to the MQTT broker at {} ({} messages buffered)", self.address, b.len());
                b.connected = true;
                self.stats.connected.store(true, Ordering::Relaxed);
                c.connected = true;
            } else {
                self.apply(&mut b, &mut c, &event, false);
            }
            self.hand_over(&mut b);
            self.stats.buffered.store(b.len() as u64, Ordering::Relaxed);
        }
        let delivered = c.published;
        self.tell(c);
        delivered
    }

    /// The connection failed or was lost: what was handed and not done goes back, in order, and
    /// the client's copies are dropped (they are published again after reconnecting).
    fn on_error(&self, eventloop: &mut EventLoop, error: &ConnectionError, first: bool, fatal: bool) {
        let mut c = Changes::default();
        {
            let mut b = self.buffer.lock();
            let was_connected = b.connected;
            b.connected = false;
            // Events the failure left queued (PUBACKs read with it count), then nothing of this
            // connection is kept by the client: its requests, its pending and collided publishes.
            for event in std::mem::take(&mut eventloop.state.events) {
                self.apply(&mut b, &mut c, &event, true);
            }
            eventloop.clean();
            eventloop.pending.clear();
            eventloop.state.collision = None;
            let b = &mut *b;
            let mut back: Vec<Message> = b.unwritten.drain(..).collect();
            for (_, mut m) in b.inflight.drain() {
                m.losses += 1;
                if m.losses < MAX_LOSSES {
                    back.push(m);
                    continue;
                }
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                c.dropped = true;
                c.warnings.push((
                    format!(
                        "A message to topic {} ({} bytes) was dropped: the connection to the MQTT broker at {} was lost {MAX_LOSSES} times while it awaited its acknowledgement",
                        m.topic,
                        m.payload.len(),
                        self.address
                    ),
                    "the broker may refuse it (its size, its topic, an access policy); counted in messages-dropped".into(),
                ));
            }
            back.sort_by_key(|m| m.seq);
            for m in back.into_iter().rev() {
                b.waiting.push_front(m);
            }
            if was_connected {
                self.stats.connected.store(false, Ordering::Relaxed);
                c.connected = true;
            }
            let buffered = b.len();
            gst::info!(CAT, "MQTT broker at {}: {error} ({buffered} messages buffered)", self.address);
            if fatal {
                c.warnings.push((
                    format!("The MQTT broker at {} refused the connection: {error}", self.address),
                    "check client-id, username and password; not retrying".into(),
                ));
            } else if first {
                c.warnings.push(if was_connected {
                    (
                        format!("Lost the connection to the MQTT broker at {}: {error}", self.address),
                        format!("reconnecting; {buffered} messages buffered (up to max-buffered)"),
                    )
                } else {
                    (
                        format!("Cannot connect to the MQTT broker at {}: {error}", self.address),
                        format!(
                            "retrying (every {} s at most); messages are buffered up to max-buffered",
                            RETRY_MAX.as_secs()
                        ),
                    )
                });
            }
        }
        if fatal {
            // A broker that refuses the credentials will not take them later: an error.
            if let (Some(element), Some((message, debug))) = (self.element.upgrade(), c.warnings.pop()) {
                gst::element_error!(element, gst::ResourceError::NotAuthorized, ("{}", message), ["{}", debug]);
            }
        }
        self.tell(c);
    }

    /// Notify the changed statistics and post the warning, with no lock held.
    fn tell(&self, c: Changes) {
        let Some(element) = self.element.upgrade() else { return };
        for (message, debug) in c.warnings {
            gst::element_warning!(element, gst::ResourceError::Write, ("{}", message), ["{}", debug]);
        }
        for (changed, name) in [
            (c.published, "messages-published"),
            (c.dropped, "messages-dropped"),
            (c.buffered, "messages-buffered"),
            (c.connected, "connected"),
        ] {
            if changed {
                element.notify(name);
            }
        }
    }

    /// The thread: drive the event loop until `stop`, reconnecting with backoff.
    fn run(&self, mut eventloop: EventLoop) {
        let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                if let Some(element) = self.element.upgrade() {
                    gst::element_error!(element, gst::CoreError::Failed, ("Cannot start the MQTT runtime: {}", e));
                }
                return;
            }
        };
        rt.block_on(self.drive(&mut eventloop));
        rt.shutdown_timeout(Duration::from_millis(200));
    }

    async fn drive(&self, eventloop: &mut EventLoop) {
        let mut backoff = RETRY_MIN;
        let mut failing = false;
        // Since when connected, and whether the connection delivered a message.
        let (mut connected_at, mut delivered) = (None::<Instant>, false);
        loop {
            let event = tokio::select! {
                biased;
                _ = self.stop.notified() => break,
                event = eventloop.poll() => event,
            };
            match event {
                Ok(event) => {
                    if matches!(event, Event::Incoming(Incoming::ConnAck(_))) {
                        (connected_at, delivered) = (Some(Instant::now()), false);
                    }
                    delivered |= self.on_event(event);
                }
                Err(e) => {
                    if delivered || connected_at.is_some_and(|t| t.elapsed() >= HEALTHY_AFTER) {
                        backoff = RETRY_MIN;
                        failing = false;
                    }
                    (connected_at, delivered) = (None, false);
                    let fatal = matches!(&e, ConnectionError::ConnectionRefused(code) if *code != ConnectReturnCode::ServiceUnavailable);
                    self.on_error(eventloop, &e, !failing, fatal);
                    failing = true;
                    if fatal {
                        self.stop.notified().await;
                        return;
                    }
                    tokio::select! {
                        biased;
                        _ = self.stop.notified() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(RETRY_MAX);
                }
            }
        }
        // Stopping while connected: write what the client holds and the DISCONNECT `stop` asked
        // for (a goodbye, so the broker does not wait for a keep-alive), for a bounded time.
        if self.buffer.lock().connected {
            let goodbye = async {
                loop {
                    match eventloop.poll().await {
                        Ok(Event::Outgoing(Outgoing::Disconnect)) | Err(_) => break,
                        Ok(event) => {
                            self.on_event(event);
                        }
                    }
                }
            };
            let _ = tokio::time::timeout(GOODBYE_TIMEOUT, goodbye).await;
        }
    }

    /// Wait until every buffered message is done, or `timeout` passed: how many are left; `None`
    /// when the base class unlocked the wait first (a flush, a pause, a stop: they go on being
    /// delivered, or the stop counts them).
    pub(super) fn wait_empty(&self, timeout: Duration) -> Option<usize> {
        let deadline = Instant::now() + timeout;
        let mut b = self.buffer.lock();
        while b.len() > 0 && !b.unlocked && Instant::now() < deadline {
            self.changed.wait_until(&mut b, deadline);
        }
        (!b.unlocked || b.len() == 0).then_some(b.len())
    }

    pub(super) fn set_unlocked(&self, unlocked: bool) {
        self.buffer.lock().unlocked = unlocked;
        self.changed.notify_all();
    }

    pub(super) fn address(&self) -> &str {
        &self.address
    }
}

impl Running {
    /// End the thread (it says goodbye to a connected broker), waiting for it at most
    /// `JOIN_TIMEOUT`: how many messages were left undelivered.
    pub(super) fn stop(self) -> usize {
        let link = self.link;
        let connected = {
            let mut b = link.buffer.lock();
            b.unlocked = true;
            b.closing = true;
            b.connected
        };
        link.changed.notify_all();
        if connected {
            // The goodbye: a DISCONNECT request, written by the event loop before it ends.
            let _ = link.client.try_disconnect();
        }
        link.stop.notify_one();
        // (Not waited for from the thread itself: an application's sync bus handler on a
        // message it posted, stopping the pipeline. It ends when the handler returns.)
        let own = self.thread.thread().id() == std::thread::current().id();
        match self.done.recv_timeout(if own { Duration::ZERO } else { JOIN_TIMEOUT }) {
            Ok(()) => {
                let _ = self.thread.join();
            }
            Err(_) if own => (),
            Err(_) => gst::warning!(CAT, "the MQTT thread did not end within {JOIN_TIMEOUT:?}: left to end on its own"),
        }
        let mut b = link.buffer.lock();
        let left = b.len();
        *b = Buffer::default();
        link.stats.buffered.store(0, Ordering::Relaxed);
        link.stats.connected.store(false, Ordering::Relaxed);
        if left > 0 {
            link.stats.dropped.fetch_add(left as u64, Ordering::Relaxed);
        }
        left
    }
}
