"""The model store: model names -> files (local folder, .gguf, HF hub cache, bundled default); pull, list, show, rm."""

from .aliases import ALIASES, DRAFT_PAIRS, draft_for
from .bundled import BUNDLED_NAME, bundled_model_path
from .files import ModelFiles
from .hub import hub_cache_dir
from .info import ModelInfo, describe, human_count, human_size
from .manage import ListedModel, list_models, remove_model
from .pull import pull
from .resolve import resolve

__all__ = [
    "ALIASES", "BUNDLED_NAME", "DRAFT_PAIRS", "ListedModel", "ModelFiles", "ModelInfo", "bundled_model_path",
    "describe", "draft_for", "human_count", "human_size", "hub_cache_dir", "list_models", "pull", "remove_model",
    "resolve",
]
