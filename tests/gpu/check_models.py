"""GPU checks of models and towers written without a GPU (run by tests/gpu/run_gpu_checks.sh): each is built with
random weights, run on CUDA, and compared with the same weights run on the CPU in fp32.

Sections (--sections, comma-separated):
- encoders: the vision towers (llmd.model.vision) at real widths: Gemma 3 4B's SigLIP (896-pixel image, 256 tokens),
  Qwen3-VL-8B's (the Qwen3.5 tower plus DeepStack at blocks 1-3 of 4; a 768 x 768 image, 576 tokens) and Mistral
  Small 3.1's Pixtral (a 1008 x 1008 image, 36 x 36 tokens). The comparison runs REF_LAYERS layers (4, so that the
  CPU reference takes seconds), one image, on CUDA in bf16 and fp32 against the CPU in fp32; then the full-depth
  tower (27, 27, 24 layers) is timed on CUDA: encode ms per image, bf16 and fp32.
- hybrid: a tiny random Qwen3-Next (llmd.model.qwen3_next: Gated DeltaNet layers with fused projections, gated
  attention, MoE with a gated shared expert, one dense layer), bf16 logits on CUDA against CPU fp32.
- moe: a tiny random Nemotron-H MoE (llmd.model.mamba2: Mamba2, attention and squared-ReLU expert layers, a sigmoid
  router with its selection bias, a shared expert), the same comparison.
- ple: Gemma 4 E4B's widths and vocabulary with 6 layers (2 reading earlier layers' K/V): the per-layer embedding
  table stays in host memory (llmd.model.host_table) while the layers are on CUDA; bf16 logits against CPU fp32, and
  the table's lookup time per step.
Logits and embeddings are compared by relative error, |got - want| / |want| over the whole tensor: BF16_TOL for the
towers (bf16 rounds to 3 significant digits; a few layers compound it), LOGITS_BF16_TOL for the random text models
(they amplify rounding: see its comment) and FP32_TOL (cuDNN's convolutions take TF32 by default).
`--device cpu --scale tiny` runs the same code with the CPU standing in for CUDA (tests/test_gpu_check_models.py).
Writes check_models.json (or --name) under --out; exits 1 if any check fails. Imports nothing outside torch/llmd.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # bench_gpu's configs; tests/simple_driver

BF16_TOL, FP32_TOL = 5e-2, 5e-3
# a random model's logits: rounding its weights alone to bf16 moves them by ~4.5e-2 (tiny Qwen3-Next and Gemma 4,
# measured on the CPU), bf16 activations too by ~7e-2; a wrong kernel or layout gives errors of order 1
LOGITS_BF16_TOL = 0.15
REF_LAYERS = {"full": 4, "tiny": 2}  # the tower layers the CPU reference runs
TIMED_RUNS = 5


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float().cpu()
    return ((got.float().cpu() - want).norm() / want.norm().clamp_min(1e-30)).item()


def random_value(name: str, shape: tuple[int, ...], gen: torch.Generator, device: str | torch.device) -> torch.Tensor:
    """A parameter of this name and shape with random values that keep activations near unit scale: matrices
    N(0, 1/fan_in), norm weights and multipliers near 1, Mamba2's / DeltaNet's A_log and dt_bias in their usual
    ranges, other vectors (biases) small."""
    leaf = name.rpartition(".")[2]
    if len(shape) >= 2:
        fan_in = math.prod(shape[1:])
        return torch.randn(shape, generator=gen, device=device) * fan_in ** -0.5
    v = torch.randn(shape, generator=gen, device=device)
    if leaf == "A_log":
        return v.abs() * 0.5
    if leaf in ("dt_bias", "D"):
        return v * 0.1 + (1.0 if leaf == "D" else 0.0)
    if "norm" in name or "ln_" in name or leaf in ("soft_emb_scale", "layer_scalar", "scale", "per_expert_scale"):
        return 1.0 + 0.1 * v if leaf != "bias" else 0.1 * v
    return 0.1 * v


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn: Callable[[], Any], device: str, runs: int = TIMED_RUNS) -> float:
    fn()  # warm-up (cuDNN picks its algorithms)
    sync(device)
    start = time.perf_counter()
    for _ in range(runs):
        fn()
    sync(device)
    return (time.perf_counter() - start) / runs * 1e3


# ----------------------------------------------------------------------------------------------------------------
# Vision towers: each built by its family's own builder (the one the checkpoint loaders call), every tensor "read"
# from a random state: the builders' dtype rules (Gemma 3's fp32 soft-emb scale, Pixtral's fp32 RoPE) apply.

def _gemma3(scale: str, layers: int | None) -> tuple[Callable, torch.Tensor]:
    from llmd.model.vision import gemma3 as g

    full = dict(image_size=896, patch_size=14, hidden_size=1152, intermediate_size=4304, num_layers=27,
                num_heads=16, text_hidden_size=2560, mm_tokens_per_image=256)
    tiny = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                text_hidden_size=48, mm_tokens_per_image=4)
    fields = full if scale == "full" else tiny
    config = g.Gemma3VisionConfig(**(fields | ({"num_layers": layers} if layers else {})))
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in g.Gemma3Vision(config).named_parameters()}
    shapes[g._SCALE] = (config.hidden_size,)

    def build(state: Callable[[str, tuple], torch.Tensor], dtype: torch.dtype, device: str) -> Any:
        return g._build(config, lambda n: (Path("random"), n, shapes[n], lambda: state(n, shapes[n])), dtype, device)

    return build, torch.randn(3, config.image_size, config.image_size, generator=torch.Generator().manual_seed(1))


def _qwen3_vl(scale: str, layers: int | None) -> tuple[Callable, torch.Tensor]:
    from llmd.model.vision import qwen3_5 as q

    full = dict(hidden_size=1152, intermediate_size=4304, num_layers=27, num_heads=16, text_hidden_size=4096,
                patch_size=16, num_position_embeddings=2304, deepstack_indexes=(8, 16, 24))
    tiny = dict(hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2, text_hidden_size=48, patch_size=4,
                num_position_embeddings=16, deepstack_indexes=(0, 2))
    fields = full if scale == "full" else tiny
    if layers:  # as many DeepStack features, from the reduced tower's last blocks
        count = len(fields["deepstack_indexes"])
        fields = fields | dict(num_layers=layers, deepstack_indexes=tuple(range(max(layers - count, 0), layers)))
    config = q.Qwen35VisionConfig(**fields)
    side = 768 if scale == "full" else 32

    def build(state: Callable[[str, tuple], torch.Tensor], dtype: torch.dtype, device: str) -> Any:
        return q.build_qwen3_5_vision(config, lambda n, s: (Path("random"), n, s, lambda: state(n, s)), dtype, device)

    return build, torch.randn(3, side, side, generator=torch.Generator().manual_seed(1))


def _pixtral(scale: str, layers: int | None) -> tuple[Callable, torch.Tensor]:
    from llmd.model.vision import mistral3 as m

    full = dict(patch_size=14, hidden_size=1024, intermediate_size=4096, num_layers=24, num_heads=16,
                text_hidden_size=5120, longest_edge=1540)
    tiny = dict(patch_size=4, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2, text_hidden_size=48,
                longest_edge=64)
    fields = (full if scale == "full" else tiny) | ({"num_layers": layers} if layers else {})
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in m.Mistral3Vision(m.Mistral3VisionConfig(**fields)).named_parameters()}
    side = 1008 if scale == "full" else 32

    def build(state: Callable[[str, tuple], torch.Tensor], dtype: torch.dtype, device: str) -> Any:
        return m.build(fields, Path("random"), lambda n: (Path("random"), n, shapes[n], lambda: state(n, shapes[n])),
                       dtype, device)

    return build, torch.randn(3, side, side, generator=torch.Generator().manual_seed(1))


TOWERS = {"gemma3-4b-siglip": _gemma3, "qwen3-vl-8b": _qwen3_vl, "mistral-small-3.1-pixtral": _pixtral}


def _random_state(seed: int, device: str) -> Callable[[str, tuple], torch.Tensor]:
    """name, shape -> its random value, the same for the same name whichever tower asks (seeded by name)."""
    def state(name: str, shape: tuple) -> torch.Tensor:
        gen = torch.Generator(device).manual_seed(seed + sum(map(ord, name)) * 7919 + len(name))
        return random_value(name, shape, gen, device)

    return state


def encoders(device: str = "cuda", scale: str = "full") -> list[dict]:
    """Per tower: relative error of the device's bf16 and fp32 encodings against the CPU's fp32 (REF_LAYERS layers),
    then the full-depth tower's encode ms per image on the device, bf16 and fp32."""
    rows = []
    for name, make in TOWERS.items():
        row: dict = dict(tower=name, ref_layers=REF_LAYERS[scale])
        try:
            build, pixels = make(scale, REF_LAYERS[scale])
            state = _random_state(0, "cpu")
            want = build(state, torch.float32, "cpu").encode(pixels)
            row["shape"] = list(want.shape)
            for dtype, tol in ((torch.bfloat16, BF16_TOL), (torch.float32, FP32_TOL)):
                got = build(state, dtype, device).encode(pixels)
                err = rel_err(got, want)
                row[f"rel_err_{str(dtype)[6:]}"] = err
                if not (got.dtype == dtype and err < tol):
                    row["error"] = f"{name} {dtype}: relative error {err:.2e} (tolerance {tol:.0e}), dtype {got.dtype}"
            build_full, pixels = make(scale, None)
            for dtype in (torch.bfloat16, torch.float32):
                tower = build_full(_random_state(1, device), dtype, device)
                row["layers"] = tower.config.num_layers
                row[f"encode_ms_{str(dtype)[6:]}"] = timed_ms(lambda t=tower, p=pixels: t.encode(p), device)
                del tower
            print(f"encoder {name:26} image {tuple(pixels.shape[1:])} -> {tuple(row['shape'])}: rel err (bf16 / fp32 "
                  f"vs CPU fp32, {row['ref_layers']} layers) {row['rel_err_bfloat16']:.1e} / {row['rel_err_float32']:.1e}"
                  f"; encode {row['encode_ms_bfloat16']:8.1f} ms bf16, {row['encode_ms_float32']:8.1f} ms fp32 per "
                  f"image ({row['layers']} layers){'  FAILED' if 'error' in row else ''}", flush=True)
        except Exception:
            row["error"] = traceback.format_exc()
            print(f"encoder {name} failed:\n{row['error']}", flush=True)
        rows.append(row)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Text models: llmd's model class built from config.json values (ModelConfig.from_hf_config, as a checkpoint is read),
