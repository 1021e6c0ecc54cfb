"""Summaries of a benchmark run: percentiles, throughput, goodput, cache and speculation figures, and a diagnosis of
which stage dominates end-to-end time, with the llmd flags that address it. Rendered as a table, JSON or PNGs."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from ..errors import LlmdError
from .runner import RunResult


@dataclass(frozen=True)
class Slo:
    """A request is 'good' when it succeeded and met every limit that is set."""

    ttft_ms: float | None = 500.0
    tpot_ms: float | None = 50.0
    e2e_ms: float | None = None

    def met_by(self, r) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1000 > self.ttft_ms):
            return False
        if self.tpot_ms is not None and r.tpot_s is not None and r.tpot_s * 1000 > self.tpot_ms:
            return False
        return self.e2e_ms is None or (r.e2e_s is not None and r.e2e_s * 1000 <= self.e2e_ms)

    def describe(self) -> str:
        parts = [f"{name} <= {value:g} ms" for name, value in
                 (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms), ("e2e", self.e2e_ms)) if value is not None]
        return " and ".join(parts) or "none"


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (as numpy's default)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict | None:
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return None
    return {"p50": percentile(vals, 0.5), "p90": percentile(vals, 0.9), "p99": percentile(vals, 0.99),
            "mean": sum(vals) / len(vals), "n": len(vals)}


# What each stage means, and what to do when it dominates: `llmd serve` flags, or LLMD_* settings (environment or
# config.toml) for the knobs that have no flag.
STAGES = {
    "queue": ("waiting for a batch slot",
              "the server is over capacity at this load: raise --max-num-seqs (more requests decoded together) if KV "
              "memory allows, give the KV cache more memory (--kv-cache-bytes, or LLMD_KV_CACHE_FRACTION on CUDA), or "
              "send less load; lower --max-queue so clients get a quick 429 instead of a long wait"),
    "prefill": ("processing the prompt",
                "prompts are expensive: keep prefix caching on (LLMD_ENABLE_PREFIX_CACHING=true, the default) and put "
                "shared text (system prompt, documents) first so it hits; raise LLMD_MAX_NUM_BATCHED_TOKENS so a long "
                "prompt takes fewer prefill chunks; on a GPU serve with --dtype bfloat16; shorten prompts"),
    "decode": ("generating tokens",
               "token generation dominates: batch more requests together (--max-num-seqs), serve a quantized model "
               "(a Q4/Q8 GGUF: decode is memory-bound), and for few users enable speculative decoding "
               "(LLMD_DRAFT_MODEL=NAME, LLMD_NUM_SPECULATIVE_TOKENS)"),
    "overhead": ("network, HTTP and client overhead",
                 "time is lost outside the server: benchmark from the same machine, connect over the Unix socket "
                 "(--socket), avoid proxies, and check the client is not CPU-starved"),
    "first_token": ("waiting for the first token (queue + prefill; this server reports no stages)",
                    "queueing or prompt processing dominates: on llmd, the per-stage timings tell them apart"),
}


def _notes(diag: dict | None, prefix_hit: float | None, spec: float | None) -> list[str]:
    """Hints that depend on the cache and speculation figures, not only on the dominant stage."""
    notes = []
    if diag and diag["stage"] == "prefill" and prefix_hit is not None and prefix_hit < 0.2:
        notes.append(f"only {prefix_hit * 100:.0f}% of prompt tokens hit the prefix cache: these prompts share "
                     "little prefix, so prefill cost is real work (shorter prompts or a faster device help)")
    if spec is not None and spec < 0.3:
        notes.append(f"speculation accepts only {spec * 100:.0f}% of drafts: it costs more than it saves here "
                     "(unset LLMD_DRAFT_MODEL)")
    return notes


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _server(r, key: str) -> float | None:
    v = (r.timings or {}).get(key)
    return float(v) if isinstance(v, (int, float)) else None


def _overhead(r, client_s: float | None, server_key: str) -> float | None:
    server_ms = _server(r, server_key)
    if client_s is None or server_ms is None:
        return None
    return max(0.0, client_s * 1000 - server_ms)


def diagnose(ok_results) -> dict | None:
    """Mean time per stage across successful requests; the largest one dominates."""
    if not ok_results:
        return None
    with_timings = [r for r in ok_results if r.timings and _server(r, "e2e_ms") is not None]
    if len(with_timings) * 2 >= len(ok_results):
        stages = {
            "queue": _mean(_server(r, "queue_ms") for r in with_timings),
            "prefill": _mean(_server(r, "prefill_ms") for r in with_timings),
            "decode": _mean(_server(r, "decode_ms") for r in with_timings),
            "overhead": _mean(_overhead(r, r.e2e_s, "e2e_ms") for r in with_timings),
        }
        basis = "server timings"
    else:
        stages = {
            "first_token": _mean(r.ttft_s * 1000 for r in ok_results if r.ttft_s is not None),
            "decode": _mean((r.e2e_s - r.ttft_s) * 1000 for r in ok_results if r.ttft_s is not None),
        }
        basis = "client timings"
    stages = {k: (v or 0.0) for k, v in stages.items()}
    total = sum(stages.values())
    if total <= 0:
        return None
    stage = max(stages, key=stages.get)
    meaning, remedy = STAGES[stage]
    return {
        "stage": stage, "meaning": meaning, "share": stages[stage] / total, "remedy": remedy, "basis": basis,
        "stages_ms": stages, "shares": {k: v / total for k, v in stages.items()},
    }


def _delta(before: dict | None, after: dict | None, key: str) -> float | None:
    """How much a counter of llmd's /v1/llmd/stats grew; `key` may be a path into it ("kv.prefix_hits_tokens")."""
    if not before or not after:
        return None
    a, b = _counter(before, key), _counter(after, key)
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return None
    return b - a


