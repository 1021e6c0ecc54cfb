"""Prometheus text exposition with vLLM's metric names (prefix `llmd:` where vLLM has `vllm:`).

Latency histograms are fed by the server as each request ends (from its RequestTimings); gauges and counters that the
engine already keeps are read from `engine.stats()` at scrape time. No client library: the text format is simple.
"""

from __future__ import annotations

import bisect
import threading

from ..engine.types import RequestTimings

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
        for edge, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{{labels},le="{edge}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum{{{labels}}} {self.sum:.6f}")
        lines.append(f"{self.name}_count{{{labels}}} {self.count}")
        return lines


class Metrics:
    """Server-side metrics; `observe_request` is called once per finished engine request."""

    def __init__(self):
        self._lock = threading.Lock()
        self.histograms = {h.name: h for h in (
            Histogram("llmd:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
            Histogram("llmd:inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS),
            Histogram("llmd:request_queue_time_seconds", "Time spent waiting before the first schedule.",
                      REQUEST_BUCKETS),
            Histogram("llmd:request_prefill_time_seconds", "Time from first schedule to first token.",
                      REQUEST_BUCKETS),
            Histogram("llmd:request_decode_time_seconds", "Time from first to last token.", REQUEST_BUCKETS),
            Histogram("llmd:e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS),
            Histogram("llmd:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS),
            Histogram("llmd:request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS),
        )}
        self.finished: dict[str, int] = {}  # finish reason -> count
        self.aborts: dict[str, int] = {}  # why the server aborted: disconnect, write_stall, shutdown
        self.http_responses: dict[int, int] = {}
        self.rejected_queue_full = 0

    def observe_request(self, t: RequestTimings | None, finish_reason: str | None) -> None:
        with self._lock:
            self.finished[finish_reason or "abort"] = self.finished.get(finish_reason or "abort", 0) + 1
            if t is None:
                return
            h = self.histograms
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

    def count_abort(self, why: str) -> None:
        with self._lock:
            self.aborts[why] = self.aborts.get(why, 0) + 1

    def count_response(self, status: int) -> None:
        with self._lock:
            self.http_responses[status] = self.http_responses.get(status, 0) + 1

    def server_stats(self) -> dict:
        with self._lock:
            return {"aborts": dict(self.aborts), "finished": dict(self.finished),
                    "http_responses": {str(k): v for k, v in sorted(self.http_responses.items())},
                    "rejected_queue_full": self.rejected_queue_full}

    def render(self, stats: dict | None, model_name: str) -> str:
        labels = f'model_name="{_escape(model_name)}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, value, extra: str = "") -> None:
            if value is None:
                return
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                          f"{name}{{{labels}{extra}}} {float(value):g}"])

        if stats:
            total = stats.get("kv_blocks_total") or 0
            # kv_blocks_used counts blocks held by requests; evictable cached blocks are free for new work,
            # as in vLLM's usage figure.
            used = stats.get("kv_blocks_used") or 0
            metric("llmd:num_requests_running", "gauge", "Requests in the running batch.",
                   stats.get("requests_running"))
            metric("llmd:num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
                   stats.get("requests_waiting"))
            metric("llmd:kv_cache_usage_perc", "gauge", "KV-cache usage: 1 means 100 percent.",
                   max(used, 0) / total if total else 0.0)
            metric("llmd:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
                   stats.get("prefix_cache_queries_tokens"))
            metric("llmd:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
                   stats.get("prefix_cache_hits_tokens"))
            metric("llmd:num_preemptions_total", "counter", "Preemptions (recompute) so far.",
                   stats.get("num_preemptions"))
            metric("llmd:prompt_tokens_total", "counter", "Prefill tokens processed.", stats.get("prompt_tokens_total"))
            metric("llmd:generation_tokens_total", "counter", "Generation tokens produced.",
                   stats.get("generation_tokens_total"))
            metric("llmd:spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
                   stats.get("spec_proposed_total"))
            metric("llmd:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
                   stats.get("spec_accepted_total"))
            if "spec_num_drafts_total" in stats:  # speculation configured
                metric("llmd:spec_decode_num_drafts_total", "counter", "Speculative verify runs (one per sequence).",
                       stats.get("spec_num_drafts_total"))
                metric("llmd:spec_decode_draft_acceptance_rate", "gauge", "Accepted over proposed draft tokens.",
                       stats.get("spec_acceptance_rate"))
                metric("llmd:spec_decode_mean_accepted_length", "gauge", "Accepted draft tokens per verify run.",
                       stats.get("spec_mean_accepted_length"))
        with self._lock:
            if self.finished:
                lines += ["# HELP llmd:request_success_total Finished requests by finish reason.",
                          "# TYPE llmd:request_success_total counter"]
                for reason, n in sorted(self.finished.items()):
                    lines.append(f'llmd:request_success_total{{{labels},finished_reason="{reason}"}} {n}')
            if self.aborts:
                lines += ["# HELP llmd:request_aborts_total Requests the server aborted, by cause.",
                          "# TYPE llmd:request_aborts_total counter"]
                for why, n in sorted(self.aborts.items()):
                    lines.append(f'llmd:request_aborts_total{{{labels},reason="{why}"}} {n}')
            for h in self.histograms.values():
                lines += h.render(labels)
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