# random weights on the CPU in fp32, the same state copied into the device's bf16 model; a prompt fed in two chunks,
# then a few decode steps (tests/simple_driver.SingleSequence: the engine's paged caches and recurrent state slots).

QWEN3_NEXT = dict(architectures=["Qwen3NextForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=64, mlp_only_layers=[1],
                  norm_topk_prob=True, partial_rotary_factor=0.25, rope_theta=10000.0, rms_norm_eps=1e-6,
                  max_position_embeddings=4096, tie_word_embeddings=False)
NEMOTRON_H_MOE = dict(architectures=["NemotronHForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=5, hybrid_override_pattern="ME*EM", num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
                      ssm_state_size=16, conv_kernel=4, n_routed_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, n_group=1, topk_group=1,
                      routed_scaling_factor=2.5, norm_topk_prob=True, mlp_hidden_act="relu2",
                      max_position_embeddings=4096, tie_word_embeddings=False)
TEXT_MODELS = {"hybrid": {"qwen3-next": QWEN3_NEXT}, "moe": {"nemotron-h-moe": NEMOTRON_H_MOE}}
PROMPT, DECODE = 40, 4


def build_model(hf: dict, dtype: torch.dtype, device: str, state: dict | None = None) -> torch.nn.Module:
    """llmd's model for the config, on `device` in `dtype`, prepared as the loader prepares it (ops bound, experts'
    kernels chosen); its parameters from `state` or random (fp32, seeded; drawn on a GPU where there is one: E4B's
    billion values take the CPU long)."""
    from llmd.model.config import ModelConfig
    from llmd.model.moe import Experts
    from llmd.model.ops import bind_ops, choose_ops
    from llmd.model.weights import build_empty

    model = build_empty(ModelConfig.from_hf_config(hf), dtype, device)
    draw_on = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(draw_on).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name] if state is not None else random_value(name, tuple(p.shape), gen, draw_on))
    bind_ops(model, choose_ops(torch.device(device), dtype))
    for module in model.modules():
        if isinstance(module, Experts):
            module.prepare(torch.device(device), dtype)
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    from simple_driver import SingleSequence

    ids = torch.randint(0, model.config.vocab_size, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(2))
    seq = SingleSequence(model, max_tokens=PROMPT + DECODE + 8)
    rows = [seq.feed(ids[:11].tolist()), seq.feed(ids[11:PROMPT].tolist())]
    return torch.cat(rows + [seq.feed([t]) for t in ids[PROMPT:].tolist()])


