#!/usr/bin/env python3
"""Filter `gst-launch-1.0 -m` output: print each vlm-answer message as one readable line, and
errors and warnings as they come; exit non-zero when the pipeline reported an error."""
import re
import sys

FIELD = re.compile(r'([a-z-]+)=\((\w+)\)("(?:[^"\\]|\\.)*"|[^,;]+)')
failed = False
answers = 0
for line in sys.stdin:
    if "vlm-answer" in line:
        f = {k: re.sub(r'\\(.)', r'\1', v.strip('"')) for k, _, v in FIELD.findall(line)}
        answers += 1
        print(f"[{f.get('id')}] Q: {f.get('question')}")
        print(f"     A: {f.get('text')}")
        print(f"     frames={f.get('frames')} engine={f.get('engine')} path={f.get('path')} "
              f"wait={float(f.get('wait-ms', 0)):.0f} ms ttft={float(f.get('ttft-ms', 0)):.0f} ms "
              f"tokens={f.get('tokens')} total={float(f.get('total-ms', 0)):.0f} ms", flush=True)
    elif line.startswith(("ERROR", "WARNING")) or "Additional debug info" in line:
        failed |= line.startswith("ERROR")
        print(line.rstrip(), flush=True)
    elif line.startswith(("Got EOS", "Execution ended")):
        print(line.rstrip(), flush=True)
print(f"{answers} answers")
sys.exit(1 if failed else 0)
