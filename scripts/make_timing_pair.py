#!/usr/bin/env python3
"""Write a TIMING-ONLY vision-language pair: a language model and its projector (mmproj) in the exact
shapes of a published VLM, with the model's real tokenizer specials, chat template and libmtmd
tiling, and random weights. Answers are meaningless; encode, prefill and decode cost what the real
model's would. Made on demand (the benchmark, the GPU machine), never committed, never in CI.

    python scripts/make_timing_pair.py NAME [--out-dir models/timing] [--smollm2 models/SmolLM2-135M-Instruct.Q4_1.gguf]
                                            [--longest-edge 2048] [--mmproj-type f16|q8_0] [--seed N]

writes OUT_DIR/NAME-lm.gguf and OUT_DIR/NAME-mmproj.gguf; the same arguments write the same bytes.
Language models Q8_0 (norms F32), as ggml-org's published SmolVLM GGUFs (their Qwen2-VL-2B is Q4_K_M,
which gguf-py cannot write); projectors F16 matmul weights, F32 norms, biases and position
embeddings (scripts/make_test_mmproj.py --type f16), or with --mmproj-type q8_0 Q8_0 matmul weights,
as the projectors docs/models.md lists. File sizes then match ggml-org's files to within their
metadata (a few KB): SmolVLM-256M 175,053,504 / 103,768,800 B here against 175,054,528 /
103,769,856 B published; SmolVLM-500M 436,805,888 / 108,782,304 B against 436,806,912 /
108,783,360 B; Qwen2-VL-2B's projector 709,883,072 B against 709,883,360 B.

  smolvlm-256m  HuggingFaceTB/SmolVLM-256M-Instruct. Vision: SigLIP base (`idefics3` projector): 512 px
                tiles, patch 16, width 768, 12 layers, 12 heads, FFN 3072; pixel shuffle 4, then
                mm.model.fc 768*16 -> 576: 64 tokens a tile. Language: SmolLM2-135M's shape (llama,
                hidden 576, 30 layers, 9 heads, 3 KV heads, FFN 1536, RoPE theta 100000, context
                8192) with SmolVLM's vocabulary (SmolLM2's 49152 tokens + SmolVLM's 128 added ones:
                <global-img>, <row_R_col_C>, <fake_token_around_image>, <image>, <end_of_utterance>;
                49280, built by make_test_family.smolvlm_vocab from --smollm2's tokenizer) and chat
                template. The head is untied (output.weight), as in the checkpoint: its parameter
                count includes lm_head (49280 x 576), unlike SmolLM2-135M's tied one.
  smolvlm-500m  HuggingFaceTB/SmolVLM-500M-Instruct: the same vision, projector 768*16 -> 960, and
                SmolLM2-360M's shape (hidden 960, 32 layers, 15 heads, 5 KV heads, FFN 2560),
                SmolVLM's vocabulary, untied head.
  qwen2vl-2b    Qwen/Qwen2-VL-2B-Instruct. Vision (`qwen2vl_merger`): patch 14 (two kernels: the
                temporal pair), width 1280, 32 layers, 16 heads, FFN 5120, 2-D M-RoPE, 2x2 merge,
                merger MLP 5120 -> 5120 -> 1536; a frame is (w/28) x (h/28) tokens after libmtmd's
                resize. Language: Qwen2-1.5B's shape, architecture qwen2vl (hidden 1536, 28 layers,
                12 heads, 2 KV heads, FFN 8960, q/k/v biases, tied embeddings, M-RoPE sections
                [16, 24, 24, 0], theta 1e6, context 32768), vocabulary 151936: make_test_family's
                small byte-level BPE with Qwen2-VL's specials and ChatML template, padded with
                [PADn] tokens (type UNUSED, as llama.cpp's converter pads Qwen's vocabulary), trained
                with "Yes" and "No" as single tokens as in Qwen's (an alert's forced choice). Prompts
                tokenize into more, shorter tokens than with Qwen's real 151643 merges. For the GPU
                machine: on 2 CPU cores it loads but runs slowly.

SmolVLM tiling (libmtmd's idefics3 preprocessor, llama.cpp tools/mtmd/mtmd-image.cpp): a frame is
resized to clip.vision.preproc_image_size on its longest edge, cut into ceil(w/512) x ceil(h/512)
tiles of 512 px, plus a 512 px overview, each tile 64 tokens with <fake_token_around_image>
<row_R_col_C> text before it. llama.cpp's converter writes the checkpoint's
preprocessor_config.json size.longest_edge there, 2048 for both SmolVLM-256M and -500M (tiles are
max_image_size 512), which is this script's default; --longest-edge overrides it. Image tokens of
a 320x240 (4:3) frame: 2048 -> 4x3 tiles + overview = 13 x 64 = 832; 1536 -> 3x3 + 1 = 640;
1024 -> 2x2 + 1 = 320; 512 -> 1x1 + 1 = 128 (each plus the text markers around the tiles).

Parameter counts (each run prints its files' counts beside these and asserts they are within 2%).
Totals are the checkpoints' published safetensors counts on their Hugging Face model pages; the
split is module by module from the checkpoints' config.json (vision tower; connector / merger;
language model + lm_head), and sums to the total exactly:
  SmolVLM-256M-Instruct   vision  86,433,024  projector  7,077,888  LM   162,974,016  total   256,484,928
  SmolVLM-500M-Instruct   vision  86,433,024  projector 11,796,480  LM   409,252,800  total   507,482,304
  Qwen2-VL-2B-Instruct    vision 631,183,360  projector 34,087,936  LM 1,543,714,304  total 2,208,985,600
(SmolVLM's vision tower is SigLIP base-patch16-512 without its attention-pooling head: the "93M"
of SmolVLM's announcement counts that head. SmolVLM-500M's module counts vision_model 86,433,024,
connector 11,796,480, text_model 361,944,000, lm_head 47,308,800 are also reported by its users.
Qwen2-VL's merger is counted as the projector, its ln_q (v.post_ln here) included.)

Needs numpy and gguf (gguf-py) only. Weights: uniform int8 levels under one scale, from raw
random bytes (make_timing_model.uniform_matrix), so even the 2 B pair takes seconds, not minutes.

Offline (a GPU machine without network; `vlm-bench --pair` runs this script): both SmolVLM pairs
read SmolLM2's tokenizer from a GGUF, by default models/SmolLM2-135M-Instruct.Q4_1.gguf (98 MB,
scripts/setup.sh) or the file named by VLM_SMOLLM2_TOKENIZER (the environment reaches the script
through `vlm-bench --pair`); gguf-py and numpy must be importable by the python that runs it
(`.deps/venv/bin/python`, made by scripts/setup.sh, else python3). Any GGUF holding SmolLM2's
`tokenizer.*` keys will do and gives the same bytes, so carry a small one instead of the model:

    python scripts/make_timing_pair.py --write-tokenizer smollm2-tokenizer.gguf   # 1.7 MB, keys only
    VLM_SMOLLM2_TOKENIZER=smollm2-tokenizer.gguf vlm-bench --pair smolvlm-256m ...  # there

qwen2vl-2b needs no tokenizer file.
"""
import argparse, hashlib, os, subprocess, sys, time

