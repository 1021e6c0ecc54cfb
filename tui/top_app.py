"""`llmd top`: a live view of the daemon from /v1/llmd/stats (pushed once a second over SSE), one panel per loaded
model.

TopView is one widget, used both by the standalone TopApp and by a screen inside `llmd chat`. The TUI reads the
stats as JSON (it never imports the engine); this is the schema, served by llmd.server.core.ServerState.stats:

    status, pid, uptime_s, load_seconds   the daemon
    server                                counters over every model: aborts, finished, http_responses,
                                          rejected_queue_full
    memory_budget_bytes                   weights + KV caches of all loaded models
    models: [MODEL]                       one per loaded model
    model, ENGINE...                      the most recently used model's name and its ENGINE fields at the top level,
                                          requests_running / requests_waiting summed over `models` (for readers of
                                          one model; a daemon without `models` serves only this)

    MODEL   name, source, pinned, size, weight_bytes, kv_cache_bytes, size_vram, expires_at, active_requests,
            load_seconds, host_weight_bytes (weights kept in host memory beside a GPU, outside size), stats: ENGINE
    ENGINE  dataclasses.asdict(llmd.engine.types.EngineStats):
            requests_running, requests_waiting, requests_finished_total, prompt_tokens_total,
            generation_tokens_total, num_preemptions, steps_total, last_batch_size, last_step_tokens,
            tokens_per_second, engine_alive, engine_error, remote_url (a remote model's server, else null),
            threads (the CPU threads its steps compute with; null on a GPU or remote),
            kv: {dtype, block_size, bytes_per_token, cache_bytes, blocks_total, blocks_used, blocks_cached,
                 blocks_free, seqs_8k_by_dtype: {fp32, fp16, bf16, int8}, prefix_queries_tokens,
                 prefix_hits_tokens, prefix_hit_rate, prefix_evictions, window_blocks_total, window_blocks_used,
                 window_blocks_cached (a model with sliding-window layers, else null)} or null (a remote model),
            spec: {mode, proposed_total, accepted_total, drafts_total, acceptance_rate, mean_accepted_length}
                  or null (speculation off),
            latency: {queue_ms, prefill_ms, ttft_ms, decode_ms, tpot_ms, e2e_ms: {p50, p90, p99}}
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import aclosing
from typing import Any, AsyncGenerator, cast

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, Header, Sparkline, Static

from .client import DaemonClient, DaemonError, DaemonUnavailable

HISTORY_SECONDS = 300  # sparklines cover the last five minutes at one sample a second
BAR_WIDTH = 30
STAGES = ("queue_ms", "prefill_ms", "decode_ms")
SERIES = ("tokens_per_second", "requests_running", "requests_waiting", "last_batch_size", *STAGES)
CHARTS = (
    ("tokens_per_second", "tokens/s"), ("last_batch_size", "batch size per step"),
    ("requests_running", "running"), ("requests_waiting", "waiting"),
    ("queue_ms", "queue p50 ms"), ("prefill_ms", "prefill p50 ms"), ("decode_ms", "decode p50 ms"),
)
# summed over the loaded models for the daemon's line and the charts
SUMMED = ("tokens_per_second", "last_batch_size", "requests_running", "requests_waiting", "requests_finished_total",
          "steps_total")


def p50(stats: dict[str, Any], stage: str) -> float:
    value = ((stats.get("latency") or {}).get(stage) or {}).get("p50")
    return float(value) if value is not None else 0.0


def loaded_models(stats: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, ENGINE) for each loaded model; a daemon without a `models` list serves one, at the top level."""
    if "models" in stats:
        return [(str(m.get("name", "?")), m.get("stats") or {}) for m in stats["models"] or []]
    return [(str(stats.get("model", "?")), stats)] if stats else []


def totals(stats: dict[str, Any]) -> dict[str, Any]:
    """The charted sample: request counts and throughput summed over the loaded models, latency of the top one."""
    engines = [engine for _, engine in loaded_models(stats)]
    out = dict(stats)
    for name in SUMMED:
        out[name] = sum(e.get(name) or 0 for e in engines)
    return out