def _counter(stats: dict, path: str):
    value: object = stats
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _ratio(num, den) -> float | None:
    return num / den if num is not None and den else None


def summarize(run: RunResult, slo: Slo = Slo()) -> dict:
    ok, failed = run.ok, run.failed
    wall = run.wall_s or math.nan
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    good = sum(1 for r in ok if slo.met_by(r))
    latency = {
        "ttft": distribution([r.ttft_s * 1000 for r in ok if r.ttft_s is not None]),
        "tpot": distribution([r.tpot_s * 1000 for r in ok if r.tpot_s is not None]),
        "itl": distribution([x * 1000 for r in ok for x in r.itls_s]),
        "e2e": distribution([r.e2e_s * 1000 for r in ok if r.e2e_s is not None]),
    }
    server = {
        key: distribution([_server(r, f"{key}_ms") for r in ok])
        for key in ("queue", "prefill", "ttft", "decode", "tpot", "e2e")
    }
    overhead = {
        "ttft": distribution([_overhead(r, r.ttft_s, "ttft_ms") for r in ok]),
        "e2e": distribution([_overhead(r, r.e2e_s, "e2e_ms") for r in ok]),
    }
    before, after = run.stats_before, run.stats_after
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    prompt_known = [r.prompt_tokens for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    prefix_hit = _ratio(_delta(before, after, "kv.prefix_hits_tokens"),
                        _delta(before, after, "kv.prefix_queries_tokens"))
    if prefix_hit is None and cached:
        prefix_hit = _ratio(sum(cached), sum(prompt_known))
    spec = _ratio(_delta(before, after, "spec.accepted_total"), _delta(before, after, "spec.proposed_total"))
    if spec is None:
        spec = _ratio(sum(_server(r, "spec_accepted") or 0 for r in ok),
                      sum(_server(r, "spec_proposed") or 0 for r in ok))
    errors = Counter(r.error for r in failed)
    diag = diagnose(ok)
    if diag:
        diag["notes"] = _notes(diag, prefix_hit, spec)
    return {
        "level": run.level.label, "mode": run.level.mode, "concurrency": run.level.concurrency,
        "rate": run.level.rate, "wall_s": run.wall_s,
        "requests": {"sent": len(run.results), "ok": len(ok), "failed": len(failed), "dropped": run.dropped},
        "throughput": {
            "requests_per_s": len(ok) / wall, "output_tokens_per_s": out_tokens / wall,
            "input_tokens_per_s": in_tokens / wall,
        },
        "tokens": {"prompt": in_tokens, "completion": out_tokens, "cached": sum(cached)},
        "goodput": {"slo": asdict(slo), "good": good, "fraction": good / len(run.results) if run.results else None,
                    "requests_per_s": good / wall},
        "latency_ms": latency,
        "server_ms": server if any(server.values()) else None,
        "overhead_ms": overhead if any(overhead.values()) else None,
        "prefix_hit_rate": prefix_hit,
        "spec_acceptance": spec,
        "server_counters": {
            "requests_finished": _delta(before, after, "requests_finished_total"),
            "prompt_tokens": _delta(before, after, "prompt_tokens_total"),
            "generation_tokens": _delta(before, after, "generation_tokens_total"),
        } if before and after else None,
        "errors": [{"error": e, "count": n} for e, n in errors.most_common(5)],
        "stopped": run.stopped,
        "diagnosis": diag,
    }


# --- rendering -------------------------------------------------------------------------------------------------

def _f(v, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.{digits}f}"


def _num(v) -> str:
    """Rates: three significant figures, so that a slow server's 0.0048 req/s does not print as 0.00."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _pct(v) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(  # noqa: E731
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _latency_rows(summary: dict) -> list[list[str]]:
    rows = []
    groups = [("", summary["latency_ms"]), ("server ", summary["server_ms"] or {}),
              ("overhead ", summary["overhead_ms"] or {})]
    for prefix, group in groups:
        for name, d in group.items():
            if d:
                rows.append([prefix + name, _f(d["p50"]), _f(d["p90"]), _f(d["p99"]), _f(d["mean"])])
    return rows


def render_level(summary: dict) -> str:
    req, tp, gp = summary["requests"], summary["throughput"], summary["goodput"]
    lines = [f"load {summary['level']}: {req['ok']} ok, {req['failed']} failed in {summary['wall_s']:.2f}s"
             + (f", {req['dropped']} arrivals dropped (too many in flight)" if req["dropped"] else "")]
    rows = _latency_rows(summary)
    if rows:
        lines += ["", _table(rows, ["latency (ms)", "p50", "p90", "p99", "mean"])]
    lines += [
        "",
        f"throughput   {_num(tp['requests_per_s'])} req/s   {_num(tp['output_tokens_per_s'])} output tok/s   "
        f"{_num(tp['input_tokens_per_s'])} input tok/s",
        f"goodput      {_num(gp['requests_per_s'])} req/s ({_pct(gp['fraction'])} of requests met "
        f"{Slo(**gp['slo']).describe()})",
    ]
    if summary["prefix_hit_rate"] is not None:
        lines.append(f"prefix cache {_pct(summary['prefix_hit_rate'])} of prompt tokens hit")
    if summary["spec_acceptance"] is not None:
        lines.append(f"speculation  {_pct(summary['spec_acceptance'])} of draft tokens accepted")
    lines += _problems(summary)
    lines += _diagnosis_lines(summary["diagnosis"])
    return "\n".join(lines)


def _problems(summary: dict) -> list[str]:
    lines = []
    for e in summary["errors"]:
        lines.append(f"failed       {e['count']} x {e['error']}")
    if summary["stopped"]:
        lines.append(f"note         {summary['stopped']} (results so far are kept)")
    return lines


def _diagnosis_lines(diag: dict | None) -> list[str]:
    if not diag:
        return ["diagnosis    no successful request to diagnose"]
    split = ", ".join(f"{k} {v * 100:.0f}%" for k, v in diag["shares"].items())
    return [
        f"diagnosis    {diag['stage']} dominates ({diag['share'] * 100:.0f}% of end-to-end time: {diag['meaning']})",
        f"             split: {split} ({diag['basis']})",
        f"remedy       {diag['remedy']}",
    ] + [f"note         {note}" for note in diag.get("notes", [])]


def render_sweep(summaries: list[dict]) -> str:
    rows = []
    for s in summaries:
        lat, tp = s["latency_ms"], s["throughput"]
        g = lambda name, q: _f((lat[name] or {}).get(q))  # noqa: E731
        diag = s["diagnosis"]
        rows.append([s["level"], str(s["requests"]["ok"]), str(s["requests"]["failed"]),
                     _num(tp["requests_per_s"]), _num(tp["output_tokens_per_s"]),
                     g("ttft", "p50"), g("ttft", "p99"), g("tpot", "p50"), g("tpot", "p99"),
                     g("e2e", "p50"), g("e2e", "p99"), _pct(s["goodput"]["fraction"]),
                     f"{diag['stage']} {diag['share'] * 100:.0f}%" if diag else "-"])
    header = ["load", "ok", "fail", "req/s", "tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
              "e2e p50", "e2e p99", "good", "dominant"]
    return _table(rows, header)


def render(summaries: list[dict], header: str = "") -> str:
    parts = [header] if header else []
    if len(summaries) == 1:
        parts.append(render_level(summaries[0]))
    else:
        parts.append(_table_title("sweep (latencies in ms)") + render_sweep(summaries))
        last = summaries[-1]
        parts.append(f"\nat the highest load ({last['level']}):")
        parts.append("\n".join(_problems(last) + _diagnosis_lines(last["diagnosis"])))
        for s in summaries[:-1]:
            parts.extend(_problems(s))
    return "\n".join(parts)


def _table_title(title: str) -> str:
    return title + "\n"


# --- plots -----------------------------------------------------------------------------------------------------

class PlotUnavailable(LlmdError):
    pass


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("plots need matplotlib, which is not installed: pip install 'llmd[plot]'") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    return plt


def write_plots(runs: Sequence[RunResult], summaries: Sequence[dict], out_dir: str | Path) -> list[Path]:
    """Latency CDFs, the throughput-vs-latency curve and a stacked per-stage bar per load level, as PNGs."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "latency_cdf.png", out / "throughput_latency.png", out / "stages.png"]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (name, title) in zip(axes, [("ttft", "time to first token"), ("tpot", "time per output token"),
                                        ("e2e", "end-to-end")]):
        for run in runs:
            vals = sorted(_client_ms(r, name) for r in run.ok if _client_ms(r, name) is not None)
            if vals:
                ax.step(vals, [(i + 1) / len(vals) for i in range(len(vals))], where="post", label=run.level.label)
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("latency CDFs by load level")
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [s["throughput"]["output_tokens_per_s"] for s in summaries]
    for ax, name in zip(axes, ("ttft", "e2e")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [(s["latency_ms"][name] or {}).get(q, math.nan) for s in summaries]
            ax.plot(xs, ys, style, label=q)
        for x, s in zip(xs, summaries):
            ys = (s["latency_ms"][name] or {}).get("p50", math.nan)
            ax.annotate(s["level"], (x, ys), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s")
        title = {"ttft": "time to first token", "e2e": "end-to-end latency"}[name]
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"throughput vs {title}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(summaries) + 3), 4.5))
    labels = [s["level"] for s in summaries]
    stage_names = []
    for s in summaries:
        for k in (s["diagnosis"] or {}).get("stages_ms", {}):
            if k not in stage_names:
                stage_names.append(k)
    bottoms = [0.0] * len(summaries)
    for stage in stage_names:
        heights = [((s["diagnosis"] or {}).get("stages_ms") or {}).get(stage, 0.0) for s in summaries]
        ax.bar(labels, heights, bottom=bottoms, label=stage)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel("mean ms per request")
    ax.set_title("where the time goes, per load level")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    return paths


def _client_ms(r, name: str) -> float | None:
    v = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}[name]
    return None if v is None else v * 1000
