"""Several models in one daemon: time to first token of a cold model (its load included), and the TTFT of model B
idle against B while model A streams a long answer.

    python tests/benchmarks/bench_models.py [--requests 5] [--a-tokens 256] [--model-b PATH] [--b-code]

It starts its own `llmd serve` (temporary XDG folders, free port) with A = the bundled SmolLM2 (pinned) and
B = `--model-b` (a GGUF file or HF folder, served under the name "b" through the config; default: a copy of the
bundled SmolLM2 GGUF, so B is a real model of the same size but a separate engine and KV pool). Times are measured
at the client, from sending a request to its first SSE chunk with text. B's requests are short chats (greedy,
8 tokens), or with --b-code an editor's autocomplete: a ~300-token code prefix on /v1/completions, sent as
fill-in-the-middle (with a suffix) when model B has FIM tokens. A's is a 256-token stream that ignores EOS. Prints the
figures and the busy/idle ratio. (CPU engines step in turns, llmd.engine.turns: B waits at most one step of A.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from llmd_daemon_proc import start_daemon  # noqa: E402

PROMPT = [{"role": "user", "content": "Write one line of Python that adds two numbers."}]
CODE_PREFIX = "".join(f"def add_{i}(a: int, b: int) -> int:\n    \"\"\"Add two numbers ({i}).\"\"\"\n    return a + b\n\n\n"
                      for i in range(10)) + "def mul(a: int, b: int) -> int:\n    "
CODE_SUFFIX = "\n\n\nprint(mul(3, 4))\n"


class BRequest:
    """Model B's request: a short chat, or (code=True) an autocomplete, FIM when the model has the tokens."""

    def __init__(self, code: bool):
        self.code, self.fim = code, code

    def body(self, model: str, max_tokens: int) -> tuple[str, dict]:
        common = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        if not self.code:
            return "/v1/chat/completions", {**common, "messages": PROMPT}
        return "/v1/completions", {**common, "prompt": CODE_PREFIX, **({"suffix": CODE_SUFFIX} if self.fim else {})}


async def ttft(http: aiohttp.ClientSession, model: str, max_tokens: int, kind: BRequest) -> float:
    path, body = kind.body(model, max_tokens)
    sent = time.perf_counter()
    first = None
    async with http.post(path, json=body) as r:
        if r.status == 400 and kind.fim and "fill-in-the-middle" in await r.text():
            kind.fim = False  # model B has no FIM tokens: the same prefix as a plain completion
            return await ttft(http, model, max_tokens, kind)
        assert r.status == 200, await r.text()
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                if choice.get("delta", {}).get("content") or choice.get("text"):
                    first = time.perf_counter()
    assert first is not None, "no token"
    return first - sent


async def long_stream(http: aiohttp.ClientSession, tokens: int, started: asyncio.Event) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a dragon."}], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0.7, "seed": 1, "stream": True}
    async with http.post("/v1/chat/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                started.set()


async def unload(http: aiohttp.ClientSession, model: str) -> None:
    async with http.post("/api/generate", json={"model": model, "keep_alive": 0}) as r:
        assert r.status == 200, await r.text()


async def measure(url: str, requests: int, a_tokens: int, kind: BRequest) -> dict:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(url, timeout=timeout) as http:
        cold = []
        for _ in range(max(1, requests // 2)):
            await unload(http, "b")
            cold.append(await ttft(http, "b", 8, kind))
        idle = [await ttft(http, "b", 8, kind) for _ in range(requests)]
        busy = []
        for _ in range(requests):
            started = asyncio.Event()
            a = asyncio.create_task(long_stream(http, a_tokens, started))
            await started.wait()
            await asyncio.sleep(0.3)  # A is decoding
            busy.append(await ttft(http, "b", 8, kind))
            assert not a.done(), "A's answer ended before B's first token: raise --a-tokens"
            a.cancel()
            await asyncio.gather(a, return_exceptions=True)
            await asyncio.sleep(0.5)
    return {"cold": cold, "idle": idle, "busy": busy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--a-tokens", type=int, default=256)
    ap.add_argument("--model-b", type=Path, default=None)
    ap.add_argument("--b-code", action="store_true", help="B sends an autocomplete (FIM when it can), not a chat")
    args = ap.parse_args()
    from llmd.store import bundled_model_path

    with tempfile.TemporaryDirectory(prefix="llmd-bench-models-") as tmp:
        base = Path(tmp)
        model_b = args.model_b
        if model_b is None:
            model_b = base / "b.gguf"
            shutil.copyfile(bundled_model_path(), model_b)
        (base / "config" / "llmd").mkdir(parents=True)
        (base / "config" / "llmd" / "config.toml").write_text(f'[models.b]\npath = "{model_b}"\n')
        d = start_daemon(base, "--kv-cache-bytes", str(64 * 2**20))
        try:
            kind = BRequest(args.b_code)
            r = asyncio.run(measure(d.url, args.requests, args.a_tokens, kind))
        finally:
            d.stop()
    med = {k: statistics.median(v) * 1000 for k, v in r.items()}
    print(f"model A: bundled SmolLM2 (pinned); model B: {args.model_b or 'a copy of the bundled SmolLM2 GGUF'}")
    print("B's requests: " + ("short chats" if not kind.code else "FIM completions" if kind.fim
                              else "code completions (~300-token prefix; model B has no FIM tokens)"))
    labels = {"cold": "cold B, load + first token", "idle": "B idle, first token", "busy": "B while A streams"}
    for key, label in labels.items():
        each = ", ".join(f"{x * 1000:.0f}" for x in r[key])
        print(f"{label:<28} median {med[key]:8.1f} ms   ({each})")
    print(f"busy / idle                  {med['busy'] / med['idle']:.2f}x  (target: <= 2x)")


if __name__ == "__main__":
    main()
