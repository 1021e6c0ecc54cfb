"""Back-pressure, admission, token auth and shutdown of a real `llmd serve` process: a stalled reader is cut off, a
burst past --max-queue gets 429 + Retry-After, SIGTERM drains and exits 0 with the socket removed; no KV block leaks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import aiohttp
import pytest

from llmd_daemon_proc import start_daemon
from test_server_api import ROUTES

pytestmark = pytest.mark.slow

KEY = "test-key-0123456789"
LONG = {"messages": [{"role": "user", "content": "Tell me a long story about a dragon."}], "ignore_eos": True,
        "temperature": 1.0, "seed": 3}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("llmd_life"), "--max-num-seqs", "1", "--max-queue", "2",
                     "--write-timeout", "1.5", "--shutdown-grace", "2", api_key=KEY)
    yield d
    d.stop()


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def assert_no_leak(daemon):
    s = daemon.wait_idle()
    assert s["kv"]["blocks_used"] == 0, s  # at idle only evictable cached blocks remain (counted apart)


def test_cpu_threads_default_to_every_core_the_daemon_may_use(daemon):
    # no --threads: one per core of the daemon's affinity mask, named in the ready line and in the model's stats
    # (tests/test_server_threads.py watches the threads compute)
    cores = len(os.sched_getaffinity(daemon.proc.pid))
    assert f"{cores} CPU threads" in daemon.log()
    assert daemon.stats()["threads"] == cores


async def test_token_required_on_every_route_but_health(daemon):
    async with aiohttp.ClientSession(daemon.url) as http:
        for method, path in ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}, {"x-api-key": "wrong"}, {"x-api-key": ""}):
                async with http.request(method, path, headers=headers, data=b"{}") as r:
                    expected = 200 if path == "/health" else 401
                    assert r.status == expected, (method, path, headers, r.status)
            # Anthropic clients send the key as x-api-key (with anthropic-version)
            for headers in (auth(), {"x-api-key": KEY, "anthropic-version": "2023-06-01"}):
                async with http.request(method, path, headers=headers, data=b"{}") as r:
                    assert r.status not in (401, 403), (method, path, headers)
        async with http.post("/v1/messages", json={"max_tokens": 1}, headers={"x-api-key": "wrong"}) as r:
            body = await r.json()
            assert r.status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"


def test_stalled_reader_is_cut_off(daemon):
    """A client that sends a streaming request and never reads: the server gives up after --write-timeout, aborts the
    request in the engine, and keeps serving others meanwhile."""
    body = json.dumps({**LONG, "max_tokens": 400, "stream": True, "logprobs": True, "top_logprobs": 20}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connect: a small receive window
    sock.connect(("127.0.0.1", daemon.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        deadline = time.monotonic() + 300
        while True:
            started = time.monotonic()
            s = daemon.stats()  # the daemon answers while one stream is stalled
            assert time.monotonic() - started < 5
            if s["server"]["aborts"].get("write_stall"):
                break
            assert time.monotonic() < deadline, s
            time.sleep(0.5)
        s = daemon.wait_idle(timeout=60)
        assert s["server"]["finished"].get("abort", 0) >= 1
        # The request was cut off well before its 400 tokens.
        assert s["generation_tokens_total"] < 400
    finally:
        sock.close()
    assert_no_leak(daemon)


async def test_burst_beyond_max_queue_gets_429(daemon):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    async def one(http):
        started = time.monotonic()
        async with http.post("/v1/chat/completions", json=body, headers=auth()) as r:
            return r.status, r.headers.get("Retry-After"), await r.json(), time.monotonic() - started

    async with aiohttp.ClientSession(daemon.url, timeout=aiohttp.ClientTimeout(total=600)) as http:
        results = await asyncio.gather(*(one(http) for _ in range(8)))
    statuses = [r[0] for r in results]
    # one running place and a queue of two: at least three of the burst are served, the rest refused at once
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 1 and statuses.count(200) >= 3
    for status, retry_after, payload, elapsed in results:
        if status == 429:
            assert int(retry_after) >= 1 and "retry" in payload["error"]["message"]
            assert elapsed < 5  # refused at once, not after waiting
        else:
            assert payload["choices"][0]["finish_reason"] in ("stop", "length")
    assert_no_leak(daemon)


async def test_sigterm_during_stream_drains_and_exits_zero(daemon):
    assert_no_leak(daemon)
    async with aiohttp.ClientSession(daemon.url) as http:
        async with http.post("/v1/chat/completions", json={**LONG, "max_tokens": 400, "stream": True},
                             headers=auth()) as r:
            assert r.status == 200
            events = []
            async for line in r.content:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    if len(events) == 2:
                        daemon.proc.send_signal(signal.SIGTERM)
    # The grace period (2 s) runs out before 400 tokens: the stream ends with an abort, then [DONE].
    assert events[-1] == b"[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert daemon.proc.wait(60) == 0
    assert not daemon.socket_path.exists()
    log = daemon.log()
    assert "draining" in log and "stopped" in log and "Traceback" not in log
