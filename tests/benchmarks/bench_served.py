"""llmd against llama.cpp's server as a user meets them: server to server, over HTTP, on the same GGUF and threads.

    python tests/benchmarks/bench_served.py --shape 1b --type Q4_K_M --threads 2 [--sizes 512,2048] [--out r.json]
    python tests/benchmarks/bench_served.py --model FILE.gguf --sections bandwidth,decode

Starts `llmd serve` (temporary XDG folders, free port) and then llama-cpp-python's server (`python -m
llama_cpp.server`, `make bench-anchor`), ONE AT A TIME, each with --threads threads, and measures at the client over
streamed /v1/completions (temperature 0; llmd ignores EOS, llama.cpp gets a -100 logit bias on it):
- ttft: time to the first token of cold prompts of each --sizes tokens, a distinct prompt each (no prefix-cache hit);
- decode: aggregate decode tok/s of 1, 4 and 16 concurrent streams (tokens after each stream's first, over the
  span from the first stream's first token to the last stream's last); llama-cpp-python's server runs one request
  at a time, so its streams queue, as its users' do (with --interrupt_requests False: by default a new request
  ends the stream in progress);
- prefix: TTFT of a prompt of the largest --sizes tokens plus 32 more, cold, then of the same prompt with another 32
  (a prefix-cache hit: KV blocks, and for a hybrid its state checkpoint);
- bandwidth: a STREAM-like triad (a = b + s*c, 3 x 1 GiB of float32, torch on --threads threads) and a pure read,
  and for batch-1 decode the GB/s achieved = (weight bytes read per token + KV bytes read + a hybrid's recurrent
  state read and written back) x tok/s, and its % of the triad (which counts its write too).
Prompts are text: words that are one token each in the model's vocabulary, so both servers see about --sizes
tokens. --shape/--type take a random-weight file of a real model's shape from real_shapes.py. Without
llama-cpp-python llmd runs alone and the table says the anchor is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import gguf

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from llmd_daemon_proc import free_port, start_daemon  # noqa: E402

MISSING = "llama.cpp: not installed (make bench-anchor): llmd alone"
SECTIONS = ("bandwidth", "ttft", "decode", "prefix")
PREFIX_SUFFIX_WORDS = 32  # the part after the shared prompt in the prefix section
DECODE_PROMPT_WORDS = 32
GiB = 2**30


@dataclass
class Model:
    path: Path
    words: list[str]  # vocabulary entries that are a space and letters: one token each
    eos: int
    # every tensor once (a hybrid's conv and ssm tensors too), the embedding table only when it is also the output
    # matrix, no multi-token-prediction block (neither server runs it); of a mixture of experts' stacked tensors
    # (ffn_*_exps) the share a token reads: top-k of the experts
    weight_bytes_per_token: int
    # K and V of the layers that keep them (not a hybrid's recurrent layers) at 2 bytes an element (both servers'
    # default on CPU: f16)
    kv_bytes_per_position: int
    # a hybrid's recurrent layers (Qwen3.5's Gated DeltaNet, Mamba2): each decode step reads their whole state and
    # writes it back, the conv's last K-1 inputs and the recurrent state (the delta rule's [value heads, key dim,
    # value dim], Mamba2's [heads, head dim, state]), fp32 in both servers
    state_bytes_per_token: int = 0

    @classmethod
    def read(cls, path: Path) -> Model:
        r = gguf.GGUFReader(path)
        arch = r.fields["general.architecture"].contents()
        tokens = r.fields["tokenizer.ggml.tokens"].contents()
        words = [t[1:] for t in tokens if t.startswith("\u0120") and t[1:].isascii() and t[1:].isalpha() and len(t) > 3]
        return cls(path, words, int(r.fields["tokenizer.ggml.eos_token_id"].contents()), *decode_bytes(r, arch))

    def prompt(self, n: int, seed: int) -> str:
        rng = random.Random(seed)
        return " " + " ".join(rng.choice(self.words) for _ in range(n))


def decode_bytes(r: gguf.GGUFReader, arch: str) -> tuple[int, int, int]:
    """(weight bytes a decode step reads per token, KV bytes per position attended, recurrent state bytes read and
    written per token) from a GGUF file's header, as llama.cpp lays the model out: a layer with ssm_* tensors is
    recurrent (Qwen3.5's Gated DeltaNet, Mamba2), another with K (attn_k, or a fused attn_qkv) keeps K/V."""
    def field(key: str, default=None):
        return r.fields[f"{arch}.{key}"].contents() if f"{arch}.{key}" in r.fields else default

    layers = field("block_count") - field("nextn_predict_layers", 0)  # MTP blocks come last, counted in block_count
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    run = {name: n for name, n in sizes.items() if not name.startswith("blk.") or int(name.split(".")[1]) < layers}
    experts, used = field("expert_count", 0), field("expert_used_count", 0)
    weights = int(sum(n * (used / experts if experts and "_exps." in name else 1.0) for name, n in run.items()))
    weights -= run["token_embd.weight"] if "output.weight" in run else 0
    kinds = [{name.split(".")[2] for name in run if name.startswith(f"blk.{i}.")} for i in range(layers)]
    recurrent = [i for i in range(layers) if any(kind.startswith("ssm_") for kind in kinds[i])]
    attention = [i for i in range(layers) if i not in recurrent and kinds[i] & {"attn_k", "attn_qkv"}]
    kv_heads = field("attention.head_count_kv")  # one count, or one per layer (0 on a hybrid's other layers)
    head_dim = field("embedding_length") // field("attention.head_count")
    k, v = field("attention.key_length") or head_dim, field("attention.value_length") or head_dim
    kv = sum((kv_heads[i] if isinstance(kv_heads, list) else kv_heads) * (k + v) * 2 for i in attention)
    state = 0
    if recurrent:  # the conv's channels (x, and B/C or q/k of every group) and the state [heads, head dim, state]
        inner, size = field("ssm.inner_size"), field("ssm.state_size")
        conv = (field("ssm.conv_kernel") - 1) * (inner + 2 * field("ssm.group_count") * size)
        state = len(recurrent) * (conv + size * inner) * 4 * 2  # fp32, read and written back
    return weights, kv, state


@dataclass
class Server:
    name: str
    url: str
    body: dict  # what this server needs in every request to ignore EOS
    stop: object


def start_llmd(model: Model, threads: int, ctx: int, base: Path) -> Server:
    (base / "config" / "llmd").mkdir(parents=True)
    (base / "config" / "llmd" / "config.toml").write_text(f'[models.bench]\npath = "{model.path}"\n')
    d = start_daemon(base, "--model", "bench", "--threads", str(threads), "--max-model-len", str(ctx))
    return Server("llmd", d.url, {"model": "bench", "ignore_eos": True}, d.stop)


def start_llamacpp(model: Model, threads: int, ctx: int, base: Path) -> Server | None:
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        return None
    port = free_port()
    log = open(base / "llama-cpp.log", "wb")
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model.path), "--host", "127.0.0.1", "--port",
           str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(ctx),
           "--interrupt_requests", "False"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONSAFEPATH": "1"})

    def stop() -> None:
        proc.terminate()
        proc.wait(60)
        log.close()

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited with {proc.returncode}: {(base / 'llama-cpp.log').read_text()}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5):
                break
        except OSError:
            if time.monotonic() > deadline:
                stop()
                raise RuntimeError("llama_cpp.server did not become ready") from None
            time.sleep(0.5)
    return Server("llama.cpp", url, {"logit_bias": {str(model.eos): -100.0}}, stop)


