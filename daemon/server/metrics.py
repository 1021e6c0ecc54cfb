"""Prometheus text exposition with vLLM's metric names (prefix `llmd:` where vLLM has `vllm:`).

Latency histograms are fed by the server as each request ends (from its RequestTimings); gauges and counters that the
engine already keeps are read from `engine.stats()` (an EngineStats per model) at scrape time. No client library: the text format is simple.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any, Callable

from ..engine.types import EngineStats, RequestTimings

# Bucket edges follow vLLM's, so dashboards built for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for edge, n in zip(self.buckets, self.counts[:-1], strict=True):
            cumulative += n
            lines.append(f'{self.name}_bucket{{{labels},le="{edge}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum{{{labels}}} {self.sum:.6f}")
        lines.append(f"{self.name}_count{{{labels}}} {self.count}")
        return lines


def _histograms() -> dict[str, Histogram]:
    return {h.name: h for h in (
        Histogram("llmd:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
        Histogram("llmd:inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS),
        Histogram("llmd:request_queue_time_seconds", "Time spent waiting before the first schedule.",
                  REQUEST_BUCKETS),
        Histogram("llmd:request_prefill_time_seconds", "Time from first schedule to first token.", REQUEST_BUCKETS),
        Histogram("llmd:request_decode_time_seconds", "Time from first to last token.", REQUEST_BUCKETS),
        Histogram("llmd:e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS),
        Histogram("llmd:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS),
        Histogram("llmd:request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS),
    )}


class _Series:
    """One model's request histograms and counters."""

    def __init__(self):
        self.histograms = _histograms()
        self.finished: dict[str, int] = {}  # finish reason -> count
        self.aborts: dict[str, int] = {}  # why the server aborted: disconnect, write_stall, shutdown
        self.rejected_queue_full = 0


