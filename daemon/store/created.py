"""Names made with Ollama's /api/create and /api/copy: each is a model of the stores (its FROM) with defaults of its
own: PARAMETER options over the base's, a SYSTEM message for requests that bring none, a TEMPLATE replacing the
base's chat template. `llmd.store.names.resolve_name` finds them; the server applies their defaults per name.

Rules:
- They live in one JSON file, `created-models.json` in llmd's data dir (name -> from, parameters, template, system,
  license, modified_at), written whole and atomically. Nothing is written anywhere else: no weights are copied, and
  Ollama's own store is never touched.
- A name is checked like a request's model name (never a path) and must be an Ollama name
  (`[host/][namespace/]model[:tag]`); it is kept in Ollama's short form (`mine` -> `mine:latest`). A name that a
  model of the stores already answers to (bundled, an alias, the HF cache, Ollama's store) cannot be taken.
- FROM names a model of the stores or another created name; the latter is flattened when it is made (its base and
  settings are copied in), so deleting one created name never breaks another.
- TEMPLATE is a Jinja chat template (what llmd renders, as Hugging Face tokenizers carry them); Ollama's Go templates
  (`{{ .Prompt }}`) are refused with a message that says so.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import LlmdError, ModelNotFound
from .files import ModelFiles
from .modelfile import Modelfile, ModelfileError

log = logging.getLogger("llmd.store")

FILE_NAME = "created-models.json"
MAX_CREATED = 1000
MAX_FILE_BYTES = 16 << 20
_write_lock = threading.Lock()


@dataclass(frozen=True)
class Created:
    name: str  # Ollama's short form: `mine:latest`
    base: str  # a model of the stores, as the creator named it
    parameters: dict = field(default_factory=dict)  # Ollama-named options over the base's
    template: str | None = None  # a Jinja chat template replacing the base's
    system: str | None = None  # the system message for requests that bring none
    license: str | None = None
    modified_at: float = 0.0  # wall clock

    def settings(self) -> dict:
        """What changes the model's answers (its digest covers these): the non-empty settings."""
        out = {"parameters": self.parameters, "template": self.template, "system": self.system}
        return {k: v for k, v in out.items() if v}

    def to_json(self) -> dict:
        return {"from": self.base, "parameters": self.parameters, "template": self.template, "system": self.system,
                "license": self.license, "modified_at": self.modified_at}


def created_file() -> Path:
    from ..config import data_dir

    return data_dir() / FILE_NAME


def canonical_name(name: str) -> str | None:
    """The Ollama short form of a name (`mine` -> `mine:latest`), None when it is not an Ollama name."""
    from .ollama import parse_name

    parsed = parse_name(name.strip()) if isinstance(name, str) else None
    return parsed.short if parsed is not None else None


def find_created(name: str) -> Created | None:
    key = canonical_name(name)
    return _read().get(key) if key is not None else None


def list_created() -> list[Created]:
    return sorted(_read().values(), key=lambda c: c.name)


def create(name: str, spec: Modelfile, now: float) -> Created:
    """Make (or remake) `name` from a Modelfile's settings; ModelfileError / BadModelName / ModelNotFound say why
    not, each naming the request field."""
    target = _new_name(name, "model")
    if not spec.base:
        raise ModelfileError("from is required (FROM in a modelfile): the model to build on", "from")
    base, inherited = _base(spec.base, "from")
    if spec.template is not None:
        check_template(spec.template)
    parent = inherited or Created(target, base)
    entry = Created(target, base, {**parent.parameters, **spec.parameters},
                    spec.template if spec.template is not None else parent.template,
                    spec.system if spec.system is not None else parent.system,
                    spec.license if spec.license is not None else parent.license, now)
    _write(entry.name, entry)
    return entry


def copy(source: str, destination: str, now: float) -> Created:
    """A new name for a model of the stores or a created one (the same model: the same digest)."""
    target = _new_name(destination, "destination")
    base, inherited = _base(source, "source")
    entry = replace(inherited, name=target, modified_at=now) if inherited else Created(target, base, modified_at=now)
    _write(entry.name, entry)
    return entry


def remove_created(name: str) -> bool:
    """Forget a created name; False when there is none of that name."""
    key = canonical_name(name)
    if key is None or key not in _read():
        return False
    _write(key, None)
    return True