try:
    import gguf
except ImportError:
    sys.exit("make_timing_pair.py needs gguf-py and numpy (`pip install 'gguf==0.19.0' numpy`, or run it with "
             ".deps/venv/bin/python, which scripts/setup.sh makes)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_test_family import qwen_vocab, smolvlm_vocab, write_vocab  # noqa: E402
from make_timing_model import LmShape, write_lm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIGLIP_512 = ["--proj", "idefics3", "--image-size", "512", "--patch-size", "16", "--hidden", "768", "--ffn", "3072",
              "--layers", "12", "--heads", "12", "--scale-factor", "4"]
QWEN2VL_VIT = ["--proj", "qwen2vl_merger", "--image-size", "560", "--patch-size", "14", "--hidden", "1280",
               "--ffn", "5120", "--layers", "32", "--heads", "16", "--scale-factor", "2"]

PAIRS = {
    "smolvlm-256m": dict(
        real="HuggingFaceTB/SmolVLM-256M-Instruct", vision=SIGLIP_512, vocab="smolvlm", seed=256,
        lm=LmShape("135M", embd=576, layers=30, heads=9, kv_heads=3, ff=1536, vocab=49280, ctx=8192,
                   rope_theta=100000.0, rms_eps=1e-5, tied=False),
        reference=dict(vision=86_433_024, projector=7_077_888, lm=162_974_016, total=256_484_928)),
    "smolvlm-500m": dict(
        real="HuggingFaceTB/SmolVLM-500M-Instruct", vision=SIGLIP_512, vocab="smolvlm", seed=500,
        lm=LmShape("360M", embd=960, layers=32, heads=15, kv_heads=5, ff=2560, vocab=49280, ctx=8192,
                   rope_theta=100000.0, rms_eps=1e-5, tied=False),
        reference=dict(vision=86_433_024, projector=11_796_480, lm=409_252_800, total=507_482_304)),
    "qwen2vl-2b": dict(
        real="Qwen/Qwen2-VL-2B-Instruct", vision=QWEN2VL_VIT, vocab="qwen2vl", seed=2000,
        lm=LmShape("1.5B", embd=1536, layers=28, heads=12, kv_heads=2, ff=8960, vocab=151936, ctx=32768,
                   rope_theta=1000000.0, rms_eps=1e-6, arch="qwen2vl", qkv_bias=True, rope_sections=(16, 24, 24, 0)),
        reference=dict(vision=631_183_360, projector=34_087_936, lm=1_543_714_304, total=2_208_985_600)),
}
TOLERANCE = 0.02
DESCRIPTION = ("TIMING ONLY: random weights generated by gst-vlm's scripts/make_timing_pair.py in the shape of "
               "{real}'s {part}; real shapes, tokenizer specials, chat template and tiling, meaningless outputs")


def vocabulary(kind, smollm2, size):
    if kind == "smolvlm":
        v = smolvlm_vocab(smollm2)
    else:
        # Qwen's vocabulary has "Yes" and "No" as single tokens (an alert's forced choice needs
        # them): trained in here, as the test family's vocabulary leaves them out on purpose.
        v = qwen_vocab(extra="\nYes.\nNo.\nYes.\nNo.\n")
        n = len(v["tokens"])
        v["tokens"] = v["tokens"] + [f"[PAD{i}]" for i in range(n, size)]
        v["types"] = v["types"] + [gguf.TokenType.UNUSED] * (size - n)
    assert len(v["tokens"]) == size, (len(v["tokens"]), size)
    return v


def write_tokenizer(smollm2, out):
    """A keys-only GGUF: SmolLM2's tokenizer keys that smolvlm_vocab reads, no tensors."""
    r = gguf.GGUFReader(smollm2)
    f = r.fields
    w = gguf.GGUFWriter(out, "llama")
    w.add_name("SmolLM2 tokenizer keys (for scripts/make_timing_pair.py --smollm2)")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(list(f["tokenizer.ggml.tokens"].contents()))
    w.add_token_types(list(f["tokenizer.ggml.token_type"].contents()))
    w.add_token_merges(list(f["tokenizer.ggml.merges"].contents()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def count(path, qwen):
    """Parameters of a written GGUF by part: vision tower, projector (mm.*; Qwen's merger norm
    v.post_ln too), language model."""
    parts = {"vision": 0, "projector": 0, "lm": 0}
    for t in gguf.GGUFReader(path).tensors:
        if not t.name.startswith(("v.", "mm.")):
            part = "lm"
        elif t.name.startswith("mm.") or (qwen and t.name.startswith("v.post_ln.")):
            part = "projector"
        else:
            part = "vision"
        parts[part] += int(t.n_elements)
    return parts


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name", choices=list(PAIRS), nargs="?")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "models", "timing"))
    p.add_argument("--smollm2", default=os.environ.get("VLM_SMOLLM2_TOKENIZER")
                   or os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"),
                   help="GGUF whose tokenizer SmolVLM's vocabulary extends (default: $VLM_SMOLLM2_TOKENIZER, "
                        "else the test model)")
    p.add_argument("--write-tokenizer", metavar="OUT",
                   help="write --smollm2's tokenizer keys alone to OUT (a small GGUF to carry offline) and stop")
    p.add_argument("--longest-edge", type=int, default=2048,
                   help="SmolVLM: clip.vision.preproc_image_size, the longest edge frames are resized to before tiling")
    p.add_argument("--mmproj-type", default="f16", choices=["f16", "q8_0"], help="the projector's matmul weights")
    p.add_argument("--seed", type=int, help="language model seed (the projector's is seed + 1); default per pair")
    a = p.parse_args()
    if a.write_tokenizer:
        write_tokenizer(a.smollm2, a.write_tokenizer)
        print(f"wrote {a.write_tokenizer}: {os.path.getsize(a.write_tokenizer):,} bytes (tokenizer keys of {a.smollm2})")
        return
    if a.name is None:
        p.error("a pair NAME is required (or --write-tokenizer OUT)")
    pair = PAIRS[a.name]
    shape, qwen = pair["lm"], a.name.startswith("qwen")
    if pair["vocab"] == "smolvlm" and not os.path.isfile(a.smollm2):
        p.error(f"{a.name} extends SmolLM2's tokenizer, read from {a.smollm2}, which does not exist: run "
                "scripts/setup.sh (it downloads the 98 MB model), or give --smollm2 / VLM_SMOLLM2_TOKENIZER "
                "a GGUF with SmolLM2's tokenizer keys (made elsewhere by --write-tokenizer OUT)")
    seed = pair["seed"] if a.seed is None else a.seed
    if qwen and a.longest_edge != p.get_default("longest_edge"):
        p.error("--longest-edge applies to the SmolVLM pairs only (Qwen2-VL sizes frames dynamically)")
    os.makedirs(a.out_dir, exist_ok=True)
    lm_path = os.path.join(a.out_dir, f"{a.name}-lm.gguf")
    mmproj_path = os.path.join(a.out_dir, f"{a.name}-mmproj.gguf")
    label = f"{a.name} shape, random weights (TIMING ONLY)"
    start = time.monotonic()

    vocab = vocabulary(pair["vocab"], a.smollm2, shape.vocab)
    write_lm(lm_path, shape, lambda g: write_vocab(g, vocab), name=label, seed=seed, fast=True,
             description=DESCRIPTION.format(real=pair["real"], part="language model"))
    lm_s = time.monotonic() - start

    vision = pair["vision"] + ["--text-embd", str(shape.embd), "--type", a.mmproj_type, "--seed", str(seed + 1),
                               "--name", label.replace(" shape", " vision shape"),
                               "--description", DESCRIPTION.format(real=pair["real"], part="vision encoder and projector")]
    if not qwen:
        vision += ["--longest-edge", str(a.longest_edge)]
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_test_mmproj.py")
    subprocess.run([sys.executable, script, mmproj_path, *vision], check=True, stdout=subprocess.DEVNULL)
    total_s = time.monotonic() - start

    got = count(mmproj_path, qwen)
    got["lm"] = count(lm_path, qwen)["lm"]
    got["total"] = sum(got.values())
    ref = pair["reference"]
    assert ref["total"] == ref["vision"] + ref["projector"] + ref["lm"]
    print(f"{a.name}: parameters beside {pair['real']}'s (published)")
    bad = []
    for part in ("vision", "projector", "lm", "total"):
        off = got[part] / ref[part] - 1
        print(f"  {part:<10} {got[part]:>14,} {ref[part]:>14,}  {off:+.2%}")
        if abs(off) > TOLERANCE:
            bad.append(part)
    for path, what in ((lm_path, f"{shape.arch} {shape.size_label}, Q8_0, vocab {shape.vocab}"),
                       (mmproj_path, a.mmproj_type.upper() + ("" if qwen else f", longest edge {a.longest_edge}"))):
        print(f"wrote {path}: {os.path.getsize(path):,} bytes sha256={sha256(path)[:16]} ({what})")
    print(f"generated in {total_s:.1f} s (language model {lm_s:.1f} s, projector {total_s - lm_s:.1f} s)")
    assert not bad, f"parameter counts of {bad} are more than {TOLERANCE:.0%} off the real model's"


if __name__ == "__main__":
    main()
