"""llmd bench against an in-test OpenAI-compatible server with injected delays (real sleeps, reported through an
llmd-style `timings` object): the diagnosis must name the injected stage; errors must be clear and keep results."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest
from aiohttp import web

from llmd.bench.client import BenchClient, BenchError, normalize_base_url
from llmd.bench.command import BenchOptions, run_bench
from llmd.bench.compare import compare, comparison, render_comparison
from llmd.bench.report import Slo, diagnose, render, summarize, write_plots
from llmd.bench.runner import LoadLevel, parse_levels, run_level, run_sweep
from llmd.bench.workloads import WorkloadError, load_prompts_file, make_workload


from pathlib import Path

LLMD = str(Path(sys.executable).parent / "llmd")


@dataclass
class Behaviour:
    queue_s: float = 0.002
    prefill_s: float = 0.004
    decode_s: float = 0.002      # per token
    network_s: float = 0.0       # before the response starts, outside the reported timings
    tokens: int = 4
    timings: bool = True         # report llmd's timings object and /v1/llmd/stats
    fail_after: int | None = None  # requests served fine before failures start
    fail_mode: str = "http"      # http (500), midstream (error event), cut (connection dropped)


class FakeServer:
    """Speaks the OpenAI streaming contract; stages are real sleeps, measured and reported as llmd would."""

    def __init__(self, behaviour: Behaviour):
        self.b = behaviour
        self.served = 0
        self.counters = {"requests_finished_total": 0, "prompt_tokens_total": 0, "generation_tokens_total": 0,
                         "prefix_cache_queries_tokens": 0, "prefix_cache_hits_tokens": 0,
                         "spec_proposed_total": 0, "spec_accepted_total": 0}
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None
        self.port = 0

    # --- handlers
    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def stats(self, request):
        if not self.b.timings:
            return web.json_response({"error": "not found"}, status=404)
        c = self.counters  # served in llmd's schema (llmd/tui/top_app.py): KV and speculation counters nested
        return web.json_response({
            "model": "fake-model", "uptime_s": 1.0, "requests_finished_total": c["requests_finished_total"],
            "prompt_tokens_total": c["prompt_tokens_total"], "generation_tokens_total": c["generation_tokens_total"],
            "kv": {"prefix_queries_tokens": c["prefix_cache_queries_tokens"],
                   "prefix_hits_tokens": c["prefix_cache_hits_tokens"]},
            "spec": {"proposed_total": c["spec_proposed_total"], "accepted_total": c["spec_accepted_total"]}})

    async def complete(self, request):
        body = await request.json()
        chat = "messages" in body
        number = self.served
        self.served += 1
        failing = self.b.fail_after is not None and number >= self.b.fail_after
        if failing and self.b.fail_mode == "http":
            return web.json_response({"error": {"message": "engine exploded", "type": "server_error"}}, status=500)
        await asyncio.sleep(self.b.network_s)
        arrival = time.perf_counter()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.b.queue_s)
        scheduled = time.perf_counter()
        await asyncio.sleep(self.b.prefill_s)
        prompt_tokens = len(json.dumps(body.get("messages") or body.get("prompt")).split())
        tokens = min(self.b.tokens, body["max_tokens"])
        first = None
        for i in range(tokens):
            if i:
                await asyncio.sleep(self.b.decode_s)
            first = first or time.perf_counter()
            if failing and i == 1:
                if self.b.fail_mode == "cut":
                    request.transport.close()
                    return resp
                await resp.write(b'data: {"error": {"message": "out of memory"}}\n\n')
                return resp
            piece = {"delta": {"content": f"w{i} "}} if chat else {"text": f"w{i} "}
            await resp.write(f"data: {json.dumps({'choices': [{'index': 0, **piece, 'finish_reason': None}]})}\n\n"
                             .encode())
        end = time.perf_counter()
        ms = lambda a, b: (b - a) * 1000  # noqa: E731
        final = {"choices": [{"index": 0, "delta": {}, "text": "", "finish_reason": "length"}],
                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                           "total_tokens": prompt_tokens + tokens, "prompt_tokens_details": {"cached_tokens": 2}}}
        if self.b.timings:
            final["timings"] = {
                "queue_ms": ms(arrival, scheduled), "prefill_ms": ms(scheduled, first), "ttft_ms": ms(arrival, first),
                "decode_ms": ms(first, end), "tpot_ms": ms(first, end) / max(1, tokens - 1),
                "e2e_ms": ms(arrival, end), "prompt_tokens": prompt_tokens, "cached_prompt_tokens": 2,
                "generated_tokens": tokens, "tokens_per_second": 0.0, "spec_proposed": 4, "spec_accepted": 3}
        await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        c = self.counters
        c["requests_finished_total"] += 1
        c["prompt_tokens_total"] += prompt_tokens
        c["generation_tokens_total"] += tokens
        c["prefix_cache_queries_tokens"] += prompt_tokens
        c["prefix_cache_hits_tokens"] += 2
        c["spec_proposed_total"] += 4
        c["spec_accepted_total"] += 3
        return resp

    # --- lifecycle: its own loop in a thread, so both the async API and the sync CLI path can use it
    def start(self) -> "FakeServer":
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/llmd/stats", self.stats)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_post("/v1/completions", self.complete)
        ready = threading.Event()

        async def boot():
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()

        self.thread = threading.Thread(target=self._serve, args=(boot,), daemon=True)
        self.thread.start()
        assert ready.wait(10)
        return self

    def _serve(self, boot):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(boot())
        self.loop.run_forever()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def fake_server():
    servers = []

    def make(**kw) -> FakeServer:
        servers.append(FakeServer(Behaviour(**kw)).start())
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def bench(url: str, level=LoadLevel("closed", concurrency=2), n=4, api="chat", **kw):
    workload = make_workload("chat", n or 16, seed=1, max_tokens=8)
    async with BenchClient(url, api=api) as client:
        await client.probe()
        return await run_level(client, workload, level, num_requests=n, **kw)


# --- workloads -------------------------------------------------------------------------------------------------

def test_workloads_are_seeded_and_shaped():
    assert make_workload("chat", 5, seed=3) == make_workload("chat", 5, seed=3)
    assert make_workload("chat", 5, seed=3) != make_workload("chat", 5, seed=4)
    shared = make_workload("shared-prefix", 4, seed=0)
    systems = {r.messages[0]["content"] for r in shared}
    assert len(systems) == 1 and len(next(iter(systems)).split()) > 300
    assert len({r.messages[1]["content"] for r in shared}) > 1
    long = make_workload("long-prompt", 2, prompt_words=400)
    assert all(len(r.messages[0]["content"].split()) >= 300 for r in long)
    code = make_workload("code-edit", 2, max_tokens=128)[0]
    assert "def " in code.messages[0]["content"] and code.max_tokens == 128
    chat = make_workload("chat", 20, max_tokens=40)
    assert all(20 <= r.max_tokens <= 40 for r in chat) and len({r.max_tokens for r in chat}) > 1
    with pytest.raises(WorkloadError, match="unknown workload"):
        make_workload("nonsense", 3)


def test_prompts_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello"}\n\n# comment\n{"messages": [{"role": "user", "content": "hi"}], '
                 '"max_tokens": 5}\n"plain string"\n')
    reqs = load_prompts_file(f, max_tokens=9)
    assert [r.max_tokens for r in reqs] == [9, 5, 9]
    assert reqs[0].chat_messages() == [{"role": "user", "content": "hello"}]
    assert reqs[1].completion_prompt().startswith("user: hi")
    f.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(WorkloadError, match=r"p.jsonl:2: not valid JSON"):
        load_prompts_file(f)
    f.write_text('{"messages": "nope"}\n')
    with pytest.raises(WorkloadError, match="messages"):
        load_prompts_file(f)
    with pytest.raises(WorkloadError, match="does not exist"):
        load_prompts_file(tmp_path / "missing.jsonl")


def test_parse_levels():
    assert parse_levels("1..16", integer=True) == [1, 2, 4, 8, 16]
    assert parse_levels("1..12", integer=True) == [1, 2, 4, 8, 12]
    assert parse_levels("0.5,1,2", integer=False) == [0.5, 1.0, 2.0]
    for bad in ("", "a,b", "4..1", "0,1", "1.5,2"):
        with pytest.raises(BenchError):
            parse_levels(bad, integer=True)


def test_url_normalisation():
    assert str(normalize_base_url("localhost:8000/v1")) == "http://localhost:8000/"
    assert str(normalize_base_url("https://h/api/v1/")) == "https://h/api"
    for bad in ("ftp://x", "http://", "   ", "http://h:99999"):
        with pytest.raises(BenchError, match="URL"):
            normalize_base_url(bad)


# --- diagnosis on injected delays ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stage,inject", [
    ("queue", {"queue_s": 0.12}),
    ("prefill", {"prefill_s": 0.12}),
    ("decode", {"decode_s": 0.04}),
    ("overhead", {"network_s": 0.12}),
])
async def test_diagnosis_names_the_injected_stage(fake_server, stage, inject):
    server = fake_server(**inject)
    run = await bench(server.url)
    summary = summarize(run)
    diag = summary["diagnosis"]
    assert diag["basis"] == "server timings"
    assert diag["stage"] == stage, diag
    assert diag["share"] > 0.5
    text = render([summary])
    assert f"{stage} dominates" in text and "--" in text  # a remedy naming flags


async def test_client_only_diagnosis_without_llmd_timings(fake_server):
    slow_first = await bench(fake_server(timings=False, prefill_s=0.1).url)
    assert slow_first.stats_before is None
    diag = diagnose(slow_first.ok)
    assert diag["basis"] == "client timings" and diag["stage"] == "first_token"
    slow_decode = await bench(fake_server(timings=False, decode_s=0.04).url)
    assert diagnose(slow_decode.ok)["stage"] == "decode"
    assert summarize(slow_decode)["server_ms"] is None


async def test_report_numbers_agree_with_server(fake_server):
    server = fake_server(decode_s=0.01, tokens=5)
    run = await bench(server.url, n=6, api="completions")
    s = summarize(run, Slo(ttft_ms=1000, tpot_ms=1000))
    assert s["requests"] == {"sent": 6, "ok": 6, "failed": 0, "dropped": 0}
    expected = sum(min(5, r.max_tokens) for r in make_workload("chat", 6, seed=1, max_tokens=8))
    assert s["tokens"]["completion"] == server.counters["generation_tokens_total"] == expected
    assert s["tokens"]["prompt"] == server.counters["prompt_tokens_total"]
    assert s["server_counters"]["requests_finished"] == 6
    assert s["prefix_hit_rate"] == pytest.approx(12 / server.counters["prefix_cache_queries_tokens"])
    assert s["spec_acceptance"] == pytest.approx(0.75)
    assert s["goodput"]["good"] == 6
    lat = s["latency_ms"]
    # client sees at least what the server measured, and TPOT reflects the injected 10 ms per token
    assert lat["ttft"]["p50"] >= s["server_ms"]["ttft"]["p50"]
    assert lat["e2e"]["p50"] >= s["server_ms"]["e2e"]["p50"]
    assert 8 <= lat["tpot"]["p50"] <= 40
    assert lat["itl"]["n"] == expected - 6
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(expected / run.wall_s)
    strict = summarize(run, Slo(ttft_ms=None, tpot_ms=1.0))
    assert strict["goodput"]["good"] == 0


async def test_open_loop_and_duration(fake_server):
    server = fake_server()
    start = time.perf_counter()
    run = await bench(server.url, level=LoadLevel("open", rate=40.0), n=8, seed=2)
    assert len(run.ok) == 8 and run.level.label == "r=40/s"
    assert 0.05 < time.perf_counter() - start < 3
    timed = await bench(server.url, level=LoadLevel("closed", concurrency=2), n=None, duration_s=0.3)
    assert len(timed.ok) >= 4 and timed.wall_s < 1.5


# --- errors: clear messages, partial results kept -----------------------------------------------------------------

async def test_unreachable_server_and_bad_urls():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BenchError, match="cannot reach .*connection refused.*llmd serve"):
        await bench(url)
    with pytest.raises(BenchError, match="scheme"):
        BenchClient("ftp://nowhere")


@pytest.mark.parametrize("mode,message", [
    ("http", "HTTP 500: engine exploded"),
    ("midstream", "error mid-stream: out of memory"),
    ("cut", "closed the connection|broke off|ended before"),
])
async def test_errors_mid_run_keep_partial_results(fake_server, mode, message):
    server = fake_server(fail_after=3, fail_mode=mode)
    run = await bench(server.url, level=LoadLevel("closed", concurrency=1), n=30)
    assert len(run.ok) == 3
    assert run.stopped and "in a row" in run.stopped
    assert len(run.failed) < 27  # it stopped early instead of hammering a broken server
    s = summarize(run)
    assert s["requests"]["ok"] == 3 and s["latency_ms"]["e2e"]["n"] == 3
    assert re.search(message, s["errors"][0]["error"]), s["errors"]
    assert "results so far are kept" in render([s])


def test_cli_path_json_plots_and_exit_codes(fake_server, tmp_path, capsys):
    server = fake_server(decode_s=0.005)
    out_json = tmp_path / "r.json"
    opts = BenchOptions(url=server.url + "/v1", requests=3, sweep="1,2", max_tokens=4, json_path=str(out_json),
                        plot_dir=str(tmp_path / "plots"), progress=True)
    assert run_bench(opts) == 0
    captured = capsys.readouterr()
    assert "sweep" in captured.out and "c=2" in captured.out and "dominant" in captured.out
    assert "req/s" in captured.err  # the progress bar
    data = json.loads(out_json.read_text())
    assert [lvl["level"] for lvl in data["levels"]] == ["c=1", "c=2"]
    assert data["server_is_llmd"] and data["model"] == "fake-model"
    assert len(data["requests"][1]) == 3
    for name in ("latency_cdf.png", "throughput_latency.png", "stages.png"):
        png = tmp_path / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000

    broken = fake_server(fail_after=1)
    assert run_bench(BenchOptions(url=broken.url, requests=20, progress=False)) == 1
    captured = capsys.readouterr()
    assert "1 ok, " in captured.out and "error: stopped after" in captured.err


def test_plots_missing_matplotlib_is_clear(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    from llmd.bench.report import PlotUnavailable
    with pytest.raises(PlotUnavailable, match=r"llmd\[plot\]"):
        write_plots([], [], tmp_path)


async def test_compare_two_endpoints(fake_server):
    fast, slow = fake_server(decode_s=0.002), fake_server(decode_s=0.03)
    workload = make_workload("chat", 6, max_tokens=6)
    async with BenchClient(fast.url) as a, BenchClient(slow.url) as b:
        await a.probe()
        await b.probe()
        run_a, run_b = await compare(a, b, workload, LoadLevel("closed", concurrency=2), rounds=3)
    assert len(run_a.ok) == len(run_b.ok) == 6
    assert fast.served == slow.served == 6
    result = comparison(run_a, run_b, Slo())
    tpot = next(r for r in result["ratios"] if r["metric"] == "TPOT p50 ms")
    assert tpot["ratio_b_over_a"] > 3
    text = render_comparison(result, fast.url, slow.url)
    assert "A better" in text and "B/A" in text


async def test_sweep_stops_when_server_is_gone(fake_server):
    server = fake_server(fail_after=0)
    async with BenchClient(server.url) as client:
        await client.probe()
        runs = await run_sweep(client, make_workload("chat", 4), [LoadLevel("closed", concurrency=c) for c in (1, 2)],
                               num_requests=20, max_consecutive_errors=3)
    assert len(runs) == 1 and not runs[0].ok and len(runs[0].failed) == 3


def test_unreachable_port_is_one_clear_line(tmp_path):
    proc = subprocess.run([LLMD, "bench", "--url", f"127.0.0.1:{free_port()}", "-n", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "cannot reach" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_ctrl_c_stops_sending_and_reports_partial_results(fake_server):
    import signal

    server = fake_server(decode_s=0.05, tokens=4)
    proc = subprocess.Popen([LLMD, "bench", "--url", server.url, "-n", "400", "-c", "2", "--max-tokens", "4",
                             "--progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while server.served < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert b"interrupted: finishing the requests in flight" in err
    ok = int(re.search(rb"load c=2: (\d+) ok, 0 failed", out).group(1))
    assert 4 <= ok < 400 and ok == server.counters["requests_finished_total"]
    assert b"decode dominates" in out


def test_cli_compare_with_user_prompts(fake_server, tmp_path, capsys):
    a, b = fake_server(prefill_s=0.002), fake_server(prefill_s=0.06)
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"question {i}", "max_tokens": 3}) for i in range(4)) + "\n")
    out_json = tmp_path / "cmp.json"
    code = run_bench(BenchOptions(compare=(a.url, b.url), prompts_file=str(prompts), requests=4, concurrency=2,
                                  api="completions", json_path=str(out_json), progress=False))
    assert code == 0
    text = capsys.readouterr().out
    assert f"A = {a.url}" in text and "TTFT p50 ms" in text and "A better" in text
    data = json.loads(out_json.read_text())
    ttft = next(r for r in data["ratios"] if r["metric"] == "TTFT p50 ms")
    assert ttft["ratio_b_over_a"] > 2
    assert a.served == b.served == 4 and data["a"]["tokens"]["completion"] == 12