def _compare(name: str, hf: dict, device: str) -> tuple[dict, torch.nn.Module]:
    """(the row, the device's model)."""
    want_model = build_model(hf, torch.float32, "cpu")
    want = logits(want_model)
    got_model = build_model(hf, torch.bfloat16, device, state={n: p.detach() for n, p in want_model.named_parameters()})
    err = rel_err(logits(got_model), want)
    tol = LOGITS_BF16_TOL
    row: dict = dict(model=name, rel_err=err, tolerance=tol)
    if not err < tol:
        row["error"] = f"{name}: logits' relative error {err:.2e} against CPU fp32 (tolerance {tol:.0e})"
    print(f"model {name:16} {PROMPT}-token prompt in 2 chunks + {DECODE} decode steps: bf16 logits rel err "
          f"{err:.1e} vs CPU fp32{'  FAILED' if 'error' in row else ''}", flush=True)
    return row, got_model


def text_models(section: str, device: str = "cuda", scale: str = "full") -> list[dict]:
    rows = []
    for name, hf in TEXT_MODELS[section].items():
        try:
            rows.append(_compare(name, hf, device)[0])
        except Exception:
            rows.append(dict(model=name, error=traceback.format_exc()))
            print(f"model {name} failed:\n{rows[-1]['error']}", flush=True)
    return rows


