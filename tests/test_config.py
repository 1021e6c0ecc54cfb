"""Settings: flags > LLMD_* env > config.toml > defaults, and bad values named with their source."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmd.config import (
    ConfigError,
    Settings,
    cache_dir,
    config_dir,
    config_file,
    data_dir,
    load_settings,
    runtime_socket_path,
    state_dir,
)
from llmd.errors import LlmdError


@pytest.fixture(autouse=True)
def clean_env(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith("LLMD_") or name.startswith("XDG_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config" / "llmd" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_without_any_source():
    s = load_settings()
    assert s == Settings()
    assert (s.host, s.port, s.model, s.enable_prefix_caching) == ("127.0.0.1", 8471, None, True)


def test_precedence_flag_over_env_over_toml_over_default(tmp_path, monkeypatch):
    write_config(tmp_path, 'port = 9001\nmax_queue = 7\nmodel = "from-toml"\nhost = "127.0.0.2"\n')
    monkeypatch.setenv("LLMD_PORT", "9002")
    monkeypatch.setenv("LLMD_MODEL", "from-env")
    s = load_settings(port=9003, model=None)  # a flag left unset (None) does not override
    assert s.port == 9003  # flag
    assert s.model == "from-env"  # env beats toml
    assert s.max_queue == 7 and s.host == "127.0.0.2"  # toml beats defaults
    assert s.write_timeout == Settings().write_timeout  # default


def test_toml_tables_and_dashed_keys(tmp_path):
    write_config(tmp_path, '[server]\nmax-queue = 3\norigins = ["vscode-webview://x"]\n[engine]\nblock_size = 32\n')
    s = load_settings()
    assert (s.max_queue, s.origins, s.block_size) == (3, ["vscode-webview://x"], 32)


def test_env_types(monkeypatch):
    monkeypatch.setenv("LLMD_ENABLE_PREFIX_CACHING", "off")
    monkeypatch.setenv("LLMD_ORIGINS", "http://a.test, http://b.test")
    monkeypatch.setenv("LLMD_WRITE_TIMEOUT", "2.5")
    monkeypatch.setenv("LLMD_SEED", "")  # empty means unset for optional values
    s = load_settings()
    assert s.enable_prefix_caching is False
    assert s.origins == ["http://a.test", "http://b.test"]
    assert s.write_timeout == 2.5 and s.seed is None


def test_llmd_config_points_at_another_file(tmp_path, monkeypatch):
    other = tmp_path / "elsewhere.toml"
    other.write_text("port = 1234\n")
    monkeypatch.setenv("LLMD_CONFIG", str(other))
    assert config_file() == other
    assert load_settings().port == 1234


def test_bad_env_value_names_variable(monkeypatch):
    monkeypatch.setenv("LLMD_PORT", "eighty")
    with pytest.raises(ConfigError, match=r"'eighty' for port \(environment variable LLMD_PORT\): must be an integer"):
        load_settings()


def test_bad_toml_value_names_key_and_file(tmp_path):
    path = write_config(tmp_path, "max_queue = 0\n")
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert "max_queue" in str(err.value) and str(path) in str(err.value) and "between 1" in str(err.value)
    assert isinstance(err.value, LlmdError)  # so the CLI prints it as one line


def test_bad_flag_value_names_flag():
    with pytest.raises(ConfigError, match=r"--kv-cache-fraction\): must be between"):
        load_settings(kv_cache_fraction=1.5)
    with pytest.raises(ConfigError, match=r"block_size .*power of two"):
        load_settings(block_size=24)
    with pytest.raises(ConfigError, match=r"dtype .*must be one of"):
        load_settings(dtype="float8")


def test_wrong_toml_type(tmp_path):
    write_config(tmp_path, 'enable_prefix_caching = "maybe"\n')
    with pytest.raises(ConfigError, match="enable_prefix_caching .*must be true or false"):
        load_settings()
    write_config(tmp_path, "port = true\n")
    with pytest.raises(ConfigError, match="port .*must be an integer"):
        load_settings()


def test_unknown_toml_key_is_named(tmp_path):
    write_config(tmp_path, "prot = 80\n")
    with pytest.raises(ConfigError, match="unknown key 'prot'"):
        load_settings()


def test_invalid_toml_names_file(tmp_path):
    path = write_config(tmp_path, "port = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML") as err:
        load_settings()
    assert str(path) in str(err.value)


def test_api_key_file(tmp_path, monkeypatch):
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    monkeypatch.setenv("LLMD_API_KEY_FILE", str(key))
    assert load_settings().api_key == "s3cret"
    monkeypatch.setenv("LLMD_API_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="api_key_file"):
        load_settings()


def test_xdg_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "d"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "s"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "k"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "r"))
    assert config_dir() == tmp_path / "c" / "llmd"
    assert data_dir() == tmp_path / "d" / "llmd"
    assert state_dir() == tmp_path / "s" / "llmd"
    assert cache_dir() == tmp_path / "k" / "llmd"
    assert runtime_socket_path() == tmp_path / "r" / "llmd.sock"
    assert load_settings().resolved_socket_path() == tmp_path / "r" / "llmd.sock"
    assert load_settings(socket_path="off").resolved_socket_path() is None


def test_xdg_fallbacks(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_DATA_HOME", "relative/path")  # the spec says: ignore relative paths
    for var in ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(var, raising=False)
    assert config_dir() == tmp_path / ".config" / "llmd"
    assert data_dir() == tmp_path / ".local" / "share" / "llmd"
    assert state_dir() == tmp_path / ".local" / "state" / "llmd"
    assert cache_dir() == tmp_path / ".cache" / "llmd"
    assert runtime_socket_path().name == "llmd.sock"
    assert f"llmd-{os.getuid()}" in str(runtime_socket_path())


def test_engine_settings_are_checked_by_the_engines_own_bounds_and_choices():
    """One place for an engine knob's bounds and choices (llmd.engine.config): the settings refuse a value with the
    same reason the engine would, and accept every value of the engine's vocabulary."""
    from llmd.engine.config import EngineConfig, EngineConfigError
    from llmd.engine.types import KvCacheDtype, QuantMethod, SpecMode, choices

    for name, value in (("max_num_seqs", 5000), ("max_model_len", 1), ("num_speculative_tokens", 17),
                        ("kv_cache_fraction", 0.999), ("kv_cache_dtype", "fp8"), ("block_size", 24)):
        with pytest.raises(EngineConfigError) as engine_err:
            EngineConfig(**{name: value}).validate()
        with pytest.raises(ConfigError) as settings_err:
            load_settings(**{name: value})
        assert str(settings_err.value).endswith(f"({'--' + name.replace('_', '-')}): {engine_err.value.why}")
    with pytest.raises(ConfigError, match=r"spec_mode \(--spec-mode\): must be one of off, ngram, draft, auto"):
        load_settings(spec_mode="sometimes")
    assert [load_settings(kv_cache_dtype=k).kv_cache_dtype for k in choices(KvCacheDtype)] == list(choices(KvCacheDtype))
    assert [load_settings(spec_mode=m).spec_mode for m in choices(SpecMode)] == list(choices(SpecMode))
    assert [load_settings(quant=q).quant for q in choices(QuantMethod)] == list(choices(QuantMethod))
    assert load_settings(max_queue=1_000_000).max_queue == 1_000_000
