"""One settings object for every command.

Precedence, highest first: command-line flags (the keyword overrides of `load_settings`), `LLMD_<FIELD>` environment
variables, `$XDG_CONFIG_HOME/llmd/config.toml` (or the file named by `LLMD_CONFIG`), then the defaults below.
A bad value is an LlmdError naming the key and where it came from, so the CLI prints one line instead of a traceback.

To add a setting: add a field with a default to `Settings` (and, if needed, a bound in `_BOUNDS`). Its env variable
and TOML key follow from the field name. A field named like an `EngineConfig` field is an engine setting: its bounds
and choices are the engine's own (`llmd.engine.config`), checked here as it is read, and it reaches the engine by name
(`llmd.server.daemon.engine_config`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tempfile
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .engine.config import EngineConfig, EngineConfigError, check_field
from .engine.types import DTYPE_NAMES, QuantMethod, SpecMode, choices
from .errors import LlmdError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

ENV_PREFIX = "LLMD_"
DEFAULT_PORT = 8471


class ConfigError(LlmdError):
    """A setting has a bad value; the message names the key and its source."""


# --- XDG base directories (https://specifications.freedesktop.org/basedir-spec/) ---


def _xdg(var: str, fallback: str) -> Path:
    value = os.environ.get(var, "")
    # The spec says relative paths are invalid and must be ignored.
    base = Path(value) if value and os.path.isabs(value) else Path.home() / fallback
    return base / "llmd"


def config_dir() -> Path:
    return _xdg("XDG_CONFIG_HOME", ".config")


def data_dir() -> Path:
    """Chat history and other user data."""
    return _xdg("XDG_DATA_HOME", ".local/share")


def state_dir() -> Path:
    """Logs and other state that survives restarts."""
    return _xdg("XDG_STATE_HOME", ".local/state")


def cache_dir() -> Path:
    """llmd's own cache. Model weights stay in the Hugging Face hub cache and are never copied here."""
    return _xdg("XDG_CACHE_HOME", ".cache")


