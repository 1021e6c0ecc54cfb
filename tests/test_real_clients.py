"""The real agents and editors against one real `llmd serve` on the bundled SmolLM2 (8k context): Claude Code, Codex,
opencode, Continue's `cn`, aider and `llm` with llm-ollama, each run non-interactively as a user would, with a
scratch home and config (tests/real_clients.py). `make test-clients` installs them (pinned, in .clients/) and runs
this module; the `clients` marker keeps it out of `make test`.

A client passes when it exits 0, llmd logged a generation on the client's route, and the client printed the text
llmd generated. Every client talks to llmd through a recording proxy (tests/recording_proxy.py), so a failure shows
each request, llmd's status and message, and, for a refused request, every field llmd refuses in turn (the request
replayed without each). Each test prints what its client sent (`-rA` shows it for passing tests too).
"""

from __future__ import annotations

import json
import re

import pytest

from llmd_daemon_proc import start_daemon
from real_clients import (Run, assert_answered, assert_answered_or_too_long, client_exe, describe_request,
                          run_client)
from recording_proxy import RecordingProxy

pytestmark = [pytest.mark.clients, pytest.mark.slow]

MODEL = "smollm2:135m"  # the bundled model answers to this alias
QUESTION = "What is the capital of France? Answer in one short sentence."
CONTEXT = 8192  # SmolLM2's own context length
MESSAGES, RESPONSES, CHAT, OLLAMA_CHAT = ("/v1/messages",), ("/v1/responses",), ("/v1/chat/completions",), \
    ("/api/chat",)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("llmd_clients"), "--max-model-len", str(CONTEXT), "--keep-alive", "-1")
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def proxy(daemon):
    p = RecordingProxy(daemon.url).start()
    yield p
    p.stop()


@pytest.fixture
def run(daemon, proxy, tmp_path):
    """run(argv, env) -> Run: the client in a scratch home under tmp_path, printing what it sent."""
    def go(argv: list[str], env: dict[str, str], **kw) -> Run:
        result = run_client(argv, base=tmp_path, env=env, proxy=proxy, daemon_log=daemon.log_path, **kw)
        print(sent(result))
        return result
    return go


def sent(run: Run) -> str:
    """Each distinct request of a run (by route and fields) with llmd's status, and the fields llmd refused."""
    seen: set[tuple[str, tuple[str, ...], int]] = set()
    lines = [f"exit {run.rc} after {run.seconds:.0f}s; {len(run.exchanges)} request(s)"]
    for ex in run.exchanges:
        body = ex.body if isinstance(ex.body, dict) else {}
        key = (ex.path, tuple(sorted(body)), len(body.get("tools") or []))
        if key not in seen:
            seen.add(key)
            lines += [describe_request(ex), f"  -> {ex.summary()}"]
    lines += [line for line in run.log.splitlines() if " POST " in line or " WARNING " in line]
    return "\n".join(lines + run.refused)


# --- Claude Code (Anthropic Messages) ------------------------------------------------------------------------------

