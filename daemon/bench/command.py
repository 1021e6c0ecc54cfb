"""`llmd bench`: build the workload, run it (one level, a sweep, or a comparison), then print/write the report."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .client import BenchClient, BenchError
from .compare import compare, comparison, render_comparison
from .report import PlotUnavailable, Slo, render, summarize, write_plots
from .runner import LoadLevel, parse_levels, run_sweep
from .workloads import load_prompts_file, make_workload

DEFAULT_PORT = 8471


def default_url() -> str:
    """The local daemon, as llmd's settings place it (falls back to the default port)."""
    try:
        from ..config import load_settings  # optional: settings may name another host/port
        settings = load_settings()
        host = settings.host if settings.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"http://{host}:{settings.port}"
    except Exception:  # noqa: BLE001 - no settings module or a bad config file: the built-in default will do
        return f"http://127.0.0.1:{DEFAULT_PORT}"


@dataclass
class BenchOptions:
    url: str | None = None
    model: str | None = None
    api: str = "chat"
    api_key: str | None = None
    workload: str = "chat"
    prompts_file: str | None = None
    requests: int | None = None
    duration_s: float | None = None
    concurrency: int = 1
    rate: float | None = None
    sweep: str | None = None
    max_tokens: int = 64
    prompt_words: int | None = None
    seed: int = 0
    slo: Slo = field(default_factory=Slo)
    json_path: str | None = None
    plot_dir: str | None = None
    compare: tuple[str, str] | None = None
    rounds: int = 4
    timeout_s: float = 300.0
    progress: bool | None = None


def _levels(opts: BenchOptions) -> list[LoadLevel]:
    open_loop = opts.rate is not None
    if opts.sweep:
        values = parse_levels(opts.sweep, integer=not open_loop)
        return [LoadLevel("open", rate=v) if open_loop else LoadLevel("closed", concurrency=int(v)) for v in values]
    if open_loop:
        return [LoadLevel("open", rate=opts.rate)]
    return [LoadLevel("closed", concurrency=opts.concurrency)]


def _workload(opts: BenchOptions, count: int):
    if opts.prompts_file:
        return load_prompts_file(opts.prompts_file, max_tokens=opts.max_tokens)
    return make_workload(opts.workload, count, seed=opts.seed, max_tokens=opts.max_tokens,
                         prompt_words=opts.prompt_words)


def _client(opts: BenchOptions, url: str) -> BenchClient:
    return BenchClient(url, api=opts.api, model=opts.model, api_key=opts.api_key, timeout_s=opts.timeout_s)


async def _run(opts: BenchOptions, out) -> int:
    progress = sys.stderr.isatty() if opts.progress is None else opts.progress
    levels = _levels(opts)
    if opts.requests is None and opts.duration_s is None:
        opts.requests = 32 if len(levels) == 1 else 16
    workload = _workload(opts, max(opts.requests or 0, 256 if opts.duration_s else 1))

    if opts.compare:
        url_a, url_b = opts.compare
        if len(levels) != 1:
            raise BenchError("--compare runs one load level: drop --sweep")
        async with _client(opts, url_a) as a, _client(opts, url_b) as b:
            await a.probe()
            await b.probe()
            pieces = workload[:opts.requests] if opts.requests else workload
            run_a, run_b = await compare(a, b, pieces, levels[0], rounds=opts.rounds, seed=opts.seed,
                                         progress=progress)
        result = comparison(run_a, run_b, opts.slo)
        if opts.json_path:
            _write_json(opts.json_path, {"compare": {"a": url_a, "b": url_b}, **result}, out)
        if opts.json_path != "-":
            print(render_comparison(result, url_a, url_b), file=out)
        failed = not result["a"]["requests"]["ok"] or not result["b"]["requests"]["ok"]
        return 1 if failed else 0

    url = opts.url or default_url()
    async with _client(opts, url) as client:
        await client.probe()
        with _first_ctrl_c_stops() as stop:
            runs = await run_sweep(client, workload, levels, num_requests=opts.requests,
                                   duration_s=opts.duration_s, seed=opts.seed, progress=progress, stop=stop)
        model, is_llmd = client.model, client.is_llmd
    summaries = [summarize(run, opts.slo) for run in runs]
    header = (f"llmd bench  {str(client.base).rstrip('/')}  model {model}  workload "
              f"{'file ' + opts.prompts_file if opts.prompts_file else opts.workload}  "
              f"api {opts.api}{'  (llmd)' if is_llmd else ''}")
    if opts.json_path:
        _write_json(opts.json_path, {
            "url": str(client.base), "model": model, "server_is_llmd": is_llmd, "api": opts.api,
            "workload": opts.prompts_file or opts.workload, "max_tokens": opts.max_tokens, "seed": opts.seed,
            "levels": summaries,
            "requests": [[r.to_dict() for r in run.results] for run in runs],
        }, out)
    if opts.json_path != "-":
        print(render(summaries, header + "\n"), file=out)
    if opts.plot_dir:
        try:
            paths = write_plots(runs, summaries, opts.plot_dir)
            print("plots: " + ", ".join(str(p) for p in paths), file=sys.stderr)
        except PlotUnavailable as exc:
            print(f"warning: {exc}", file=sys.stderr)
    stopped = [run.stopped for run in runs if run.stopped and run.stopped != "interrupted"]
    if stopped:
        print(f"error: {stopped[0]}", file=sys.stderr)
        return 1
    if not any(run.ok for run in runs):
        print("error: no request succeeded", file=sys.stderr)
        return 1
    return 0


class _first_ctrl_c_stops:
    """First Ctrl-C: send no new request, let those in flight finish, report what was measured. Second: abandon."""

    def __enter__(self) -> asyncio.Event:
        self.event = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        try:
            self.loop.add_signal_handler(signal.SIGINT, self._first)
            self.installed = True
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            self.installed = False
        return self.event

    def _first(self) -> None:
        print("\ninterrupted: finishing the requests in flight (Ctrl-C again to abandon them)", file=sys.stderr)
        self.event.set()
        self.loop.remove_signal_handler(signal.SIGINT)

    def __exit__(self, *exc) -> None:
        if self.installed and not self.event.is_set():
            self.loop.remove_signal_handler(signal.SIGINT)


def _write_json(path: str, data: dict, out) -> None:
    text = json.dumps(data, indent=2, default=lambda x: None if x != x else str(x))
    if path == "-":
        print(text, file=out)
    else:
        Path(path).write_text(text + "\n", encoding="utf-8")


def run_bench(opts: BenchOptions, out=None) -> int:
    """Run the benchmark the options describe; returns the exit code. User errors raise BenchError/LlmdError."""
    return asyncio.run(_run(opts, out or sys.stdout))
