"""--threads reaches the model's computation: a real `llmd serve` on the bundled model, started with --threads 1 and 2,
is watched from outside through /proc (which of its OS threads burn CPU during a prefill), and says the same count in
/v1/llmd/stats, /api/ps and `llmd ps`. The count is set in the engine thread itself (torch's and OpenMP's thread
counts are per thread), so a daemon whose engine thread silently computed on one core fails here. Whatever the thread
count, the greedy answer and its logprobs are the same bits; and the engine thread's OpenMP workers spin between
kernels rather than sleep (no other thread of the daemon keeps an OpenMP pool), and end when it goes idle."""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from llmd_daemon_proc import llmd_exe, start_daemon

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 768  # one prefill of ~1-3 s of CPU: far above /proc's 10 ms ticks and the HTTP thread's share
BUSY_SHARE = 0.25  # a thread computes if it burned at least this share of the busiest thread's CPU time
ANSWERS: dict[int, dict] = {}  # --threads -> the greedy answer with logprobs


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llmd_threads")  # one after the other, the daemons share it (the C kernels' build)


@pytest.fixture(scope="module", params=[1, 2], ids=["threads1", "threads2"])
def daemon(request, base):
    # OpenMP's own wait policy, as users run it (the suite's PASSIVE would hide whether workers spin or sleep)
    d = start_daemon(base, "--threads", str(request.param), env={"OMP_WAIT_POLICY": None})
    d.extra["threads"] = request.param
    yield d
    d.stop()


class ThreadWatch:
    """Samples each OS thread of a process (/proc/PID/task/TID) every few milliseconds while a request runs: its CPU
    seconds (utime + stime) and voluntary context switches (it went to sleep). A thread that ends meanwhile (an
    engine going idle hands its OpenMP workers back) keeps its last sample."""

    def __init__(self, pid: int):
        self.pid = pid
        self.first, self.last = self.sample(), {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict[int, tuple[float, int]]:
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
                status = (task / "status").read_text()
            except OSError:
                continue  # the thread ended meanwhile
            switches = sum(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt"))
            out[int(task.name)] = ((int(stat[11]) + int(stat[12])) / tick, switches)
        return out

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.last.update(self.sample())

    def __enter__(self) -> "ThreadWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.last.update(self.sample())

    def cpu_seconds(self) -> list[float]:
        """Each thread's CPU seconds during the watch, most first."""
        return sorted((cpu - self.first.get(tid, (0.0, 0))[0] for tid, (cpu, _) in self.last.items()), reverse=True)

    def busy_threads(self, share: float = BUSY_SHARE) -> list[int]:
        """The threads that computed during the watch: at least `share` of the busiest one's CPU seconds."""
        used = {tid: cpu - self.first.get(tid, (0.0, 0))[0] for tid, (cpu, _) in self.last.items()}
        return [tid for tid, cpu in used.items() if cpu >= share * max(used.values())]

    def voluntary_switches(self) -> int:
        return sum(n - self.first.get(tid, (0.0, 0))[1] for tid, (_, n) in self.last.items())


def complete(daemon, body: dict) -> dict:
    req = urllib.request.Request(daemon.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def test_the_model_computes_on_the_threads_it_was_given(daemon):
    threads = daemon.extra["threads"]
    ids = random.Random(threads).choices(range(1000, 20000), k=PROMPT_TOKENS)  # token ids: no tokenizer work
    with ThreadWatch(daemon.proc.pid) as watch:
        answer = complete(daemon, {"prompt": ids, "max_tokens": 1, "temperature": 0})
    assert answer["usage"]["prompt_tokens"] == PROMPT_TOKENS
    used = watch.cpu_seconds()
    assert used[0] >= 0.3, used  # the prefill was measured at all
    busy = [s for s in used if s >= BUSY_SHARE * used[0]]
    assert len(busy) == threads, f"{len(busy)} OS threads computed, --threads {threads}: CPU seconds {used[:6]}"

    stats = daemon.stats()
    assert stats["threads"] == threads and [m["stats"]["threads"] for m in stats["models"]] == [threads]
    status, ps = daemon.get_json("/api/ps")
    assert status == 200 and [m["threads"] for m in ps["models"]] == [threads]
    out = subprocess.run([llmd_exe(), "ps"], env=daemon.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"CPU, {threads} thread{'s' if threads > 1 else ''}," in out.stdout, out.stdout


def test_the_answer_is_the_same_bits_on_any_number_of_threads(daemon):
    # a prompt of two prefill chunks (--max-num-batched-tokens is 512 on the CPU), then decode steps
    prompt = "Tell me about the sea. " * 96
    answer = complete(daemon, {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1})["choices"][0]
    threads = daemon.extra["threads"]
    ANSWERS[threads] = {"text": answer["text"], "logprobs": answer["logprobs"]}
    assert answer["text"] and len(answer["logprobs"]["token_logprobs"]) == 8, answer
    if threads == 2:  # the module's daemons run in turn, --threads 1 first: its answer is there to compare with
        assert 1 in ANSWERS, "the --threads 1 case of this test runs first and records its answer"
        assert ANSWERS[1] == ANSWERS[2], ANSWERS


@pytest.mark.parametrize("daemon", [2], indirect=True, ids=["threads2"])  # --threads 1 has no workers to watch
def test_the_engine_threads_openmp_workers_spin_between_kernels(daemon):
    """While a process holds more OpenMP pool threads than cores, libgomp makes every worker sleep between parallel
    regions (llmd.kernels.openmp): had the model loader kept its pool, each decode token would wake the engine
    thread's worker a few hundred times (~300 voluntary context switches a token on 2 cores; about 1 without)."""
    pid = daemon.proc.pid
    assert len(os.sched_getaffinity(pid)) >= 2, "--threads 2 spins on 2 cores: this test needs them"
    assert "libgomp" in Path(f"/proc/{pid}/maps").read_text(), "torch's OpenMP is libgomp, which openmp.py pauses"
    with ThreadWatch(pid) as watch:
        answer = complete(daemon, {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0,
                                   "ignore_eos": True})
    switches = watch.voluntary_switches()
    assert answer["usage"]["completion_tokens"] == 32 and switches < 30 * 32, f"{switches} voluntary switches"

    # the engine thread going idle hands its worker back: of the two threads that decoded, one ends (half the busiest
    # thread's time: 32 tokens of a 135M model take a few hundred ms, the request's own handling tens of ms)
    busy = watch.busy_threads(share=0.5)
    assert len(busy) == 2, busy
    deadline = time.monotonic() + 10
    while all(Path(f"/proc/{pid}/task/{tid}").exists() for tid in busy):
        assert time.monotonic() < deadline, "the idle engine thread kept its OpenMP worker"
        time.sleep(0.05)
