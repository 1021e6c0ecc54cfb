"""Fast checks of the server's pure parts: host/origin/token rules, field tables, metrics text, key file, service unit."""

from __future__ import annotations

import os
import subprocess

import pytest

from llmd.engine.types import EngineStats, KvStats, RequestTimings, SpecStats
from llmd.errors import LlmdError
from llmd.server.metrics import Metrics
from llmd.server.responses import timings_dict
from llmd.server.security import SecurityPolicy, is_loopback_host, read_key_file
from llmd.server.validation import MAX_NEW_TOKENS, ApiError, Field, check_fields, parse_messages


@pytest.mark.parametrize("host, ok", [
    ("localhost", True), ("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("[::1]", True),
    ("app.localhost", True), ("LOCALHOST.", True), ("example.com", False), ("localhost.evil.com", False),
    ("10.0.0.1", False), ("0.0.0.0", False), ("127.0.0.1.nip.io", False),
])
def test_loopback_hosts(host, ok):
    assert is_loopback_host(host) is ok


def test_host_header_with_ports_and_extra_hosts():
    p = SecurityPolicy()
    assert p.host_allowed("localhost:8471") and p.host_allowed("[::1]:8471") and p.host_allowed(None)
    assert not p.host_allowed("evil.com:8471") and not p.host_allowed("192.168.1.5:8471")
    assert SecurityPolicy(extra_hosts=frozenset({"192.168.1.5"})).host_allowed("192.168.1.5:8471")


@pytest.mark.parametrize("origin, ok", [
    (None, True), ("", True), ("http://localhost:3000", True), ("https://127.0.0.1", True),
    ("vscode-webview://1234abcd", True), ("vscode-file://vscode-app", True), ("http://[::1]:80", True),
    ("https://evil.com", False), ("null", False), ("http://localhost.evil.com", False), ("file://", False),
    ("chrome-extension://abc", False),
])
def test_origins(origin, ok):
    assert SecurityPolicy().origin_allowed(origin) is ok


def test_llmd_origins_adds_exact_and_scheme_entries():
    p = SecurityPolicy(origins=("https://my.dev", "myeditor://"))
    assert p.origin_allowed("https://my.dev") and p.origin_allowed("myeditor://panel")
    assert not p.origin_allowed("https://my.dev.evil.com")


def test_token_compare():
    p = SecurityPolicy(api_key="s3cret")
    assert p.token_ok("Bearer s3cret") and p.token_ok("bearer s3cret")
    for bad in (None, "", "s3cret", "Bearer s3cre", "Bearer s3cret2", "Basic s3cret"):
        assert not p.token_ok(bad)
    assert SecurityPolicy().token_ok(None)
    # Anthropic clients send the key as x-api-key
    assert p.request_token_ok({"x-api-key": "s3cret"}) and p.request_token_ok({"Authorization": "Bearer s3cret"})
    for headers in ({}, {"x-api-key": ""}, {"x-api-key": "s3cre"}, {"x-api-key": "Bearer s3cret"}):
        assert not p.request_token_ok(headers)
    assert SecurityPolicy().request_token_ok({})


def test_key_file_must_be_private(tmp_path):
    key = tmp_path / "key"
    key.write_text("abc\n")
    key.chmod(0o644)
    with pytest.raises(LlmdError, match="readable by others"):
        read_key_file(key)
    key.chmod(0o600)
    assert read_key_file(key) == "abc"
    with pytest.raises(LlmdError, match="missing"):
        read_key_file(tmp_path / "missing")


def test_field_table_checks():
    table = {"n": Field("int", 1, 10), "t": Field("number", 0, 2), "s": Field("stop"), "b": Field("bool"),
             "p": Field("str|list")}
    assert check_fields({"n": 3.0, "t": 1, "s": "x", "p": [1, 2], "other": object()}, table) == {
        "n": 3, "t": 1, "s": ["x"], "p": [1, 2]}
    for body, field in (({"n": 11}, "n"), ({"n": True}, "n"), ({"t": "1"}, "t"), ({"t": float("inf")}, "t"),
                        ({"s": [1]}, "s"), ({"b": 1}, "b"), ({"p": {"a": 1}}, "p"), ({"n": 2.5}, "n")):
        with pytest.raises(ApiError) as err:
            check_fields(body, table)
        assert err.value.status == 400 and err.value.param == field and str(err.value).startswith(field)


def test_messages_parsing():
    msgs = parse_messages([{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                            "text": "b"}]}])
    assert msgs == [{"role": "system", "content": "ab"}]
    with pytest.raises(ApiError, match=r"messages\[1\]\.role"):
        parse_messages([{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}])