def gemma4_e4b_config(scale: str) -> dict:
    """E4B's config.json (bench_gpu's), 6 layers: three window layers, a global, then a window and a global layer
    reading the K/V of layers 2 and 3 (as E4B's last 18 read its layers 22 and 23's)."""
    import bench_gpu

    layers = ["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"]
    hf = bench_gpu.GEMMA4_E4B_HF | dict(num_hidden_layers=6, layer_types=layers, num_kv_shared_layers=2)
    if scale == "tiny":
        hf |= dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                   global_head_dim=32, hidden_size_per_layer_input=16, vocab_size=512,
                   vocab_size_per_layer_input=512, sliding_window=16)
    return hf


def per_layer_embeddings(device: str = "cuda", scale: str = "full") -> list[dict]:
    """The per-layer table's device (cpu) and the layers' (the device), logits against CPU fp32, the lookup's time
    for a decode step's token and a 512-token chunk."""
    from llmd.model.host_table import HostEmbedding, host_weight_bytes

    try:
        hf = gemma4_e4b_config(scale)
        row, model = _compare("gemma4-e4b-6l", hf, device)
        table = model.model.embed_tokens_per_layer
        row["table_device"], row["layers_device"] = str(table.weight.device), str(model.model.norm.weight.device)
        row["host_bytes"] = host_weight_bytes(model)
        if not isinstance(table, HostEmbedding) or table.weight.device.type != "cpu" \
                or row["layers_device"].split(":")[0] != device:
            row["error"] = f"the per-layer table is on {row['table_device']}, the layers on {row['layers_device']}"
        for tokens in (1, 512):
            ids = torch.randint(0, hf["vocab_size"], (tokens,), device=device)
            row[f"lookup_us_{tokens}"] = timed_ms(lambda i=ids: table(i), device, runs=20) * 1e3
        print(f"ple   table on {row['table_device']} ({row['host_bytes'] / 2**30:.2f} GiB of host memory), layers on "
              f"{row['layers_device']}; lookup {row['lookup_us_1']:.0f} us for 1 token, {row['lookup_us_512']:.0f} us "
              f"for 512{'  FAILED' if 'error' in row else ''}", flush=True)
    except Exception:
        row = dict(model="gemma4-e4b-6l", error=traceback.format_exc())
        print(f"ple failed:\n{row['error']}", flush=True)
    return [row]


SECTIONS: dict[str, Callable[..., list[dict]]] = {
    "encoders": encoders, "hybrid": lambda **kw: text_models("hybrid", **kw),
    "moe": lambda **kw: text_models("moe", **kw), "ple": per_layer_embeddings}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of: {', '.join(SECTIONS)}")
    parser.add_argument("--name", default="check_models", help="the JSON file's name under --out, without .json")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--scale", default="full", choices=("full", "tiny"))
    args = parser.parse_args(argv)
    chosen = args.sections.split(",")
    if unknown := [s for s in chosen if s not in SECTIONS]:
        parser.error(f"unknown section(s) {', '.join(unknown)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("check_models: no CUDA device here (torch.cuda.is_available() is False): skipped; --device cpu "
              "--scale tiny runs the same code on the CPU", flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_grad_enabled(False)
    results: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "scale": args.scale}
    for name in chosen:
        start = time.perf_counter()
        results[name] = SECTIONS[name](device=args.device, scale=args.scale)
        failed = [r["error"] for r in results[name] if "error" in r]
        if failed:
            results[name + "_error"] = "\n".join(failed)
        results[name + "_seconds"] = time.perf_counter() - start
        (out / f"{args.name}.json").write_text(json.dumps(results, indent=2))
    return 0 if not any(k.endswith("_error") for k in results) else 1


if __name__ == "__main__":
    sys.exit(main())