class Metrics:
    """Server-side metrics, one series per model (vLLM's `model_name` label); `observe_request` is called once per
    finished engine request. A request's handler sees `for_model(name)`, which records under its model."""

    def __init__(self):
        self._lock = threading.Lock()
        self._series: dict[str, _Series] = {}
        self.http_responses: dict[int, int] = {}

    def series(self, model_name: str = "") -> _Series:
        with self._lock:
            return self._series.setdefault(model_name, _Series())

    def for_model(self, model_name: str) -> ModelMetrics:
        return ModelMetrics(self, model_name)

    @property
    def histograms(self) -> dict[str, Histogram]:
        return self.series().histograms

    @property
    def rejected_queue_full(self) -> int:
        return self.series().rejected_queue_full

    @rejected_queue_full.setter
    def rejected_queue_full(self, value: int) -> None:
        self.series().rejected_queue_full = value

    def observe_request(self, t: RequestTimings | None, finish_reason: str | None, model_name: str = "") -> None:
        series = self.series(model_name)
        with self._lock:
            series.finished[finish_reason or "abort"] = series.finished.get(finish_reason or "abort", 0) + 1
            if t is None:
                return
            h = series.histograms
            for name, value in (("llmd:time_to_first_token_seconds", t.ttft),
                                ("llmd:request_queue_time_seconds", t.queue_time),
                                ("llmd:request_prefill_time_seconds", t.prefill_time),
                                ("llmd:request_decode_time_seconds", t.decode_time),
                                ("llmd:e2e_request_latency_seconds", t.e2e)):
                if value is not None:
                    h[name].observe(value)
            for itl in t.inter_token_latencies:
                h["llmd:inter_token_latency_seconds"].observe(itl)
            h["llmd:request_prompt_tokens"].observe(t.num_prompt_tokens)
            h["llmd:request_generation_tokens"].observe(t.num_generated_tokens)

    def count_abort(self, why: str, model_name: str = "") -> None:
        series = self.series(model_name)
        with self._lock:
            series.aborts[why] = series.aborts.get(why, 0) + 1

    def count_response(self, status: int) -> None:
        with self._lock:
            self.http_responses[status] = self.http_responses.get(status, 0) + 1

    def server_stats(self) -> dict:
        """Counters summed over every model."""
        with self._lock:
            aborts: dict[str, int] = {}
            finished: dict[str, int] = {}
            for series in self._series.values():
                for why, n in series.aborts.items():
                    aborts[why] = aborts.get(why, 0) + n
                for reason, n in series.finished.items():
                    finished[reason] = finished.get(reason, 0) + n
            return {"aborts": aborts, "finished": finished,
                    "http_responses": {str(k): v for k, v in sorted(self.http_responses.items())},
                    "rejected_queue_full": sum(s.rejected_queue_full for s in self._series.values())}

    def render(self, stats: dict[str, EngineStats] | EngineStats | None, model_name: str | None = None) -> str:
        """The exposition text. `stats`: engine stats by model name (or one model's stats with its name)."""
        by_model = {model_name or "": stats} if isinstance(stats, EngineStats) else dict(stats or {})
        with self._lock:
            series = dict(self._series)
        if model_name is not None and "" in series:  # a single-model state records without a name
            series[model_name] = series.pop("")
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, values: list[tuple[str, Any]]) -> None:
            values = [(labels, v) for labels, v in values if v is not None]
            if not values:
                return
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{{{labels}}} {float(v):g}" for labels, v in values)

        def label(model: str) -> str:
            return f'model_name="{_escape(model)}"'

        def gauge(name: str, kind: str, help_text: str, read: Callable[[EngineStats], float | None]) -> None:
            family(name, kind, help_text, [(label(m), read(s)) for m, s in sorted(by_model.items())])

        gauge("llmd:num_requests_running", "gauge", "Requests in the running batch.", lambda s: s.requests_running)
        gauge("llmd:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", lambda s: s.requests_waiting)
        # blocks_used counts blocks held by requests; evictable cached blocks are free for new work, as in vLLM.
        gauge("llmd:kv_cache_usage_perc", "gauge", "KV-cache usage: 1 means 100 percent.",
              lambda s: max(s.kv.blocks_used, 0) / s.kv.blocks_total if s.kv and s.kv.blocks_total else None)
        gauge("llmd:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
              lambda s: s.kv.prefix_queries_tokens if s.kv else None)
        gauge("llmd:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
              lambda s: s.kv.prefix_hits_tokens if s.kv else None)
        gauge("llmd:num_preemptions_total", "counter", "Preemptions (recompute) so far.", lambda s: s.num_preemptions)
        gauge("llmd:prompt_tokens_total", "counter", "Prefill tokens processed.", lambda s: s.prompt_tokens_total)
        gauge("llmd:generation_tokens_total", "counter", "Generation tokens produced.",
              lambda s: s.generation_tokens_total)
        # the speculative-decoding families exist for models that speculate (as in vLLM)
        gauge("llmd:spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
              lambda s: s.spec.proposed_total if s.spec else None)
        gauge("llmd:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
              lambda s: s.spec.accepted_total if s.spec else None)
        gauge("llmd:spec_decode_num_drafts_total", "counter", "Speculative verify runs (one per sequence).",
              lambda s: s.spec.drafts_total if s.spec else None)
        gauge("llmd:spec_decode_draft_acceptance_rate", "gauge", "Accepted over proposed draft tokens.",
              lambda s: s.spec.acceptance_rate if s.spec else None)
        gauge("llmd:spec_decode_mean_accepted_length", "gauge", "Accepted draft tokens per verify run.",
              lambda s: s.spec.mean_accepted_length if s.spec else None)
        with self._lock:
            family("llmd:request_success_total", "counter", "Finished requests by finish reason.",
                   [(f'{label(m)},finished_reason="{reason}"', n) for m, sr in sorted(series.items())
                    for reason, n in sorted(sr.finished.items())])
            family("llmd:request_aborts_total", "counter", "Requests the server aborted, by cause.",
                   [(f'{label(m)},reason="{why}"', n) for m, sr in sorted(series.items())
                    for why, n in sorted(sr.aborts.items())])
            for name in _histograms():
                rendered = [sr.histograms[name].render(label(m)) for m, sr in sorted(series.items())]
                if rendered:
                    lines += rendered[0][:2]  # HELP and TYPE once per family
                    for r in rendered:
                        lines += r[2:]
        return "\n".join(lines) + "\n"


class ModelMetrics:
    """The metrics as one model's requests see them: every record carries that model's name."""

    def __init__(self, parent: Metrics, model_name: str):
        self._parent, self.model_name = parent, model_name

    def observe_request(self, t: RequestTimings | None, finish_reason: str | None) -> None:
        self._parent.observe_request(t, finish_reason, self.model_name)

    def count_abort(self, why: str) -> None:
        self._parent.count_abort(why, self.model_name)

    def count_response(self, status: int) -> None:
        self._parent.count_response(status)

    @property
    def rejected_queue_full(self) -> int:
        return self._parent.series(self.model_name).rejected_queue_full

    @rejected_queue_full.setter
    def rejected_queue_full(self, value: int) -> None:
        self._parent.series(self.model_name).rejected_queue_full = value


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