def runtime_socket_path() -> Path:
    """Default Unix socket: `$XDG_RUNTIME_DIR/llmd.sock`, else a per-user folder in the temp dir (created 0700 by
    whoever binds it)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime):
        return Path(runtime) / "llmd.sock"
    return Path(tempfile.gettempdir()) / f"llmd-{os.getuid()}" / "llmd.sock"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: taskset, cgroup cpusets), the default of `threads`."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1  # macOS has no affinity mask


def config_file() -> Path:
    override = os.environ.get(ENV_PREFIX + "CONFIG")
    return Path(override).expanduser() if override else config_dir() / "config.toml"


# --- the settings ---

@dataclass
class Settings:
    # model: a name as `llmd.store.resolve` takes it; None means the bundled default
    model: str | None = None
    dtype: str | None = None  # "float32", "bfloat16", "float16"; None: fp32 on CPU, bf16 on CUDA
    quant: str | None = None  # a QuantMethod; None: a GGUF keeps its packing on CUDA, else unquantized
    device: str | None = None  # "cpu", "cuda", "cuda:1"; None: CUDA when available
    # CPU threads for each model's math (an engine setting); None: every core the process may use (usable_cores).
    # Fewer helps on a desktop whose cores are busy with other work: a matmul waits for its slowest thread.
    threads: int | None = None

    # server
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    socket_path: str | None = None  # None: runtime_socket_path(); "off" disables the Unix socket
    api_key: str | None = None
    api_key_file: str | None = None
    origins: list[str] = field(default_factory=list)  # extra allowed Origin values
    ollama_port: int | None = None  # opt-in second listener (Ollama's 11434) for unchanged editor configs
    max_queue: int = 64
    max_body_bytes: int = 4 * 1024 * 1024
    write_timeout: float = 30.0  # seconds a client may stall a stream before it is cut off
    stream_keepalive: float = 10.0  # seconds a stream may be quiet (queued, in prefill) before it sends a keep-alive
    shutdown_grace: float = 10.0  # seconds running streams get to finish on SIGTERM
    log_level: str = "info"  # debug also names the request fields that had no effect

    # the model manager (llmd.server.models)
    preload: list[str] = field(default_factory=list)  # more models loaded at start and never expired (pinned)
    keep_alive: str = "5m"  # how long an idle model stays loaded: 30s, 5m, 1h, seconds, negative = forever, 0
    max_loaded_models: int = 3
    memory_budget: int | None = None  # bytes for weights + KV of all loaded models; None: 90% VRAM / 75% RAM
    # [models.NAME] tables of config.toml: a model served under NAME, local (path = "...") or on another server
    # speaking OpenAI's API (url = "http://gpu-box:8000/v1", model = its name there, api_key, timeout)
    models: dict = field(default_factory=dict)

    # engine
    block_size: int = 16
    # None below means the engine's own default for the device (see llmd.engine.config.EngineConfig.resolved)
    kv_cache_bytes: int | None = None  # explicit KV pool size; wins over kv_cache_fraction
    kv_cache_fraction: float | None = None  # CUDA: share of the memory left after the weights
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # a KvCacheDtype: auto (the device's default) | fp32 | fp16 | bf16 | int8
    cuda_graphs: bool = True  # CUDA: replay decode steps from CUDA graphs (off: every step launches its kernels)
    draft_model: str | None = None  # speculative decoding draft (a model, self:N, mtp); None: off, or the MTP head
    num_speculative_tokens: int = 4
    # EngineConfig.speculative_mode (a SpecMode: off | ngram | draft | auto); None: auto with a draft model, else off
    spec_mode: str | None = None
    spec_max_batch: int | None = None  # auto mode: no speculation above this many sequences per step
    seed: int | None = None

    def resolved_socket_path(self) -> Path | None:
        if self.socket_path == "off":
            return None
        return Path(self.socket_path).expanduser() if self.socket_path else runtime_socket_path()


# Inclusive (low, high) bounds of the settings that are not the engine's (engine fields: llmd.engine.config.BOUNDS);
# None means unbounded on that side.
_BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "port": (0, 65535),
    "max_loaded_models": (1, 64),
    "memory_budget": (1, None),
    "ollama_port": (0, 65535),
    "max_body_bytes": (1024, 1 << 31),
    "write_timeout": (0.1, 3600),
    "stream_keepalive": (0.01, 3600),
    "shutdown_grace": (0, 3600),
}
_CHOICES: dict[str, tuple[str, ...]] = {"dtype": tuple(DTYPE_NAMES), "quant": choices(QuantMethod),
                                        "spec_mode": choices(SpecMode),
                                        "log_level": ("debug", "info", "warning", "error")}

_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
# the settings that are engine settings, by the EngineConfig field each one is
_ENGINE_FIELDS = {f.name: f.name for f in dataclasses.fields(EngineConfig) if f.name in _FIELDS} | \
    {"spec_mode": "speculative_mode"}
_HINTS = typing.get_type_hints(Settings)


def _base_type(name: str) -> tuple[type, bool]:
    """The field's value type and whether None is allowed."""
    hint = _HINTS[name]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return hint, False


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(name: str, raw, source: str):
    """Turn a raw value (a string from env, any TOML value, a flag value) into the field's type, or raise."""
    kind, optional = _base_type(name)
    value: int | float | str

    def bad(why: str) -> ConfigError:
        return ConfigError(f"bad value {raw!r} for {name} ({source}): {why}")

    if raw is None or (optional and isinstance(raw, str) and not raw.strip()):
        if optional:
            return None
        if raw is None:
            raise bad("a value is required")
    if typing.get_origin(kind) is list:
        if isinstance(raw, str):
            items = [s.strip() for s in raw.split(",") if s.strip()]
        elif isinstance(raw, (list, tuple)):
            items = list(raw)
        else:
            raise bad("must be a list of strings (or a comma-separated string)")
        if not all(isinstance(s, str) for s in items):
            raise bad("must be a list of strings")
        return items
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            return raw.strip().lower() in _TRUE
        raise bad("must be true or false")
    if kind is int:
        if isinstance(raw, bool):
            raise bad("must be an integer")
        if isinstance(raw, int):
            value = raw
        elif isinstance(raw, str):
            try:
                value = int(raw.strip().replace("_", ""), 0)
            except ValueError:
                raise bad("must be an integer") from None
        else:
            raise bad("must be an integer")
    elif kind is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise bad("must be a number")
        try:
            value = float(raw)
        except ValueError:
            raise bad("must be a number") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise bad("must be a finite number")
    elif kind is str:
        if not isinstance(raw, str):
            raise bad("must be a string")
        value = raw
        if name in _CHOICES and value not in _CHOICES[name]:
            raise bad("must be one of " + ", ".join(_CHOICES[name]))
    else:  # pragma: no cover - a field type this loader does not know yet
        raise TypeError(f"Settings.{name}: unsupported type {kind}")
    low, high = _BOUNDS.get(name, (None, None))
    if not isinstance(value, str) and ((low is not None and value < low) or (high is not None and value > high)):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise bad(f"must be between {lo} and {hi}")
    if name in _ENGINE_FIELDS:  # the engine's own bounds and choices (llmd.engine.config)
        try:
            check_field(_ENGINE_FIELDS[name], value)
        except EngineConfigError as exc:
            raise bad(exc.why) from None
    return value


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    # Accept `max-queue` as well as `max_queue`, and tables ([server], [engine]) as a way to group keys.
    # [models.NAME] tables stay tables: each one is a model (checked by configured_models).
    flat: dict = {}
    for key, value in data.items():
        if key == "models":
            flat[key] = value
        elif isinstance(value, dict):
            for sub, subvalue in value.items():
                flat[sub] = subvalue
        else:
            flat[key] = value
    return {k.replace("-", "_"): v for k, v in flat.items()}


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value) -> float | None:
    """Ollama's keep_alive: a number of seconds or a Go duration string ("5m", "1h30m", "90s", "300"); negative means
    forever (None), 0 means unload at once. ValueError with the reason otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("must be a duration like \"5m\" or a number of seconds")
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = float(body)  # a bare number: seconds
        except ValueError:
            parts = _DURATION_PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"{value!r} is not a duration (examples: 30s, 5m, 1h30m, -1 for forever)") from None
            seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
        seconds *= sign
    else:
        seconds = float(value)
    if seconds != seconds or abs(seconds) == float("inf"):
        raise ValueError("must be a finite duration")
    return None if seconds < 0 else seconds


_MODEL_KEYS: dict[str, type | tuple[type, ...]] = {"url": str, "model": str, "api_key": str, "path": str, "keep_alive": (str, int, float),
               "timeout": (int, float)}


def configured_models(raw, path: Path) -> dict[str, dict]:
    """The [models.NAME] tables, checked: each has a url (a remote OpenAI-compatible server) or a path (a file)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: models must be a table of [models.NAME] tables")
    out = {}
    for name, table in raw.items():
        where = f"[models.{name}] in {path}"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: must be a table (url = ..., or path = ...)")
        unknown = set(table) - set(_MODEL_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(_MODEL_KEYS)})")
        for key, kind in _MODEL_KEYS.items():
            if key in table and (isinstance(table[key], bool) or not isinstance(table[key], kind)):
                raise ConfigError(f"{where}: {key} has the wrong type ({type(table[key]).__name__})")
        if ("url" in table) == ("path" in table):
            raise ConfigError(f"{where}: give exactly one of url (a remote server) or path (a model file or folder)")
        if "url" in table and not str(table["url"]).startswith(("http://", "https://")):
            raise ConfigError(f"{where}: url must start with http:// or https:// (it is {table['url']!r})")
        if "timeout" in table and not 0 < table["timeout"] <= 86400:
            raise ConfigError(f"{where}: timeout must be between 0 and 86400 seconds")
        if "keep_alive" in table:
            try:
                parse_keep_alive(table["keep_alive"])
            except ValueError as exc:
                raise ConfigError(f"{where}: keep_alive {exc}") from None
        out[str(name)] = dict(table)
    return out