def test_metrics_text_and_timings():
    m = Metrics()
    t = RequestTimings(arrival=0.0, first_scheduled=0.01, first_token=0.2, token_times=[0.2, 0.25, 0.3],
                       finished=0.3, num_prompt_tokens=10, num_cached_tokens=4, num_generated_tokens=3)
    m.observe_request(t, "stop")
    kv = KvStats(dtype="fp16", block_size=16, bytes_per_token=64, cache_bytes=100 * 16 * 64, blocks_total=100,
                 blocks_used=30, blocks_cached=10, blocks_free=60)
    text = m.render(EngineStats(requests_running=1, kv=kv), "m")
    assert 'llmd:time_to_first_token_seconds_bucket{model_name="m",le="0.25"} 1' in text
    assert 'llmd:time_to_first_token_seconds_bucket{model_name="m",le="0.1"} 0' in text
    assert 'llmd:inter_token_latency_seconds_count{model_name="m"} 2' in text
    assert 'llmd:kv_cache_usage_perc{model_name="m"} 0.3' in text
    assert 'llmd:request_success_total{model_name="m",finished_reason="stop"} 1' in text
    assert 'llmd:num_requests_running{model_name="m"} 1' in text
    assert "spec_decode" not in text  # the speculation families exist for a model that speculates
    spec = SpecStats(mode="ngram", proposed_total=8, accepted_total=6, drafts_total=2, acceptance_rate=0.75,
                     mean_accepted_length=3.0)
    text = m.render({"m": EngineStats(kv=kv, spec=spec), "remote": EngineStats(remote_url="http://h/v1")})
    assert 'llmd:spec_decode_num_accepted_tokens_total{model_name="m"} 6' in text
    assert 'llmd:spec_decode_draft_acceptance_rate{model_name="m"} 0.75' in text
    assert 'llmd:kv_cache_usage_perc{model_name="remote"}' not in text  # a remote model's KV lives upstream
    assert 'llmd:generation_tokens_total{model_name="remote"} 0' in text
    d = timings_dict(t)
    assert d["ttft_ms"] == 200.0 and d["queue_ms"] == 10.0 and d["cached_prompt_tokens"] == 4
    assert d["tokens_per_second"] == 20.0


def test_service_install_writes_unit(tmp_path):
    from llmd_daemon_proc import llmd_exe

    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path)}
    out = subprocess.run([llmd_exe(), "service", "install", "--no-enable"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    unit = (tmp_path / "systemd" / "user" / "llmd.service").read_text()
    assert "Restart=on-failure" in unit and " serve" in unit and "@EXEC_START@" not in unit
    assert "StandardError=journal" in unit
    out = subprocess.run([llmd_exe(), "service", "uninstall"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not (tmp_path / "systemd" / "user" / "llmd.service").exists()


def _parsed(route: str, body: dict):
    from llmd.server import anthropic, llamacpp, ollama, openai, responses_api
    from llmd.server.core import ServerState
    from llmd.server.response_store import ResponseStore

    state = ServerState(model_name="m")
    msgs = [{"role": "user", "content": "hi"}]
    if route == "openai-chat":
        return openai.parse_chat({"model": "m", "messages": msgs, **body}, state)
    if route == "openai-completions":
        return openai.parse_completion({"model": "m", "prompt": "hi", **body}, state)
    if route == "llamacpp":
        return llamacpp.parse_completion({"prompt": "hi", **body}, state)
    if route == "anthropic":
        return anthropic.parse({"model": "m", "messages": msgs, "max_tokens": 64, **body}, state)[0]
    if route == "responses":
        return responses_api.parse({"model": "m", "input": "hi", **body}, state, ResponseStore())[0]
    return ollama.parse_chat({"model": "m", "messages": msgs, "options": body}, state)


OWN = {  # each route's names for temperature 0.9 and stop ["X"] (the Responses API has no stop)
    "openai-chat": {"temperature": 0.9, "stop": ["X"], "max_tokens": 7},
    "openai-completions": {"temperature": 0.9, "stop": ["X"], "max_tokens": 7},
    "llamacpp": {"temperature": 0.9, "stop": ["X"], "n_predict": 7},
    "anthropic": {"temperature": 0.9, "stop_sequences": ["X"], "max_tokens": 7},
    "responses": {"temperature": 0.9, "max_output_tokens": 7},
    "ollama": {"temperature": 0.9, "stop": ["X"], "num_predict": 7},
}


@pytest.mark.parametrize("route", sorted(OWN))
def test_model_defaults_fill_what_the_request_left_unset_on_every_route(route):
    from llmd.server.intake import with_model_defaults

    defaults = {"temperature": 0.0, "stop": ["<|end|>"], "num_ctx": 512, "top_k": 5, "num_predict": -1}
    plain = with_model_defaults(_parsed(route, {}), defaults)
    assert plain.params.temperature == 0.0 and plain.params.stop == ["<|end|>"] and plain.params.top_k == 5
    # num_predict -1: to the context end (Anthropic's max_tokens is required, so the request's own)
    assert plain.num_ctx == 512 and plain.params.max_tokens == (64 if route == "anthropic" else MAX_NEW_TOKENS)
    own = with_model_defaults(_parsed(route, OWN[route]), defaults)
    assert own.params.temperature == 0.9 and own.params.max_tokens == 7 and own.params.top_k == 5
    assert own.params.stop == (["<|end|>"] if route == "responses" else ["X"])
    assert with_model_defaults(_parsed(route, {}), {}).params == _parsed(route, {}).params  # no defaults: as parsed
