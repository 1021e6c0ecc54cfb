"""llmd: a local LLM serving daemon."""

__version__ = "0.1.0"