def load_settings(**overrides) -> Settings:
    """Build the settings. `overrides` are command-line flags; a None value means "flag not given"."""
    unknown = set(overrides) - set(_FIELDS)
    if unknown:
        raise TypeError(f"load_settings: unknown settings {sorted(unknown)}")
    values: dict = {}

    path = config_file()
    for key, raw in _read_toml(path).items():
        if key not in _FIELDS:
            raise ConfigError(f"unknown key {key!r} in {path} (known keys: {', '.join(_FIELDS)})")
        values[key] = configured_models(raw, path) if key == "models" else _convert(key, raw, f"config file {path}")

    for name in _FIELDS:
        if name == "models":
            continue  # only the config file names models by table
        env = ENV_PREFIX + name.upper()
        if env in os.environ:
            values[name] = _convert(name, os.environ[env], f"environment variable {env}")

    for name, raw in overrides.items():
        if raw is not None:
            values[name] = _convert(name, raw, "--" + name.replace("_", "-"))

    settings = Settings(**values)
    try:
        parse_keep_alive(settings.keep_alive)
    except ValueError as exc:
        raise ConfigError(f"bad value {settings.keep_alive!r} for keep_alive: {exc}") from None
    if settings.api_key_file and not settings.api_key:
        key_path = Path(settings.api_key_file).expanduser()
        try:
            settings.api_key = key_path.read_text().strip() or None
        except OSError as exc:
            raise ConfigError(f"api_key_file {key_path}: cannot read: {exc.strerror}") from None
    return settings