def claude_env(proxy: RecordingProxy) -> dict[str, str]:
    return {"ANTHROPIC_BASE_URL": proxy.url, "ANTHROPIC_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,  # its background calls (titles, ...) name a small model
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256"}  # it sends temperature 1 and max_tokens 32000 otherwise


def test_claude_code_small_prompt(run, proxy):
    """`claude -p` with its own system prompt replaced and no tools: the prompt a 135M model with 8k can take."""
    result = run([str(client_exe("claude")), "-p", QUESTION, "--system-prompt", "You are a helpful assistant.",
                  "--tools", "", "--bare", "--strict-mcp-config", "--no-session-persistence"],
                 {**claude_env(proxy), "ANTHROPIC_API_KEY": "unused"})
    assert_answered(result, MESSAGES)


def test_claude_code_default_tools_answers_or_is_told_the_prompt_is_too_long(run, proxy):
    """`claude -p` as installed: its default system prompt and tool set. When that prompt is longer than the
    context, llmd's 400 says so and Claude Code shows it; otherwise it answers."""
    result = run([str(client_exe("claude")), "-p", QUESTION, "--no-session-persistence"],
                 {**claude_env(proxy), "ANTHROPIC_AUTH_TOKEN": "unused"})
    for message in assert_answered_or_too_long(result, MESSAGES, CONTEXT):
        print(f"does not fit: {message}")


# --- Codex (OpenAI Responses; Ollama with --oss) ------------------------------------------------------------------

SMALL_CODEX = ('web_search = "disabled"\n', '[features]\nmulti_agent = false\ngoals = false\n')


def codex_home(tmp_path, proxy: RecordingProxy | None, small: bool) -> dict[str, str]:
    """CODEX_HOME with a config.toml: llmd as the model provider (unless `proxy` is None: `--oss` names its own);
    `small` turns off Codex's hosted search, its sub-agent tools (a namespace of five) and its goal tools, which takes
    its prompt from 9k tokens to 5.7k."""
    home = tmp_path / "codex"
    home.mkdir()
    top, tables = SMALL_CODEX if small else ("", "")
    if proxy is not None:
        top = f'model = "{MODEL}"\nmodel_provider = "llmd"\n' + top
        tables += f'[model_providers.llmd]\nname = "llmd"\nbase_url = "{proxy.url}/v1"\nwire_api = "responses"\n'
    (home / "config.toml").write_text(f"{top}\n{tables}")
    return {"CODEX_HOME": str(home)}


def test_codex_exec_responses(run, proxy, tmp_path):
    """`codex exec` with a model provider at llmd's /v1 (Responses), three tool sets off to fit 8k."""
    result = run([str(client_exe("codex")), "exec", "--skip-git-repo-check", "--ephemeral", QUESTION],
                 codex_home(tmp_path, proxy, small=True))
    assert_answered(result, RESPONSES)


def test_codex_exec_default_answers_or_is_told_the_prompt_is_too_long(run, proxy, tmp_path):
    result = run([str(client_exe("codex")), "exec", "--skip-git-repo-check", "--ephemeral", QUESTION],
                 codex_home(tmp_path, proxy, small=False))
    for message in assert_answered_or_too_long(result, RESPONSES, CONTEXT):
        print(f"does not fit: {message}")


def test_codex_oss_ollama(run, proxy, tmp_path):
    """`codex exec --oss`: Codex's built-in Ollama provider, its base URL moved to llmd."""
    env = codex_home(tmp_path, None, small=True)
    result = run([str(client_exe("codex")), "exec", "--oss", "--local-provider", "ollama", "-m", MODEL,
                  "--skip-git-repo-check", "--ephemeral", QUESTION],
                 {**env, "CODEX_OSS_BASE_URL": f"{proxy.url}/v1"})
    assert_answered(result, RESPONSES + CHAT)


# --- opencode (OpenAI chat completions through @ai-sdk/openai-compatible) ------------------------------------------

def test_opencode_run(run, proxy, tmp_path):
    config = tmp_path / "home" / ".config" / "opencode"
    config.mkdir(parents=True)
    (config / "opencode.json").write_text(json.dumps({
        "provider": {"llmd": {"npm": "@ai-sdk/openai-compatible", "options": {"baseURL": f"{proxy.url}/v1"},
                              "models": {MODEL: {}}}},
        "model": f"llmd/{MODEL}", "autoupdate": False, "share": "disabled"}))
    result = run([str(client_exe("opencode")), "run", QUESTION],
                 {"OPENCODE_DISABLE_MODELS_FETCH": "1"})  # models.dev is not reachable from a test
    assert_answered(result, CHAT)


# --- Continue's cn ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("provider", ["openai", "ollama"])
def test_continue_cn(run, proxy, tmp_path, provider):
    api_base = f"{proxy.url}/v1" if provider == "openai" else proxy.url
    config = tmp_path / "config.yaml"
    config.write_text(f"""name: llmd
version: 1.0.0
schema: v1
models:
  - name: SmolLM2 via llmd
    provider: {provider}
    model: {MODEL}
    apiBase: {api_base}
    roles:
      - chat
""")
    result = run([str(client_exe("cn")), "-p", "--config", str(config), QUESTION], {})
    assert_answered(result, CHAT + OLLAMA_CHAT)


# --- aider (litellm, OpenAI chat completions) ---------------------------------------------------------------------

def test_aider(run, proxy):
    result = run([str(client_exe("aider")), "--openai-api-base", f"{proxy.url}/v1", "--openai-api-key", "unused",
                  "--model", f"openai/{MODEL}", "--message", QUESTION, "--yes-always", "--no-git",
                  "--no-check-update", "--no-show-model-warnings", "--analytics-disable", "--no-pretty"],
                 {"LITELLM_LOCAL_MODEL_COST_MAP": "True"})  # litellm's price list is on GitHub: not reachable
    assert_answered(result, CHAT)


# --- llm with llm-ollama (Ollama API) -----------------------------------------------------------------------------

def test_llm_ollama(run, proxy, tmp_path):
    """llm-ollama names each model of /api/tags `ollama/NAME` (names of one digest are aliases of one model)."""
    env = {"OLLAMA_HOST": proxy.url, "LLM_USER_PATH": str(tmp_path / "llm")}
    listed = run([str(client_exe("llm")), "models"], env)
    result = run([str(client_exe("llm")), "-m", f"ollama/{MODEL}", QUESTION], env)
    assert listed.rc == 0, listed.report()
    ids = {i for line in listed.stdout.splitlines() if line.startswith("Ollama")
           for i in re.findall(r"ollama/[\w.:-]+", line)}
    assert f"ollama/{MODEL}" in ids, f"llm models lists {sorted(ids)}\n" + listed.report()
    assert_answered(result, OLLAMA_CHAT)