async def stream(http: aiohttp.ClientSession, server: Server, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **server.body}
    sent = time.perf_counter()
    arrivals, finish = [], None
    async with http.post(server.url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{server.name}: HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                if choice.get("text") or choice.get("finish_reason"):  # a byte of a character may come as ""
                    arrivals.append(time.perf_counter())
                finish = choice.get("finish_reason") or finish
    if not arrivals:
        raise RuntimeError(f"{server.name}: no tokens")
    # a chunk may hold several tokens (or none, for part of a character): at max_tokens the count is exact
    tokens = max_tokens if finish == "length" else len(arrivals)
    return {"ttft": arrivals[0] - sent, "first": arrivals[0], "last": arrivals[-1], "tokens": tokens}


async def measure(server: Server, model: Model, sections: set[str], sizes: list[int], levels: list[int],
                  tokens: int) -> dict:
    out: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        await stream(http, server, model.prompt(8, seed=-1), 4)  # warm-up: first-request costs out of the figures
        if "ttft" in sections:
            for n in sizes:
                out[f"ttft_{n}_s"] = (await stream(http, server, model.prompt(n, seed=n), 1))["ttft"]
                print(f"  {server.name} ttft {n}: {out[f'ttft_{n}_s']:.2f} s", file=sys.stderr, flush=True)
        if "prefix" in sections:  # one shared prompt of the largest size: a cold request, then one sharing it
            shared = model.prompt(max(sizes), seed=-7)
            for kind, seed in (("miss", -8), ("hit", -9)):
                out[f"ttft_prefix_{kind}_s"] = (await stream(http, server, shared + model.prompt(
                    PREFIX_SUFFIX_WORDS, seed=seed), 1))["ttft"]
                print(f"  {server.name} prefix {kind}: {out[f'ttft_prefix_{kind}_s']:.2f} s", file=sys.stderr,
                      flush=True)
        if "decode" in sections:
            for c in levels:
                rs = await asyncio.gather(*(stream(http, server, model.prompt(DECODE_PROMPT_WORDS, seed=1000 * c + i),
                                                   tokens) for i in range(c)))
                span = max(r["last"] for r in rs) - min(r["first"] for r in rs)
                out[f"decode_{c}_tok_s"] = sum(r["tokens"] - 1 for r in rs) / span
                print(f"  {server.name} decode x{c}: {out[f'decode_{c}_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    if "decode_1_tok_s" in out:
        context = DECODE_PROMPT_WORDS + tokens / 2  # mean positions read per step
        per_token = model.weight_bytes_per_token + model.state_bytes_per_token + model.kv_bytes_per_position * context
        out["decode_1_gb_s"] = per_token * out["decode_1_tok_s"] / 1e9
    return out


def bandwidth(threads: int) -> dict:
    """STREAM-like triad and pure read over 1 GiB float32 arrays; best of 5 (GB/s, 1e9 bytes)."""
    import torch

    torch.set_num_threads(threads)
    n = GiB // 4
    a, b, c = torch.zeros(n), torch.ones(n), torch.ones(n)
    triad, read = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        triad.append(3 * 4 * n / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        b.sum()
        read.append(4 * n / (time.perf_counter() - t0) / 1e9)
    return {"triad_gb_s": max(triad), "read_gb_s": max(read)}


def run_server(start, model: Model, args: argparse.Namespace, sections: set[str]) -> dict | None:
    if not sections & {"ttft", "decode", "prefix"}:
        return {}
    ctx = max(max(args.sizes) + PREFIX_SUFFIX_WORDS if sections & {"ttft", "prefix"} else 0,
              DECODE_PROMPT_WORDS + args.tokens) + 64
    with tempfile.TemporaryDirectory(prefix="llmd-bench-served-") as tmp:
        server = start(model, args.threads, ctx, Path(tmp))
        if server is None:
            return None
        try:
            return asyncio.run(measure(server, model, sections, args.sizes, args.levels, args.tokens))
        finally:
            server.stop()


def table(results: dict, bw: dict | None) -> str:
    llmd, anchor = results["llmd"], results.get("llama.cpp")
    keys = list(llmd)
    lines = [f"{'':<22} {'llmd':>10} {'llama.cpp':>10} {'llmd/l.cpp':>10}"]
    for k in keys:
        unit = "s" if k.startswith("ttft") else "GB/s" if k.endswith("gb_s") else "tok/s"
        label = k.replace("_s", "").replace("_tok", "").replace("_gb", "")
        label = (f"TTFT shared prompt, {k.split('_')[2]}" if k.startswith("ttft_prefix") else
                 f"TTFT {label[5:]} tok ({unit})") if k.startswith("ttft") else (
            f"decode x{label.split('_')[1]} ({unit})" if "gb" not in k else "batch-1 moved (GB/s)")
        a = anchor.get(k) if anchor else None
        ratio = f"{llmd[k] / a:>10.2f}" if a else f"{'-':>10}"
        lines.append(f"{label:<22} {llmd[k]:>10.2f} {(f'{a:.2f}' if a else '-'):>10} {ratio}")
        if k == "decode_1_gb_s" and bw:
            pct = f"{100 * a / bw['triad_gb_s']:.0f}%" if a else "-"
            lines.append(f"{'  % of triad':<22} {100 * llmd[k] / bw['triad_gb_s']:>9.0f}% {pct:>10}")
    if bw:
        lines.append(f"machine: triad {bw['triad_gb_s']:.1f} GB/s, read {bw['read_gb_s']:.1f} GB/s")
    if anchor is None:
        lines.append(MISSING)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a GGUF file")
    ap.add_argument("--shape", default="1b", help="real_shapes.py shape, when no --model: 1b, 3b, 7b, 8b, 30b-a3b, "
                    "20b-oss, qwen35-4b, qwen35-9b, qwen35-35b-a3b")
    ap.add_argument("--type", default="Q4_K_M", help="with --shape: Q4_K_M, Q8_0, IQ4_XS, ...")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--sizes", default="512,2048,8192", help="TTFT prompt lengths in tokens")
    ap.add_argument("--levels", default="1,4,16", help="concurrent decode streams")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each decode stream generates")
    ap.add_argument("--out", type=Path, help="also write the results here (JSON)")
    args = ap.parse_args()
    args.sizes = [int(x) for x in args.sizes.split(",")]
    args.levels = [int(x) for x in args.levels.split(",")]
    sections = set(args.sections.split(","))
    if unknown := sections - set(SECTIONS):
        ap.error(f"--sections: unknown {', '.join(sorted(unknown))}; of {', '.join(SECTIONS)}")
    if args.model is None:
        from real_shapes import real_file

        args.model = real_file(args.shape, args.type)
    model = Model.read(args.model)
    bw = bandwidth(args.threads) if "bandwidth" in sections else None
    results: dict = {"llmd": run_server(start_llmd, model, args, sections)}
    anchor = run_server(start_llamacpp, model, args, sections)
    if anchor is not None:
        results["llama.cpp"] = anchor
    mib = model.state_bytes_per_token / 2**20
    state = f", recurrent state read and written {mib:.0f} MiB" if mib else ""
    print(f"{args.model.name}: {args.threads} threads, weights read per token {model.weight_bytes_per_token / GiB:.2f}"
          f" GiB{state} (ratios: TTFT lower is better for llmd, the rest higher)")
    print(table(results, bw))
    if args.out:
        args.out.write_text(json.dumps({"model": str(args.model), "threads": args.threads, "bandwidth": bw,
                                        **results}, indent=2))


if __name__ == "__main__":
    main()
