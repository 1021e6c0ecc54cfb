"""Snapshots of the main screens at a fixed size (pytest-textual-snapshot). Update on purpose with
`pytest tests/test_tui_snapshots.py --snapshot-update`, then look at the SVGs before committing them."""

from __future__ import annotations

import pytest

from llmd.tui.chat_app import ChatApp
from llmd.tui.client import DaemonClient, Endpoint
from llmd.tui.store import ChatStore, Message
from llmd.tui.top_app import TopApp, TopView
from tui_fake_daemon import ANSWER, FakeDaemon, engine_stats, fixed_stats

SIZE = (110, 36)
TIMINGS = {"queue_ms": 1.5, "prefill_ms": 20.0, "ttft_ms": 21.5, "decode_ms": 300.0, "tpot_ms": 12.5,
           "e2e_ms": 321.5, "prompt_tokens": 40, "cached_prompt_tokens": 32, "generated_tokens": 18,
           "tokens_per_second": 80.0, "spec_proposed": 20, "spec_accepted": 15}


@pytest.fixture
def fake():
    daemon = FakeDaemon().start()
    yield daemon
    daemon.stop()


def chat_app(daemon, tmp_path) -> ChatApp:
    store = ChatStore(tmp_path / "chat.db")
    older = store.create("Rust lifetimes")
    store.add_message(older.id, Message("user", "What is a lifetime?"))
    conv = store.create("Adding numbers", model="fake-model", temperature=0.2)
    store.add_message(conv.id, Message("user", "Write a Python function that adds two numbers."))
    store.add_message(conv.id, Message("assistant", ANSWER, timings=TIMINGS, model="fake-model"))
    return ChatApp(DaemonClient([Endpoint(port=daemon.port)]), store)


async def until_connected(pilot):
    for _ in range(200):
        if "connected" in str(pilot.app.query_one("#status").render()):
            break
        await pilot.pause(0.05)
    await pilot.pause()


def test_chat_screen(fake, tmp_path, snap_compare):
    assert snap_compare(chat_app(fake, tmp_path), terminal_size=SIZE, run_before=until_connected)


def test_help_screen(fake, tmp_path, snap_compare):
    async def open_help(pilot):
        await until_connected(pilot)
        await pilot.press("f1")
        await pilot.pause()

    assert snap_compare(chat_app(fake, tmp_path), terminal_size=SIZE, run_before=open_help)


def test_settings_screen(fake, tmp_path, snap_compare):
    async def open_settings(pilot):
        await until_connected(pilot)
        await pilot.press("ctrl+o")
        await pilot.pause(0.3)

    assert snap_compare(chat_app(fake, tmp_path), terminal_size=SIZE, run_before=open_settings)


def test_model_picker_screen(fake, tmp_path, snap_compare):
    fake.behaviour.models = ["fake-model", "other-model", "qwen2.5-coder:1.5b"]

    async def open_picker(pilot):
        await until_connected(pilot)
        await pilot.press("ctrl+l")
        for _ in range(100):
            if pilot.app.screen.query("#models") and pilot.app.screen.entries:
                break
            await pilot.pause(0.05)
        await pilot.pause(0.3)

    assert snap_compare(chat_app(fake, tmp_path), terminal_size=SIZE, run_before=open_picker)


def test_no_daemon_screen(tmp_path, snap_compare):
    # Port 1 on loopback: nothing listens there, so the offer to start a daemon shows, with a stable address.
    app = ChatApp(DaemonClient([Endpoint(port=1)]), ChatStore(tmp_path / "chat.db"))

    async def wait_offer(pilot):
        for _ in range(100):
            if pilot.app.screen.query("#start"):
                break
            await pilot.pause(0.05)
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=wait_offer)


def test_top_screen(snap_compare):
    # Fed a fixed series (not live), so the sparklines are the same on every run.
    async def feed(pilot):
        view = pilot.app.query_one(TopView)
        for t in range(60):
            view.show(fixed_stats(
                tokens_per_second=30.0 + (t * 7) % 25, requests_running=1 + t % 4, requests_waiting=t % 3,
                last_batch_size=1 + t % 4, steps_total=1000 + t,
                latency={"queue_ms": {"p50": 2.0 + t % 5}, "prefill_ms": {"p50": 40.0 + t % 9},
                         "decode_ms": {"p50": 280.0 + (t * 3) % 40}},
                second=engine_stats(  # a second model, with an int8 KV cache and speculation
                    tokens_per_second=10.0, requests_running=1, requests_waiting=0, last_batch_size=1,
                    kv={**engine_stats()["kv"], "dtype": "int8", "bytes_per_token": 12240, "blocks_used": 10,
                        "blocks_cached": 5, "blocks_free": 85,
                        "seqs_8k_by_dtype": {"fp32": 1, "fp16": 3, "bf16": 3, "int8": 6}},
                    spec={"mode": "ngram", "proposed_total": 40, "accepted_total": 30, "drafts_total": 10,
                          "acceptance_rate": 0.75, "mean_accepted_length": 3.0}),
            ))
        await pilot.pause()

    assert snap_compare(TopApp(None, live=False), terminal_size=(110, 40), run_before=feed)
