#!/usr/bin/env python3
"""A minimal PyGObject application using gst-vlm: build a pipeline, ask with the `ask` signal and
with a `vlm-question` event, read every answer from the bus (`vlm-answer`), from an appsink on
the text pad (JSON) and from the video buffers leaving `video_src` (the `VlmAnswerMeta` custom
meta on the first frame after each answer).

    GST_PLUGIN_PATH=target/debug /usr/bin/python3 examples/ask.py [MODEL MMPROJ]

Run from the repository root (scripts/test.sh runs it); Debian's python3-gi and the GStreamer
typelibs are needed (scripts/setup.sh installs them). Exits 1 unless both questions are answered
and every answer found on a video buffer agrees with its `vlm-answer`.
"""
import os
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstApp", "1.0")
from gi.repository import GLib, Gst  # noqa: E402

model = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("VLM_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
mmproj = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("VLM_MMPROJ", "models/test-mmproj-mlp.gguf")

Gst.init(None)
pipeline = Gst.parse_launch(
    "videotestsrc pattern=ball num-buffers=60 ! video/x-raw,width=160,height=120,framerate=30/1 "
    f"! videoconvert ! vlmencode mmproj={mmproj} interval=250000000 "
    f"! vlmcontext name=ctx model={model} ! vlmquery name=q max-tokens=8 output-format=json "
    "! appsink name=answers sync=false emit-signals=true "
    "q.video_src ! appsink name=video sync=false emit-signals=true"
)
query = pipeline.get_by_name("q")
asked = []


def on_frame(pad, info):
    """Ask once the video leaving vlmcontext passes 0.5 s (with the `ask` signal: bound to the
    newest frame) and 1 s (with a `vlm-question` event in the stream: bound to the frames before
    it), then remove the probe."""
    pts = info.get_buffer().pts
    if not asked and pts >= Gst.SECOND // 2:
        asked.append(query.emit("ask", "What is moving in the video?"))
    elif len(asked) == 1 and pts >= Gst.SECOND:
        event = Gst.Event.new_custom(
            Gst.EventType.CUSTOM_DOWNSTREAM,
            Gst.Structure.new_from_string('vlm-question, text="Describe the colours.", id=colours, max-tokens=6'),
        )
        query.get_static_pad("sink").send_event(event)
        asked.append("colours")
        return Gst.PadProbeReturn.REMOVE
    return Gst.PadProbeReturn.OK


pipeline.get_by_name("ctx").get_static_pad("src_0").add_probe(Gst.PadProbeType.BUFFER, on_frame)

answered = {}
lines = []
loop = GLib.MainLoop()


def on_sample(appsink):
    """One answer buffer: a line of JSON with the vlm-answer fields (output-format=json)."""
    buf = appsink.emit("pull-sample").get_buffer()
    lines.append(buf.extract_dup(0, buf.get_size()).decode())
    return Gst.FlowReturn.OK


pipeline.get_by_name("answers").connect("new-sample", on_sample)

on_video = {}


def on_frame_out(appsink):
    """A video buffer leaving vlmquery: the answer it carries, if any (`VlmAnswerMeta`)."""
    buf = appsink.emit("pull-sample").get_buffer()
    meta = buf.get_custom_meta("VlmAnswerMeta")
    if meta:
        s = meta.get_structure()
        on_video[s.get_string("id")] = (s.get_string("status"), s.get_string("text"))
        print(f"[video] frame at {buf.pts / Gst.SECOND:.2f} s: {s.get_string('id')} {s.get_string('text')!r}")
    return Gst.FlowReturn.OK


pipeline.get_by_name("video").connect("new-sample", on_frame_out)


def on_message(bus, msg):
    if msg.type == Gst.MessageType.ERROR:
        print("error:", msg.parse_error()[0].message, file=sys.stderr)
        loop.quit()
    elif msg.type == Gst.MessageType.EOS:
        loop.quit()
    elif msg.type == Gst.MessageType.ELEMENT and msg.get_structure().get_name() == "vlm-answer":
        s = msg.get_structure()
        answered[s.get_string("id")] = (s.get_string("status"), s.get_string("text"))
        print(f"[bus] {s.get_string('id')}: {s.get_string('text')!r} ({s.get_string('status')})")


bus = pipeline.get_bus()
bus.add_signal_watch()
bus.connect("message", on_message)
GLib.timeout_add_seconds(120, loop.quit)
pipeline.set_state(Gst.State.PLAYING)
loop.run()
pipeline.set_state(Gst.State.NULL)
print(f"[appsink] {len(lines)} JSON lines: {''.join(lines).strip()}")
# (An answer that completes after the last frame has no video buffer to ride on.)
agree = all(answered.get(i) == v for i, v in on_video.items())
ok = asked and all(a in answered for a in asked) and len(lines) == len(asked) and agree
sys.exit(0 if ok else 1)
