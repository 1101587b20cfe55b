#!/usr/bin/env python3
"""Write a TIMING-ONLY language model GGUF: random weights in the exact shape of SmolLM2-360M-Instruct,
with SmolLM2's real tokenizer and chat template. Answers from it are meaningless text; what it is
for is timing (benchmark item 6 of issue 9: a model of a real size where the 98 MB test model is too
small to load a GPU, generated on the machine because it is too big to carry there).

    python make_timing_model.py OUT.gguf [--smollm2 models/SmolLM2-135M-Instruct.Q4_1.gguf]
                                         [--type q8_0|f16] [--seed 360]

Shape, from HuggingFaceTB/SmolLM2-360M's config.json: architecture llama, hidden 960, 32 layers,
15 attention heads of 64, 5 KV heads, FFN 2560 (SiLU-gated), vocabulary 49152, context 8192, RoPE
theta 100000, RMS norm eps 1e-5, tied embeddings (no output.weight): 362 M parameters.
Tokenizer: every tokenizer.* key is copied from the SmolLM2-135M-Instruct GGUF (the 135M and 360M
models share the tokenizer and chat template), so prompts tokenize as with the real model.
Weights: N(0, 1/sqrt(fan-in)) (token embeddings N(0, 0.02)), norms 1, from one seeded generator:
the same arguments write the same bytes. --type q8_0 (default, 386 MB: what a deployment of this
size would run) or f16 (724 MB); norms stay F32. general.name and general.description say that the
weights are random and the file is for timing only. Needs numpy and gguf (gguf-py) only; about
20 s on 16 cores.

As a module it writes other shapes: `LmShape` (architecture, widths, vocabulary, untied head, Qwen2's
q/k/v biases, M-RoPE sections) and `write_lm`, which scripts/make_timing_pair.py uses for the
language models of its VLM pairs with `fast=True`: Q8_0 blocks written straight from random bytes
(uniform int8 levels under one scale of the same standard deviation) instead of normal values then
quantised, about 30x faster here, for a 1.5 B model; matmul timing does not depend on the values.
"""
import argparse
from dataclasses import dataclass

import numpy as np
import gguf

QTYPES = {  # --type: (tensor type, file type)
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
}
INT8_STD = ((256 ** 2 - 1) / 12) ** 0.5  # standard deviation of uniform int8 levels


@dataclass(frozen=True)
class LmShape:
    """A decoder-only language model's shape, as its config.json gives it."""
    size_label: str
    embd: int
    layers: int
    heads: int
    kv_heads: int
    ff: int
    vocab: int
    ctx: int
    rope_theta: float
    rms_eps: float
    arch: str = "llama"
    tied: bool = True               # the output head is the token embedding table (no output.weight)
    qkv_bias: bool = False          # Qwen2: biases on q, k and v
    rope_sections: tuple = ()       # M-RoPE (qwen2vl): rotary pairs of the temporal, height, width sections

    @property
    def head_dim(self):
        return self.embd // self.heads


SMOLLM2_360M = LmShape("360M", embd=960, layers=32, heads=15, kv_heads=5, ff=2560, vocab=49152, ctx=8192,
                       rope_theta=100000.0, rms_eps=1e-5)


def normal_matrix(rng, rows, cols, qtype, std):
    """Normal values of ggml shape [cols, rows] (numpy [rows, cols]), quantised to `qtype` (or F16)."""
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    w *= std
    return gguf.quants.quantize(w, qtype) if qtype != gguf.GGMLQuantizationType.F16 else w.astype(np.float16)


