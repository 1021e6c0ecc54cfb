"""HTTP streaming latency of a running llmd daemon: p50/p99 TTFT and inter-token latency, aggregate tok/s, for 1, 8
and 32 concurrent streaming clients (closed loop: each client sends its next request when the last one ends).

    llmd serve &                      # or any OpenAI-compatible server
    python tests/benchmarks/bench_http.py --url http://127.0.0.1:8471 --requests 2 --max-tokens 32
    python tests/benchmarks/bench_http.py --levels 1 --requests 4 --max-tokens 64 --prompt-words 1500  # long prompts

Times are measured at the client, from sending the request to each SSE chunk that carries text. With --prompt-words
each request asks about its own document of that many words (a different first word each time, so no request reuses
another's cached prefix): TTFT is then mostly the prefill of that prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import aiohttp

PROMPTS = [
    "Explain what a hash map is in two sentences.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "List three uses of Python.",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
]


WORDS = ("river stone lantern market copper winter garden signal harbor engine paper mountain violet thunder "
         "silver orchard candle meadow bridge falcon").split()


def document(index: int, words: int) -> str:
    """A prompt of about `words` words that shares no first token with another index's."""
    rng = random.Random(index)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Document {index}: {body}\n\nSummarise document {index}."


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def one_stream(http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, headers: dict) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "temperature": 0.7, "ignore_eos": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    arrivals, tokens, prompt_tokens = [], 0, 0
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {(await r.text())[:200]}"}
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            prompt_tokens = (event.get("usage") or {}).get("prompt_tokens") or prompt_tokens
            choice = (event.get("choices") or [{}])[0]
            if choice.get("delta", {}).get("content"):
                arrivals.append(time.perf_counter())
            if choice.get("finish_reason"):
                tokens = (event.get("timings") or {}).get("generated_tokens") or len(arrivals)
    if not arrivals:
        return {"error": "no tokens"}
    return {"ttft": arrivals[0] - sent, "itl": [b - a for a, b in zip(arrivals, arrivals[1:])], "tokens": tokens,
            "prompt_tokens": prompt_tokens, "end": arrivals[-1]}


async def level(url: str, concurrency: int, requests_per_client: int, max_tokens: int, headers: dict,
                prompt_words: int = 0) -> dict:
    results: list[dict] = []
    salt = random.randrange(1 << 30)  # another run's documents are not in the prefix cache either

    async def client(i: int, http: aiohttp.ClientSession) -> None:
        for j in range(requests_per_client):
            prompt = document(salt + i * requests_per_client + j, prompt_words) if prompt_words \
                else PROMPTS[(i + j) % len(PROMPTS)]
            results.append(await one_stream(http, url, prompt, max_tokens, headers))

    conn = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] * 1000 for r in ok]
    itl = [x * 1000 for r in ok for x in r["itl"]]
    tokens = sum(r["tokens"] for r in ok)
    return {"concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(itl, 50),
            "itl_p99_ms": pct(itl, 99), "itl_mean_ms": statistics.fmean(itl) if itl else float("nan"),
            "tokens": tokens, "seconds": elapsed, "tok_per_s": tokens / elapsed,
            "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in ok) if ok else float("nan")}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8471")
    ap.add_argument("--levels", default="1,8,32", help="concurrency levels")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=0, help="long prompts: a document of this many words each")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows = []
    print(f"{'clients':>7} {'reqs':>5} {'err':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'tok/s':>7} {'prompt':>7}")
    for c in (int(x) for x in args.levels.split(",")):
        row = await level(args.url.rstrip("/"), c, args.requests, args.max_tokens, headers, args.prompt_words)
        rows.append(row)
        print(f"{c:>7} {row['requests']:>5} {row['errors']:>4} {row['ttft_p50_ms']:>7.0f}ms {row['ttft_p99_ms']:>7.0f}ms "
              f"{row['itl_p50_ms']:>6.1f}ms {row['itl_p99_ms']:>6.1f}ms {row['tok_per_s']:>7.1f} "
              f"{row['prompt_tokens_mean']:>7.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