class StatsHistory:
    """The last HISTORY_SECONDS samples of each plotted series (bounded)."""

    def __init__(self, maxlen: int = HISTORY_SECONDS):
        self.series: dict[str, deque[float]] = {name: deque(maxlen=maxlen) for name in SERIES}
        self.latest: dict[str, Any] = {}

    def add(self, stats: dict[str, Any]) -> None:
        self.latest = stats
        sample = totals(stats)
        for name in SERIES:
            value = p50(sample, name) if name in STAGES else sample.get(name) or 0
            self.series[name].append(float(value))


def stage_split(stats: dict[str, Any]) -> dict[str, float]:
    """Each stage's share of queue+prefill+decode (p50), so the dominant one stands out."""
    values = {stage: p50(stats, stage) for stage in STAGES}
    total = sum(values.values())
    return {stage: (v / total if total else 0.0) for stage, v in values.items()}


def split_bar(split: dict[str, float], width: int) -> str:
    """A one-line stacked bar in Rich markup: queue / prefill / decode."""
    if not any(split.values()):
        return "·" * width
    colours = {"queue_ms": "yellow", "prefill_ms": "cyan", "decode_ms": "magenta"}
    cells = {stage: round(split[stage] * width) for stage in STAGES[:-1]}
    cells[STAGES[-1]] = max(width - sum(cells.values()), 0)  # rounding never overflows the bar
    return "".join(f"[{colours[s]}]{'█' * cells[s]}[/]" for s in STAGES)


def kv_bar(kv: dict[str, Any], width: int) -> str:
    """Used (held by live sequences), cached (evictable prefix blocks, counted within free) and plain free."""
    total = kv.get("blocks_total") or 0
    if not total:
        return "·" * width
    used = round((kv.get("blocks_used") or 0) / total * width)
    cached = min(round((kv.get("blocks_cached") or 0) / total * width), width - used)
    return f"[red]{'█' * used}[/][blue]{'▓' * cached}[/][green]{'░' * (width - used - cached)}[/]"


def model_panel(name: str, s: dict[str, Any], width: int = BAR_WIDTH) -> str:
    """One loaded model: its requests, its KV pool (dtype, blocks, 8k-token sequences that fit) and latency split."""
    spec = s.get("spec") or {}
    accept = f" · spec accept [b]{100 * spec.get('acceptance_rate', 0):.0f}%[/]" if spec.get("proposed_total") else ""
    dead = "" if s.get("engine_alive", True) else f"  [red]engine failed: {s.get('engine_error')}[/]"
    lines = [
        f"[b]{name}[/]{dead}   running [b]{s.get('requests_running', 0)}[/] · waiting [b]{s.get('requests_waiting', 0)}"
        f"[/] · tok/s [b]{s.get('tokens_per_second') or 0:.1f}[/] · batch [b]{s.get('last_batch_size', 0)}[/] · "
        f"preemptions [b]{s.get('num_preemptions', 0)}[/]{accept}"
    ]
    kv = s.get("kv")
    if kv:
        by_dtype = kv.get("seqs_8k_by_dtype") or {}
        lines.append(
            f"KV blocks  {kv_bar(kv, width)}  [red]used[/] [b]{kv.get('blocks_used', 0)}[/] · [blue]cached[/] "
            f"[b]{kv.get('blocks_cached', 0)}[/] · free [b]{kv.get('blocks_free', 0)}[/] / {kv.get('blocks_total', 0)}"
            f"   prefix hit [b]{100 * (kv.get('prefix_hit_rate') or 0):.0f}%[/]")
        lines.append(
            f"KV [b]{kv.get('dtype', '?')}[/]    {kv.get('bytes_per_token', 0)} bytes/token · 8k-token sequences "
            f"that fit: [b]{by_dtype.get(kv.get('dtype'), '?')}[/] ("
            + ", ".join(f"{kind} {n}" for kind, n in by_dtype.items()) + ")")
    elif s.get("remote_url"):
        lines.append(f"remote     {s['remote_url']}")
    split = stage_split(s)
    dominant = max(split, key=lambda k: split[k]) if any(split.values()) else None
    lines.append(f"latency    {split_bar(split, width)}  " + "  ".join(f"{st[:-3]} {p50(s, st):.0f} ms" for st in STAGES)
                 + (f"   [b]{dominant[:-3]} dominates[/]" if dominant else ""))
    return "\n".join(lines)