def uniform_matrix(rng, rows, cols, qtype, std):
    """Uniform int8 levels under one scale (standard deviation `std`), from raw random bytes: written
    straight as Q8_0 blocks (an f16 scale, then 32 int8) or as F16 values, with no float pass."""
    n = rows * cols
    raw = rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]
    scale = std / INT8_STD
    if qtype == gguf.GGMLQuantizationType.F16:
        levels = (np.arange(256, dtype=np.uint8).view(np.int8) * scale).astype(np.float16)
        return levels[raw].reshape(rows, cols)
    assert qtype == gguf.GGMLQuantizationType.Q8_0 and cols % 32 == 0
    blocks = np.empty((rows, cols // 32, 34), np.uint8)
    blocks[..., :2] = np.array([scale], np.float16).view(np.uint8)
    blocks[..., 2:] = raw.reshape(rows, cols // 32, 32)
    return blocks.reshape(rows, cols // 32 * 34)


def copy_tokenizer(path, vocab):
    """A writer of every tokenizer.* key of the GGUF at `path`, key by key with its own value types."""
    src = gguf.GGUFReader(path)
    fields = [(k, f) for k, f in src.fields.items() if k.startswith("tokenizer.")]
    assert len(src.fields["tokenizer.ggml.tokens"].contents()) == vocab

    def write(g):
        for key, field in fields:
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            g.add_key_value(key, field.contents(), vtype, sub)
        return len(fields)
    return write


def write_lm(out, shape, write_tokenizer, *, name, description, qtype="q8_0", seed=360, fast=False):
    """Write a random-weight model of `shape`; `write_tokenizer(g)` adds the tokenizer keys. Norms are
    1 (F32), biases 0 (F32); matrices N(0, 1/sqrt(fan-in)), token embeddings N(0, 0.02), drawn in
    file order from one generator seeded `seed` (`fast`: see uniform_matrix). Returns what
    write_tokenizer returned."""
    tensor_type, file_type = QTYPES[qtype]
    s, E, HD = shape, shape.embd, shape.head_dim
    g = gguf.GGUFWriter(out, s.arch)
    g.add_string("general.type", "model")
    g.add_string("general.name", name)
    g.add_string("general.description", description)
    g.add_string("general.size_label", s.size_label)
    g.add_uint32("general.file_type", int(file_type))
    g.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    g.add_context_length(s.ctx)
    g.add_embedding_length(E)
    g.add_block_count(s.layers)
    g.add_feed_forward_length(s.ff)
    g.add_head_count(s.heads)
    g.add_head_count_kv(s.kv_heads)
    g.add_rope_freq_base(s.rope_theta)
    g.add_layer_norm_rms_eps(s.rms_eps)
    g.add_vocab_size(s.vocab)
    g.add_rope_dimension_count(HD)
    if s.rope_sections:
        g.add_rope_dimension_sections(list(s.rope_sections))
    written = write_tokenizer(g)

    rng = np.random.default_rng(seed)
    matrix = uniform_matrix if fast else normal_matrix
    ones = lambda n: np.ones(n, np.float32)

    def add(name, rows, cols, std=None):
        w = matrix(rng, rows, cols, tensor_type, std or cols ** -0.5)
        g.add_tensor(name, w, raw_dtype=tensor_type if w.dtype == np.uint8 else None)

    add("token_embd.weight", s.vocab, E, std=0.02)
    if not s.tied:
        add("output.weight", s.vocab, E)
    g.add_tensor("output_norm.weight", ones(E))
    for i in range(s.layers):
        b = f"blk.{i}."
        g.add_tensor(b + "attn_norm.weight", ones(E))
        add(b + "attn_q.weight", s.heads * HD, E)
        add(b + "attn_k.weight", s.kv_heads * HD, E)
        add(b + "attn_v.weight", s.kv_heads * HD, E)
        if s.qkv_bias:
            for n, rows in (("q", s.heads * HD), ("k", s.kv_heads * HD), ("v", s.kv_heads * HD)):
                g.add_tensor(b + f"attn_{n}.bias", np.zeros(rows, np.float32))
        add(b + "attn_output.weight", E, s.heads * HD)
        g.add_tensor(b + "ffn_norm.weight", ones(E))
        add(b + "ffn_gate.weight", s.ff, E)
        add(b + "ffn_up.weight", s.ff, E)
        add(b + "ffn_down.weight", E, s.ff)

    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    return written


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--smollm2", default="models/SmolLM2-135M-Instruct.Q4_1.gguf", help="GGUF whose tokenizer is copied")
    p.add_argument("--type", default="q8_0", choices=list(QTYPES))
    p.add_argument("--seed", type=int, default=360)
    a = p.parse_args()
    copied = write_lm(
        a.out, SMOLLM2_360M, copy_tokenizer(a.smollm2, SMOLLM2_360M.vocab), qtype=a.type, seed=a.seed,
        name="SmolLM2-360M shape, random weights (TIMING ONLY)",
        description="TIMING ONLY: random weights generated by gst-vlm's scripts/make_timing_model.py in the shape of "
                    "SmolLM2-360M-Instruct, with SmolLM2's tokenizer and chat template; outputs are meaningless")
    print(f"{a.out}: SmolLM2-360M shape, {a.type}, {copied} tokenizer keys from {a.smollm2}, TIMING ONLY random weights")


if __name__ == "__main__":
    main()
