"""`llmd top`: a live view of the engine from /v1/llmd/stats (pushed once a second over SSE).

TopView is one widget, used both by the standalone TopApp and by a screen inside `llmd chat`.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from collections import deque
from typing import Any

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.containers import Grid, Horizontal, Vertical
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


def p50(stats: dict[str, Any], stage: str) -> float:
    value = ((stats.get("latency") or {}).get(stage) or {}).get("p50")
    return float(value) if value is not None else 0.0


class StatsHistory:
    """The last HISTORY_SECONDS samples of each plotted series (bounded)."""

    def __init__(self, maxlen: int = HISTORY_SECONDS):
        self.series: dict[str, deque[float]] = {name: deque(maxlen=maxlen) for name in SERIES}
        self.latest: dict[str, Any] = {}

    def add(self, stats: dict[str, Any]) -> None:
        self.latest = stats
        for name in SERIES:
            value = p50(stats, name) if name in STAGES else stats.get(name) or 0
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


def kv_bar(stats: dict[str, Any], width: int) -> str:
    """Used (held by live sequences), cached (evictable prefix blocks, counted within free) and plain free."""
    total = stats.get("kv_blocks_total") or 0
    if not total:
        return "·" * width
    used = round((stats.get("kv_blocks_used") or 0) / total * width)
    cached = min(round((stats.get("kv_blocks_cached") or 0) / total * width), width - used)
    return f"[red]{'█' * used}[/][blue]{'▓' * cached}[/][green]{'░' * (width - used - cached)}[/]"


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
        with Vertical(classes="panel"):
            yield Static(id="kv")
            yield Static(id="split")
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
                async with aclosing(self.client.stats_stream()) as stream:
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
        s = stats
        uptime = s.get("uptime_s")
        self.query_one("#top-status", Static).update(
            f"model [b]{s.get('model', '?')}[/]" + (f" · up {uptime:.0f} s" if uptime is not None else "")
            + f" · {s.get('steps_total', 0)} steps · {s.get('requests_finished_total', 0)} requests done"
        )
        spec = ""
        if s.get("spec_proposed_total"):
            spec = f"   spec accept [b]{100 * s.get('spec_accepted_total', 0) / s['spec_proposed_total']:.0f}%[/]"
        self.query_one("#numbers", Static).update(
            f"running [b]{s.get('requests_running', 0)}[/]   waiting [b]{s.get('requests_waiting', 0)}[/]   "
            f"tok/s [b]{s.get('tokens_per_second', 0):.1f}[/]   batch [b]{s.get('last_batch_size', 0)}[/]   "
            f"preemptions [b]{s.get('num_preemptions', 0)}[/]{spec}"
        )
        width = BAR_WIDTH
        self.query_one("#kv", Static).update(
            f"KV blocks  {kv_bar(s, width)}  [red]used[/] [b]{s.get('kv_blocks_used', 0)}[/] · [blue]cached[/] "
            f"[b]{s.get('kv_blocks_cached', 0)}[/] · free [b]{s.get('kv_blocks_free', 0)}[/] / "
            f"{s.get('kv_blocks_total', 0)}   prefix hit [b]{100 * (s.get('prefix_cache_hit_rate') or 0):.0f}%[/]"
        )
        split = stage_split(s)
        dominant = max(split, key=split.get) if any(split.values()) else None
        self.query_one("#split", Static).update(
            f"latency    {split_bar(split, width)}  "
            + "  ".join(f"{st[:-3]} {p50(s, st):.0f} ms" for st in STAGES)
            + (f"   [b]{dominant[:-3]} dominates[/]" if dominant else "")
        )
        for name, title in CHARTS:
            values = self.history.series[name]
            self.query_one(f"#spark-{name}", Sparkline).data = list(values)
            self.query_one(f"#title-{name}", Static).update(
                f"{title}  [b]{values[-1]:.1f}[/]  (max {max(values):.1f}, last {len(values)} s)"
            )


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
