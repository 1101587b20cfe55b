//! The harness of the bad-input tests: a bounded wait for anything that could hang, the bus
//! log each case asserts on, pictures and caps, a probe counting registered frames, and an
//! appsrc-fed pipeline through the three elements.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gst::prelude::*;
use gst_video::VideoFormat;
use gst_vlm_elements::meta::VlmFrameMeta;

use crate::common::launch;

/// One test at a time: the cases measure nothing, but on a 2-core machine parallel model loads
/// and answers make every bound below needlessly loose.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Run `f` on another thread; fail if it does not return within `within`.
pub fn within<T: Send + 'static>(within: Duration, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(within).unwrap_or_else(|_| panic!("{what} did not return within {within:?}"))
}

pub fn set_state(pipeline: &gst::Element, state: gst::State, what: &str) {
    let p = pipeline.clone();
    let _ = within(Duration::from_secs(30), &format!("{what}: the change to {state:?}"), move || p.set_state(state));
}

/// What a pipeline's bus said, gathered as the test goes.
#[derive(Default, Debug)]
pub struct Log {
    pub answers: Vec<gst::Structure>,
    pub warnings: Vec<String>,
    /// "source: message (debug)".
    pub errors: Vec<String>,
    pub eos: bool,
}

impl Log {
    pub fn record(&mut self, msg: &gst::Message) {
        let src = msg.src().map(|s| s.name().to_string()).unwrap_or_default();
        match msg.view() {
            gst::MessageView::Error(e) => self.errors.push(format!("{src}: {} ({:?})", e.error(), e.debug())),
            gst::MessageView::Warning(w) => self.warnings.push(format!("{src}: {} ({:?})", w.error(), w.debug())),
            gst::MessageView::Eos(_) => self.eos = true,
            gst::MessageView::Element(e) => {
                if let Some(s) = e.structure().filter(|s| s.name() == "vlm-answer") {
                    // Ids are unique per element: keep which one answered.
                    let mut s = s.to_owned();
                    s.set("element", src);
                    self.answers.push(s);
                }
            }
            _ => (),
        }
    }

    /// Read `bus` until `done` holds (true) or `limit` has passed (false).
    pub fn pump(&mut self, bus: &gst::Bus, limit: Duration, done: impl Fn(&Log) -> bool) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if done(self) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            match bus.timed_pop(gst::ClockTime::from_nseconds(left.as_nanos() as u64)) {
                Some(msg) => self.record(&msg),
                None => return done(self),
            }
        }
    }

    pub fn answers_to(&self, id: &str) -> Vec<&gst::Structure> {
        self.answers.iter().filter(|a| a.get::<String>("id").ok().as_deref() == Some(id)).collect()
    }

    /// The answers of element `q` to question `id`.
    pub fn answers_of(&self, q: &gst::Element, id: &str) -> Vec<&gst::Structure> {
        let name = q.name();
        self.answers_to(id).into_iter().filter(|a| a.get::<String>("element").ok().as_deref() == Some(&*name)).collect()
    }
}

pub fn field<T: for<'a> gst::glib::value::FromValue<'a> + 'static>(a: &gst::Structure, name: &str) -> T {
    a.get::<T>(name).ok().unwrap_or_else(|| panic!("vlm-answer field {name} missing or mistyped: {a}"))
}

pub fn status(a: &gst::Structure) -> String {
    field::<String>(a, "status")
}

/// A picture of `format` at `width` x `height`, its bytes varied by `variant`.
pub fn picture(format: VideoFormat, width: u32, height: u32, variant: u64) -> gst::Buffer {
    let info = gst_video::VideoInfo::builder(format, width, height).build().unwrap();
    let data: Vec<u8> = (0..info.size()).map(|i| ((i as u64 * 31 + variant * 77) % 251) as u8).collect();
    gst::Buffer::from_mut_slice(data)
}

pub fn video_caps(format: VideoFormat, width: u32, height: u32) -> gst::Caps {
    gst_video::VideoInfo::builder(format, width, height)
        .fps(gst::Fraction::new(10, 1))
        .build()
        .unwrap()
        .to_caps()
        .unwrap()
}

/// The buffers that pass `pad`, counted as they come.
pub fn count_buffers(pad: &gst::Pad) -> Arc<AtomicU64> {
    let count = Arc::new(AtomicU64::new(0));
    let c2 = Arc::clone(&count);
    pad.add_probe(gst::PadProbeType::BUFFER, move |_, _| {
        c2.fetch_add(1, Ordering::AcqRel);
        gst::PadProbeReturn::Ok
    });
    count
}

/// The newest frame number seen registered on a pad (by a probe), and a way to wait for one.
/// (newest frame number, its stream id).
type Seen = Mutex<(u64, Option<u64>)>;

#[derive(Clone, Default)]
pub struct Frames(Arc<(Seen, Condvar)>);

impl Frames {
    /// Count the registered frames passing `pad` (and remember their stream id). On vlmquery's
    /// `sink` pad a frame is counted before vlmquery has seen it, on `video_src` after.
    pub fn watch(pad: &gst::Pad) -> Frames {
        let frames = Frames::default();
        let f = frames.clone();
        pad.add_probe(gst::PadProbeType::BUFFER, move |_, info| {
            if let Some((stream, number)) =
                info.buffer().and_then(|b| b.meta::<VlmFrameMeta>()).and_then(|m| m.position())
            {
                let mut seen = f.0.0.lock().unwrap();
                *seen = (seen.0.max(number), Some(stream));
                f.0.1.notify_all();
            }
            gst::PadProbeReturn::Ok
        });
        frames
    }

    pub fn newest(&self) -> u64 {
        self.0.0.lock().unwrap().0
    }

