"""`llmd bench --compare A B`: the same workload against two endpoints, in alternating rounds (A then B, then B
then A, ...) so that drift on the machine (thermal, other load) falls on both alike; prints B/A ratios."""

from __future__ import annotations

import math
from typing import Sequence

from .client import BenchClient
from .report import Slo, _num, _table, summarize
from .runner import LoadLevel, RunResult, run_level
from .workloads import BenchRequest


def _merge(level: LoadLevel, parts: list[RunResult]) -> RunResult:
    merged = RunResult(level=level)
    for part in parts:
        merged.results.extend(part.results)
        merged.wall_s += part.wall_s
        merged.dropped += part.dropped
        merged.stopped = merged.stopped or part.stopped
    if parts:
        merged.stats_before, merged.stats_after = parts[0].stats_before, parts[-1].stats_after
    return merged


async def compare(client_a: BenchClient, client_b: BenchClient, workload: Sequence[BenchRequest],
                  level: LoadLevel, *, rounds: int = 4, seed: int = 0, progress: bool = False
                  ) -> tuple[RunResult, RunResult]:
    """Split the workload into `rounds` slices; each slice runs on both endpoints, the order alternating."""
    rounds = max(1, min(rounds, len(workload)))
    size = math.ceil(len(workload) / rounds)
    parts: dict[str, list[RunResult]] = {"a": [], "b": []}
    clients = {"a": client_a, "b": client_b}
    for i in range(rounds):
        piece = list(workload[i * size:(i + 1) * size])
        if not piece:
            break
        for key in (("a", "b") if i % 2 == 0 else ("b", "a")):
            run = await run_level(clients[key], piece, level, num_requests=len(piece), seed=seed + i,
                                  progress=progress)
            parts[key].append(run)
        # A server that is down in a round will be down in the next: stop, keep what was measured.
        if any(p[-1].stopped and not p[-1].ok for p in parts.values()):
            break
    return _merge(level, parts["a"]), _merge(level, parts["b"])


COMPARED = [  # (label, path into the summary, higher is better)
    ("requests/s", ("throughput", "requests_per_s"), True),
    ("output tok/s", ("throughput", "output_tokens_per_s"), True),
    ("TTFT p50 ms", ("latency_ms", "ttft", "p50"), False),
    ("TTFT p99 ms", ("latency_ms", "ttft", "p99"), False),
    ("TPOT p50 ms", ("latency_ms", "tpot", "p50"), False),
    ("TPOT p99 ms", ("latency_ms", "tpot", "p99"), False),
    ("e2e p50 ms", ("latency_ms", "e2e", "p50"), False),
    ("e2e p99 ms", ("latency_ms", "e2e", "p99"), False),
    ("goodput req/s", ("goodput", "requests_per_s"), True),
]


def _get(summary: dict, path: tuple) -> float | None:
    node = summary
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node if isinstance(node, (int, float)) and not math.isnan(node) else None


def comparison(run_a: RunResult, run_b: RunResult, slo: Slo) -> dict:
    a, b = summarize(run_a, slo), summarize(run_b, slo)
    rows = []
    for label, path, higher_better in COMPARED:
        va, vb = _get(a, path), _get(b, path)
        ratio = vb / va if va and vb is not None else None
        rows.append({"metric": label, "a": va, "b": vb, "ratio_b_over_a": ratio, "higher_is_better": higher_better})
    return {"a": a, "b": b, "ratios": rows}


def render_comparison(result: dict, url_a: str, url_b: str) -> str:
    table_rows = []
    for row in result["ratios"]:
        ratio = row["ratio_b_over_a"]
        verdict = ""
        if ratio is not None and abs(ratio - 1) > 0.05:
            better = (ratio > 1) == row["higher_is_better"]
            verdict = "B better" if better else "A better"
        table_rows.append([row["metric"], _num(row["a"]), _num(row["b"]),
                           "-" if ratio is None else f"{ratio:.2f}x", verdict])
    lines = [f"A = {url_a}", f"B = {url_b}", "",
             _table(table_rows, ["metric", "A", "B", "B/A", ""])]
    for key, url in (("a", url_a), ("b", url_b)):
        s = result[key]
        if s["requests"]["failed"] or s["stopped"]:
            lines.append(f"{key.upper()}: {s['requests']['failed']} failed"
                         + (f"; {s['errors'][0]['error']}" if s["errors"] else "")
                         + (f"; {s['stopped']}" if s["stopped"] else ""))
        if s["diagnosis"]:
            lines.append(f"{key.upper()}: {s['diagnosis']['stage']} dominates "
                         f"({s['diagnosis']['share'] * 100:.0f}% of end-to-end time)")
    return "\n".join(lines)
