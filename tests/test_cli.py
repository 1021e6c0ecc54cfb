"""The `llmd` command as users run it: a real subprocess of the installed console script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LLMD = str(Path(sys.executable).parent / "llmd")


@pytest.fixture
def env(tmp_path) -> dict:
    """A clean environment: an empty HF cache, no user config, no LLMD_* settings."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("LLMD_", "HF_", "XDG_"))}
    e.update(HF_HOME=str(tmp_path / "hf"), XDG_CONFIG_HOME=str(tmp_path / "config"), HF_HUB_OFFLINE="1")
    return e


def llmd(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([LLMD, *args], env=env, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_help_lists_every_command(env):
    result = llmd(env, "--help")
    assert result.returncode == 0
    for command in ("pull", "list", "show", "rm", "generate"):
        assert command in result.stdout
    no_args = llmd(env)  # bare `llmd` shows the same help, successfully
    assert no_args.returncode == 0 and "generate" in no_args.stdout


def test_version(env):
    from llmd import __version__

    result = llmd(env, "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"llmd {__version__}"


def test_generate_help_documents_defaults(env):
    result = llmd(env, "generate", "--help")
    assert result.returncode == 0
    for flag in ("--model", "--max-tokens", "--temperature", "--seed", "--raw"):
        assert flag in result.stdout
    assert "greedy" in result.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["generate", "--max-tokens", "lots", "hi"], "--max-tokens"),
        (["generate", "--temperature", "-1", "hi"], "--temperature"),
        (["generate", "--top-p", "2", "hi"], "--top-p"),
        (["generate", "--frobnicate", "hi"], "--frobnicate"),
        (["generate"], "Missing argument"),
        (["no-such-command"], "no-such-command"),
    ],
)
def test_usage_errors_are_one_line(env, args, fragment):
    assert_one_line_error(llmd(env, *args), fragment)


def test_bad_setting_from_env_is_one_line(env):
    env["LLMD_DTYPE"] = "float8"
    assert_one_line_error(llmd(env, "generate", "hi"), "LLMD_DTYPE", "float8")


def test_bad_device_and_quant_are_one_line(env):
    assert_one_line_error(llmd(env, "generate", "--device", "gpu", "hi"), "unknown device 'gpu'")
    assert_one_line_error(llmd(env, "generate", "--quant", "int3", "hi"), "--quant", "int3")
    assert_one_line_error(llmd(env, "generate", "--threads", "0", "hi"), "--threads", "between 1")


def test_unknown_model_says_how_to_pull(env):
    assert_one_line_error(llmd(env, "generate", "--model", "qwen2.5:0.5b", "hi"), "llmd pull qwen2.5:0.5b")
    assert_one_line_error(llmd(env, "show", "mystery-model"), "unknown model", "llmd pull")


def test_corrupt_gguf_names_the_file(env, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (7).to_bytes(8, "little") + bytes(9))
    assert_one_line_error(llmd(env, "generate", "--model", str(truncated), "hi"), str(truncated))
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"\x80\x02pickle")
    assert_one_line_error(llmd(env, "show", str(not_gguf)), str(not_gguf), "not a GGUF file")


def test_list_show_rm_on_the_bundled_model(env, smollm2_gguf):
    listed = llmd(env, "list")
    assert listed.returncode == 0
    assert "smollm2:135m-instruct-q4_1" in listed.stdout and "Q4_1" in listed.stdout
    shown = llmd(env, "show")
    assert shown.returncode == 0
    for expected in ("architecture:    llama", "context length:  8192", "chat template:   yes", smollm2_gguf.name):
        assert expected in shown.stdout
    assert_one_line_error(llmd(env, "rm", "smollm2:135m-instruct-q4_1"), "bundled default")
    assert smollm2_gguf.exists()


def test_pull_offline_is_one_line(env):
    assert_one_line_error(llmd(env, "pull", "qwen2.5:0.5b"), "HF_HUB_OFFLINE")


def test_generate_on_a_tiny_hf_folder(env, tiny_llama):
    # Random weights, so only the plumbing is checked: HF folder -> loader -> engine -> streamed text, both with the
    # chat template and --raw, and the token count reported on stderr; --threads sets the CPU threads used.
    for extra, threads in (([], "2"), (["--raw"], "1")):
        result = llmd(env, "generate", "--model", str(tiny_llama), "--max-tokens", "5", "--seed", "1", *extra,
                      "--threads", threads, "Hello there", timeout=300)
        assert result.returncode == 0, result.stderr
        assert f"loaded {tiny_llama.name} in" in result.stderr
        assert f"{threads} CPU threads" in result.stderr
        assert "generated tokens in" in result.stderr


@pytest.mark.slow
def test_generate_answers_paris_on_the_default_model(env):
    # The README command as is (greedy by default); the answer streams to stdout, load time and speed to stderr.
    result = llmd(env, "generate", "What is the capital of France?", timeout=900)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "loaded smollm2:135m-instruct-q4_1 in" in result.stderr
