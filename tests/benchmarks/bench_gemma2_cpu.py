"""Gemma 2 on the CPU fast path: what the attention soft-cap costs in the C decode kernel, and a decode step of the
model's modules against the C layer stack (llmd.model.cpu_stack), int8 weights. Prints figures.

    python tests/benchmarks/bench_gemma2_cpu.py [--threads 1] [--context 8192] [--layers 2] [--budget 2.0]

1. Decode attention of one query over --context cached tokens at Gemma 2 2B's head shape (8 query heads, 4 KV
   heads of 256): the C kernel without and with a soft-cap of 50, on fp32 and fp16 caches (fp16: the CPU default),
   and the torch code (the only path for a soft-capped layer before the C kernels took it). Microseconds per call,
   best of repeats; the two C variants are called in turn, and the soft-cap's cost is the median ratio of those
   pairs (robust to a machine whose load drifts).
2. Decode steps (batch 1, after a 256-token prompt, fp16 KV in two groups as the engine keeps them) of a tiny Gemma 2
   (the tests' model: hidden 64, 4 layers) and of --layers layers of Gemma 2 2B's shape (hidden 2304, intermediate
   9216, a small vocabulary: the layers are what differs), modules against the stack, called in turn: ms per step's
   forward (no LM head), best of the steps.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode_driver import paged_kv  # noqa: E402

HEADS, KV_HEADS, D, BLOCK, CAP = 8, 4, 256, 16, 50.0


def timed_us(fns, budget_s: float) -> list[list[float]]:
    """Each function's times (us) over `budget_s`, the functions called in turn, so a drift in the machine's load
    falls on all of them alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s:
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            times[i].append((time.perf_counter() - t) * 1e6)
    return times


def attention_figures(context: int, budget: float) -> None:
    from llmd.kernels import cpu_ops
    from llmd.model.attention import AttentionMetadata, DecodePlan, batched_decode_attention

    nb = -(-context // BLOCK)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(nb, BLOCK, KV_HEADS, D, generator=g), torch.randn(nb, BLOCK, KV_HEADS, D, generator=g)
    meta = AttentionMetadata.build([1], [context], [list(range(nb))], BLOCK)
    plan = DecodePlan.build(meta)
    q, out = torch.randn(1, HEADS, D, generator=g), torch.empty(1, HEADS, D)
    print(f"decode attention, 1 query over {context} tokens, {HEADS} heads / {KV_HEADS} KV heads of {D}: us per call")
    for name, cache in (("fp32", (k, v)), ("fp16", (k.half(), v.half()))):
        def c(cap, cache=cache):
            return lambda: cpu_ops.decode_attention(q, cache, plan.block_tables, plan.seq_lens, None, 0.0625, out,
                                                    softcap=cap)
        plain, capped = timed_us([c(None), c(CAP)], budget)
        ratio = statistics.median(b / a for a, b in zip(plain, capped, strict=True))  # calls made side by side
        (torch_us,) = timed_us([lambda cache=cache: batched_decode_attention(q, cache, plan, 0.0625, softcap=CAP)],
                               budget / 2)
        print(f"  {name} KV: C {min(plain):9.1f}   C softcap {min(capped):9.1f} (median of pairs "
              f"{(ratio - 1) * 100:+.1f}%)   torch softcap {min(torch_us):9.1f} ({min(torch_us) / min(capped):.1f}x "
              "the C one)", flush=True)


def realistic_folder(root: Path, layers: int) -> Path:
    """Gemma 2 2B's layer shapes (random weights; speed does not depend on their values), the tests' tokenizer."""
    import transformers as tf
    from tiny_gemma import write_tiny_gemma
    from tiny_models import MODEL_VOCAB

    tiny = write_tiny_gemma(root / "tiny", "gemma2")
    cfg = tf.Gemma2Config(vocab_size=MODEL_VOCAB, hidden_size=2304, intermediate_size=9216, num_hidden_layers=layers,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                          sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                          bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
    folder = root / "gemma2-2b-shape"
    torch.manual_seed(0)
    tf.Gemma2ForCausalLM(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, folder / name)
    return folder


@torch.inference_mode()
def step_figures(folder: Path, label: str, steps: int) -> None:
    """Best time of a decode step's forward (embeddings, layers, final norm; batch 1) for the modules and the stack,
    called in turn on one sequence's cache (each step one token longer), so a drift in the machine's load falls on
    both."""
    from llmd.model.cpu_stack import CompiledCpuForward
    from llmd.model.loader import load_model

    model = load_model(folder, quant="int8").model
    stack = CompiledCpuForward.try_build(model)
    assert stack is not None, "the C layer stack should cover Gemma 2 with int8 layers"
    prompt = 256
    kv, build = paged_kv(model, 1, prompt + 2 * steps + 1, kv_cache_dtype="fp16", kv_groups=True)
    stack(torch.randint(0, model.config.vocab_size, (prompt,)), torch.arange(prompt), kv, build([prompt], [prompt]))
    best, n = {"modules": float("inf"), "stack": float("inf")}, prompt
    for _ in range(steps):
        for name, forward in (("modules", model), ("stack", stack)):
            n += 1
            meta = build([1], [n])
            t = time.perf_counter()
            forward(torch.tensor([5]), torch.tensor([n - 1]), kv, meta)
            best[name] = min(best[name], time.perf_counter() - t)
    print(f"  {label}: modules {best['modules'] * 1e3:8.2f} ms   C stack {best['stack'] * 1e3:8.2f} ms   "
          f"({best['modules'] / best['stack']:.2f}x)", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2, help="layers of the 2B-shaped model")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of repeated calls per attention figure")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from llmd.kernels import cpu_ops

    if cpu_ops.load() is None:
        print("llmd's CPU ops are unavailable here: nothing to measure")
        return
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    with torch.inference_mode():
        attention_figures(args.context, args.budget)
    print("decode step forward, batch 1, int8 weights, fp16 KV in two groups, after a 256-token prompt: best step")
    root = Path(tempfile.mkdtemp(prefix="llmd-bench-gemma2-"))
    try:
        from tiny_gemma import write_tiny_gemma

        step_figures(write_tiny_gemma(root / "tiny2", "gemma2"), "tiny Gemma 2 (hidden 64, 4 layers)", 200)
        step_figures(realistic_folder(root, args.layers), f"Gemma 2 2B shape, {args.layers} layers", 100)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