class TopView(Widget):
    """The dashboard. `live=True` follows the daemon's stats stream; tests may feed `show(stats)` directly."""

    DEFAULT_CSS = """
    TopView { height: 1fr; padding: 0 1; }
    TopView #top-status { height: 1; color: $text-muted; }
    TopView .panel { border: round $primary; height: auto; padding: 0 1; }
    TopView Grid { grid-size: 2; grid-gutter: 0 1; height: auto; }
    TopView .chart { height: 5; border: round $secondary; padding: 0 1; }
    TopView .chart Sparkline { height: 3; }
    TopView .chart Static { height: 1; }
    """

    def __init__(self, client: DaemonClient | None, live: bool = True, **kwargs: Any):
        super().__init__(**kwargs)
        self.client = client
        self.live = live
        self.history = StatsHistory()

    def compose(self) -> ComposeResult:
        yield Static("connecting…", id="top-status")
        with Horizontal(classes="panel", id="numbers-panel"):
            yield Static(id="numbers")
        yield Vertical(id="models")
        with Grid():
            for name, title in CHARTS:
                with Vertical(classes="chart"):
                    yield Static(title, id=f"title-{name}")
                    yield Sparkline([], id=f"spark-{name}")

    def on_mount(self) -> None:
        if self.live and self.client is not None:
            self.run_worker(self._follow(), exclusive=True, group="stats")

    async def _follow(self) -> None:
        """Follow the stats stream; reconnect when the daemon goes away and comes back."""
        assert self.client is not None
        while True:
            try:
                events = cast(AsyncGenerator[dict[str, Any], None], self.client.stats_stream())
                async with aclosing(events) as stream:
                    async for stats in stream:
                        try:
                            self.show(stats)
                        except NoMatches:
                            return  # the view is being torn down (screen closed, app quitting)
            except (DaemonUnavailable, DaemonError) as exc:
                try:
                    self.query_one("#top-status", Static).update(f"[red]{exc}[/] — retrying every 2 s")
                except NoMatches:
                    return
            await asyncio.sleep(2.0)

    def show(self, stats: dict[str, Any]) -> None:
        self.history.add(stats)
        models = loaded_models(stats)
        t = totals(stats)
        uptime = stats.get("uptime_s")
        self.query_one("#top-status", Static).update(
            f"{len(models)} model(s) loaded, last used [b]{stats.get('model', '?')}[/]"
            + (f" · up {uptime:.0f} s" if uptime is not None else "")
            + f" · {t['steps_total']} steps · {t['requests_finished_total']} requests done"
        )
        self.query_one("#numbers", Static).update(
            f"all models   running [b]{t['requests_running']}[/]   waiting [b]{t['requests_waiting']}[/]   "
            f"tok/s [b]{t['tokens_per_second']:.1f}[/]   batch [b]{t['last_batch_size']}[/]"
        )
        self._show_models(models)
        for name, title in CHARTS:
            values = self.history.series[name]
            self.query_one(f"#spark-{name}", Sparkline).data = list(values)
            self.query_one(f"#title-{name}", Static).update(
                f"{title}  [b]{values[-1]:.1f}[/]  (max {max(values):.1f}, last {len(values)} s)"
            )

    def _show_models(self, models: list[tuple[str, dict[str, Any]]]) -> None:
        """One panel per loaded model, in the daemon's order; panels come and go with the models."""
        box = self.query_one("#models", Vertical)
        panels = list(box.query(".model").results(Static))
        for panel in panels[len(models):]:
            panel.remove()
        texts = [model_panel(name, engine) for name, engine in models]
        for panel, text in zip(panels, texts, strict=False):
            panel.update(text)
        if len(texts) > len(panels):
            box.mount_all([Static(text, classes="panel model") for text in texts[len(panels):]])


class TopScreen(Screen):
    """The dashboard as a screen inside `llmd chat`."""

    BINDINGS = [Binding("escape,q", "app.pop_screen", "Back to chat")]

    def __init__(self, client: DaemonClient):
        super().__init__()
        self.client = client

    def compose(self) -> ComposeResult:
        yield Header()
        yield TopView(self.client)
        yield Footer()


class TopApp(App):
    TITLE = "llmd top"
    BINDINGS = [Binding("q", "quit", "Quit")]

    def __init__(self, client: DaemonClient | None, live: bool = True):
        super().__init__()
        self.client = client
        self.live = live

    def compose(self) -> ComposeResult:
        yield Header()
        yield TopView(self.client, live=self.live)
        yield Footer()

    async def on_unmount(self) -> None:
        if self.client is not None:
            await self.client.close()