    pub fn stream(&self) -> Option<u64> {
        self.0.0.lock().unwrap().1
    }

    /// Wait (bounded) until frame `n` has passed.
    pub fn wait(&self, n: u64, what: &str) {
        let guard = self.0.0.lock().unwrap();
        let (seen, timeout) = self.0.1.wait_timeout_while(guard, Duration::from_secs(60), |s| s.0 < n).unwrap();
        assert!(!timeout.timed_out(), "{what}: frame {n} never reached vlmquery (newest {})", seen.0);
    }
}

/// An appsrc-fed pipeline: `appsrc ! vlmencode ! vlmcontext ! vlmquery ! fakesink`.
pub struct Fed {
    pub pipeline: gst::Element,
    pub src: gst_app::AppSrc,
    pub bin: gst::Bin,
    pub q: gst::Element,
    pub bus: gst::Bus,
    pub frames: Frames,
    pub log: Log,
}

impl Fed {
    /// `ctx` and `q` are extra properties of vlmcontext and vlmquery; `tail` more of the launch line.
    pub fn new(ctx: &str, q: &str, tail: &str) -> Fed {
        let pipeline = launch(&format!(
            "appsrc name=src format=time ! vlmencode name=enc mmproj=models/test-mmproj-mlp.gguf \
               model=models/SmolLM2-135M-Instruct.Q4_1.gguf interval=0 cache-entries=0 min-change=0 \
             ! vlmcontext name=ctx model=models/SmolLM2-135M-Instruct.Q4_1.gguf {ctx} \
             ! vlmquery name=q max-tokens=4 {q} ! fakesink sync=false async=false \
             q.video_src ! fakesink sync=false async=false {tail}"
        ));
        let bin = pipeline.clone().downcast::<gst::Bin>().unwrap();
        let src = bin.by_name("src").unwrap().downcast::<gst_app::AppSrc>().unwrap();
        src.set_caps(Some(&video_caps(VideoFormat::Rgb, 64, 48)));
        let q = bin.by_name("q").unwrap();
        // Counted where vlmquery passes them on: it has seen them then.
        let frames = Frames::watch(&q.static_pad("video_src").unwrap());
        let bus = pipeline.bus().unwrap();
        set_state(&pipeline, gst::State::Playing, "start");
        Fed { pipeline, src, bin, q, bus, frames, log: Log::default() }
    }

    /// [`Fed::new`] with an appsrc `questions` of UTF-8 text on vlmquery's `query` pad, and it.
    pub fn with_questions() -> (Fed, gst_app::AppSrc) {
        let f = Fed::new("", "", "appsrc name=questions format=time ! q.query");
        let questions = f.element("questions").downcast::<gst_app::AppSrc>().unwrap();
        questions.set_caps(Some(&gst::Caps::builder("text/x-raw").field("format", "utf8").build()));
        (f, questions)
    }

    pub fn element(&self, name: &str) -> gst::Element {
        self.bin.by_name(name).unwrap()
    }

    /// Push a frame of `format` at `w` x `h` (caps changed in order with the buffers when they
    /// differ), timestamped at `pts` or not at all.
    pub fn push(&self, format: VideoFormat, w: u32, h: u32, variant: u64, pts: Option<gst::ClockTime>) {
        let caps = video_caps(format, w, h);
        if self.src.caps().as_ref() != Some(&caps) {
            self.src.set_caps(Some(&caps));
        }
        let mut buffer = picture(format, w, h, variant);
        buffer.get_mut().unwrap().set_pts(pts);
        assert_eq!(self.src.push_buffer(buffer), Ok(gst::FlowSuccess::Ok));
    }

    pub fn push_frames(&self, n: u64) {
        let first = self.frames.newest();
        for i in 0..n {
            self.push(VideoFormat::Rgb, 64, 48, first + i, Some(gst::ClockTime::from_mseconds(100 * (first + i))));
        }
        self.frames.wait(first + n, "push_frames");
    }

    pub fn ask(&self, text: &str) -> Option<String> {
        self.q.emit_by_name::<Option<String>>("ask", &[&text])
    }

    /// The one `vlm-answer` of question `id` (waits for it, then checks no second one follows).
    pub fn answer(&mut self, id: &str, limit: Duration) -> gst::Structure {
        let bus = self.bus.clone();
        assert!(self.log.pump(&bus, limit, |l| !l.answers_to(id).is_empty()), "no vlm-answer for {id}: {:?}", self.log);
        self.log.pump(&bus, Duration::from_millis(200), |_| false);
        let answers = self.log.answers_to(id);
        assert_eq!(answers.len(), 1, "question {id} must end in exactly one vlm-answer: {answers:?}");
        answers[0].clone()
    }

    /// EOS from the appsrc: the pipeline must drain to EOS and stop.
    pub fn finish(mut self) -> Log {
        assert_eq!(self.src.end_of_stream(), Ok(gst::FlowSuccess::Ok));
        let bus = self.bus.clone();
        let eos = self.log.pump(&bus, Duration::from_secs(60), |l| l.eos || !l.errors.is_empty());
        set_state(&self.pipeline, gst::State::Null, "finish");
        assert!(eos, "no EOS: {:?}", self.log);
        std::mem::take(&mut self.log)
    }
}

impl Drop for Fed {
    /// Stop a pipeline a failed assertion left running (bounded: never panics while unwinding).
    fn drop(&mut self) {
        let (tx, rx) = std::sync::mpsc::channel();
        let p = self.pipeline.clone();
        std::thread::spawn(move || {
            let _ = tx.send(p.set_state(gst::State::Null));
        });
        let _ = rx.recv_timeout(Duration::from_secs(30));
    }
}

pub fn assert_clean(log: &Log) {
    assert!(log.errors.is_empty(), "{:?}", log.errors);
}