def check_template(template: str) -> None:
    from ..model.chat_template import compile_template

    go_style = "{{ ." in template or "{{- ." in template or "{{ if ." in template
    try:
        compile_template(template)
    except Exception as exc:  # noqa: BLE001 - any Jinja syntax error
        why = "it looks like an Ollama Go template, which llmd does not render" if go_style else f"{exc}"
        raise ModelfileError(f"template is not a Jinja chat template ({why}); give one that renders `messages`, "
                             "as in a Hugging Face tokenizer_config.json", "template") from None
    if "messages" not in template:
        raise ModelfileError("template must be a Jinja chat template that renders `messages`", "template")


def resolve_created(entry: Created) -> ModelFiles:
    """The files of a created name: its base's, carrying the entry."""
    from .names import resolve_store_name

    try:
        files = resolve_store_name(entry.base)
    except ModelNotFound:
        raise ModelNotFound(f"model {entry.name!r} was made from {entry.base!r}, which is no longer available; "
                            f"delete it or create it again") from None
    return replace(files, created=entry)


def _new_name(name: str, field_name: str) -> str:
    from .aliases import ALIASES
    from .names import BadModelName, check_name, resolve_store_name

    try:
        key = canonical_name(check_name(name))
    except BadModelName as exc:
        raise ModelfileError(f"{field_name}: {exc}", field_name) from None
    if key is None:
        raise ModelfileError(f"{field_name}: {name[:80]!r} is not a model name (Ollama's form: [namespace/]model[:tag]"
                             ", with letters, digits, '.', '_' and '-')", field_name)
    if key in _read():
        return key  # made here before: made again
    taken = key in ALIASES or key.removesuffix(":latest") in ALIASES
    if not taken:
        try:
            resolve_store_name(key)
            taken = True
        except LlmdError:
            pass
    if taken:
        raise ModelfileError(f"{field_name}: {key!r} is already the name of a model llmd serves from its stores; "
                             "choose another name", field_name)
    return key


def _base(name: str, field_name: str) -> tuple[str, Created | None]:
    """(the store name a new entry builds on, the created entry it copies settings from, if any)."""
    from .names import BadModelName, check_name, resolve_store_name

    try:
        name = check_name(name)
    except BadModelName as exc:
        raise ModelfileError(f"{field_name}: {exc}", field_name) from None
    inherited = find_created(name)
    if inherited is not None:
        return inherited.base, inherited
    try:
        resolve_store_name(name)
    except ModelNotFound as exc:
        raise ModelNotFound(f"{field_name}: {exc}") from None
    return name, None


def _read(strict: bool = False) -> dict[str, Created]:
    """The entries; an unreadable file reads as none (strict: an LlmdError, so that no write replaces it)."""
    path = created_file()
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        if strict:
            raise LlmdError(f"{path} cannot be read ({exc}); fix or remove it") from None
        log.warning("ignoring %s: %s", path, exc)
        return {}
    models = data.get("models") if isinstance(data, dict) else None
    out: dict[str, Created] = {}
    for name, entry in (models or {}).items() if isinstance(models, dict) else ():
        try:
            out[name] = _entry(name, entry)
        except (TypeError, ValueError) as exc:  # one bad entry must not hide the others
            log.warning("%s: skipping %r: %s", path, name, exc)
    return out


def _entry(name: str, raw) -> Created:
    from .modelfile import check_parameters

    if canonical_name(name) != name or not isinstance(raw, dict) or not isinstance(raw.get("from"), str):
        raise ValueError("not a created model entry")
    texts = {k: raw.get(k) for k in ("template", "system", "license")}
    if any(v is not None and not isinstance(v, str) for v in texts.values()):
        raise ValueError("template, system and license must be strings")
    try:
        params = check_parameters(raw.get("parameters") or {})
    except ModelfileError as exc:
        raise ValueError(str(exc)) from None
    modified = raw.get("modified_at")
    return Created(name, raw["from"], params, texts["template"], texts["system"], texts["license"],
                   float(modified) if isinstance(modified, (int, float)) else 0.0)


def _write(name: str, entry: Created | None) -> None:
    """Set or (None) remove one entry: read, change, write to a temporary file, rename over."""
    path = created_file()
    with _write_lock:
        models = {k: v.to_json() for k, v in _read(strict=True).items()}
        if entry is None:
            models.pop(name, None)
        else:
            if name not in models and len(models) >= MAX_CREATED:
                raise ModelfileError(f"at most {MAX_CREATED} created models; delete some first", "model")
            models[name] = entry.to_json()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"version": 1, "models": models}, indent=1), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as exc:
            raise LlmdError(f"cannot write {path}: {exc.strerror}") from None
