"""The model store: model names -> files (local folder, .gguf, HF hub cache, Ollama's store, bundled default); pull,
list, show, rm. `resolve` takes names from the command line and config (paths allowed); `resolve_name` takes names
from requests (never a path)."""

from .aliases import ALIASES, DRAFT_PAIRS, draft_for
from .bundled import BUNDLED_NAME, bundled_model_path
from .files import ModelFiles
from .hub import hub_cache_dir
from .info import ModelInfo, describe, human_count, human_size
from .manage import ListedModel, list_models, remove_model
from .names import BadModelName, check_name, resolve_name
from .ollama import OllamaStore
from .pull import pull
from .resolve import resolve

__all__ = [
    "ALIASES", "BUNDLED_NAME", "BadModelName", "OllamaStore", "check_name", "resolve_name", "DRAFT_PAIRS", "ListedModel", "ModelFiles", "ModelInfo", "bundled_model_path",
    "describe", "draft_for", "human_count", "human_size", "hub_cache_dir", "list_models", "pull", "remove_model",
    "resolve",
]
