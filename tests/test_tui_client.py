"""The TUI's HTTP client against a small server speaking llmd's contract."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from llmd.tui.client import ChatRequest, DaemonClient, DaemonError, DaemonUnavailable, Endpoint
from tui_fake_daemon import ANSWER, Behaviour, FakeDaemon, free_port


@pytest.fixture
def fake():
    daemon = FakeDaemon().start()
    yield daemon
    daemon.stop()


def client_for(daemon: FakeDaemon) -> DaemonClient:
    return DaemonClient([Endpoint(port=daemon.port)])


async def test_chat_stream_yields_text_then_timings(fake):
    client = client_for(fake)
    chunks = [c async for c in client.chat_stream(ChatRequest([{"role": "user", "content": "hi"}], model="m",
                                                              temperature=0.2, max_tokens=9))]
    await client.close()
    assert "".join(c.text for c in chunks) == ANSWER
    final = [c for c in chunks if c.finish_reason]
    assert len(final) == 1 and final[0].finish_reason == "stop"
    assert final[0].timings["ttft_ms"] == 21.5 and final[0].timings["cached_prompt_tokens"] == 32
    assert chunks[-1].usage["prompt_tokens_details"]["cached_tokens"] == 32
    body = fake.requests[0]
    assert body["stream"] is True and body["model"] == "m" and body["temperature"] == 0.2 and body["max_tokens"] == 9


async def test_models_health_and_stats(fake):
    client = client_for(fake)
    assert await client.models() == ["fake-model", "other-model"]
    assert (await client.health())["status"] == "ok"
    stats = await client.stats()
    assert stats["kv"]["blocks_total"] == 100 and stats["latency"]["decode_ms"]["p50"] == 300.0
    seen = []
    async for event in client.stats_stream():
        seen.append(event["steps_total"])
        if len(seen) == 3:
            break
    await client.close()
    assert seen == sorted(seen) and len(set(seen)) == 3  # pushed repeatedly, each a fresh sample


async def test_unix_socket_is_tried_first(tmp_path):
    sock_daemon = FakeDaemon(Behaviour(models=["via-socket"]), socket_path=tmp_path / "llmd.sock").start()
    tcp_daemon = FakeDaemon(Behaviour(models=["via-tcp"])).start()
    try:
        client = DaemonClient([Endpoint(socket_path=tmp_path / "llmd.sock"), Endpoint(port=tcp_daemon.port)])
        assert await client.models() == ["via-socket"]
        await client.close()
        # a stale socket path is skipped, and TCP is used
        client = DaemonClient([Endpoint(socket_path=tmp_path / "missing.sock"), Endpoint(port=tcp_daemon.port)])
        assert await client.models() == ["via-tcp"]
        assert client.describe() == f"http://127.0.0.1:{tcp_daemon.port}"
        await client.close()
    finally:
        sock_daemon.stop()
        tcp_daemon.stop()


async def test_no_daemon_is_a_clear_error():
    client = DaemonClient([Endpoint(port=free_port())])
    with pytest.raises(DaemonUnavailable, match="no llmd daemon answers at http://127.0.0.1"):
        await client.health()


async def test_daemon_dying_mid_stream_is_unavailable_not_a_crash(fake):
    fake.behaviour.die_after_chunks = 2
    client = client_for(fake)
    got = []
    with pytest.raises(DaemonUnavailable, match="in the middle of the answer"):
        async for chunk in client.chat_stream(ChatRequest([{"role": "user", "content": "hi"}])):
            got.append(chunk.text)
    await client.close()
    assert "".join(got) == ANSWER[:12]


async def test_http_errors_carry_the_daemons_message(fake):
    fake.behaviour.error_status = 429
    client = client_for(fake)
    with pytest.raises(DaemonError, match=r"waiting queue is full \(HTTP 429\)"):
        async for _ in client.chat_stream(ChatRequest([{"role": "user", "content": "hi"}])):
            pass
    await client.close()


async def test_leaving_the_stream_aborts_on_the_daemon(fake):
    fake.behaviour.delay_s = 0.05
    client = client_for(fake)

    async def read_some():
        async with aclosing(client.chat_stream(ChatRequest([{"role": "user", "content": "hi"}]))) as stream:
            async for chunk in stream:
                if chunk.text:
                    await asyncio.sleep(10)  # cancelled here, like Esc in the chat

    task = asyncio.create_task(read_some())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(fake.aborted.wait, 5), "the daemon never saw the client go away"
    assert fake.finished_requests == 0
    await client.close()
