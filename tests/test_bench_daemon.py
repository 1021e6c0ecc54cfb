"""`llmd bench` against a real `llmd serve` process on the real default model (SmolLM2-135M, CPU): a short closed-loop
run gives a well-formed report whose numbers agree with the server's own /metrics counters."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import pytest

from llmd_daemon_proc import llmd_exe, start_daemon

pytestmark = pytest.mark.slow

METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets}."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = METRIC_LINE.match(line)
        if m:
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(3))
    return totals


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_gguf):
    d = start_daemon(tmp_path_factory.mktemp("bench-daemon"), "--max-num-seqs", "4")
    yield d
    d.stop()


def test_closed_loop_report_agrees_with_metrics(daemon, tmp_path):
    before = scrape(daemon.url)
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [llmd_exe(), "bench", "--url", daemon.url + "/v1", "-n", "3", "-c", "2", "--max-tokens", "4",
         "--json", str(report_path), "--no-progress", "--slo-ttft-ms", "0", "--slo-tpot-ms", "0"],
        capture_output=True, text=True, timeout=600, env=daemon.env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    daemon.wait_idle()
    after = scrape(daemon.url)
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731

    report = json.loads(report_path.read_text())
    assert report["server_is_llmd"] and report["model"] == daemon.stats()["model"]
    (level,) = report["levels"]
    requests = report["requests"][0]
    assert level["requests"] == {"sent": 3, "ok": 3, "failed": 0, "dropped": 0}

    # The report's counts agree with the server's own counters.
    assert delta("llmd:request_success_total") == 3
    assert delta("llmd:e2e_request_latency_seconds_count") == 3
    assert level["tokens"]["completion"] == delta("llmd:generation_tokens_total") \
        == delta("llmd:request_generation_tokens_sum") == sum(r["completion_tokens"] for r in requests)
    assert level["tokens"]["prompt"] == delta("llmd:request_prompt_tokens_sum") > 0
    assert level["server_counters"]["requests_finished"] == 3
    assert level["server_counters"]["generation_tokens"] == level["tokens"]["completion"]
    assert all(1 <= r["completion_tokens"] <= 4 for r in requests)

    # Well-formed: percentiles ordered, client times cover the server's, a diagnosis from server timings.
    for name in ("ttft", "e2e"):
        d = level["latency_ms"][name]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"]
    assert level["latency_ms"]["ttft"]["p50"] <= level["latency_ms"]["e2e"]["p50"]
    for r in requests:
        t = r["timings"]
        assert t and t["queue_ms"] + t["prefill_ms"] == pytest.approx(t["ttft_ms"], abs=1.0)
        assert r["e2e_ms"] >= t["e2e_ms"] - 1.0 and r["ttft_ms"] >= t["ttft_ms"] - 1.0
    server_e2e = delta("llmd:e2e_request_latency_seconds_sum") * 1000 / 3
    assert level["server_ms"]["e2e"]["mean"] == pytest.approx(server_e2e, rel=0.02)
    diag = level["diagnosis"]
    assert diag["basis"] == "server timings" and diag["stage"] in ("queue", "prefill", "decode", "overhead")
    assert sum(diag["shares"].values()) == pytest.approx(1.0)
    assert f"{diag['stage']} dominates" in proc.stdout
    assert "throughput" in proc.stdout and "goodput" in proc.stdout

