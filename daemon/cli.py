"""The `llmd` command line. Every command is thin: it parses its flags, then calls one function elsewhere."""

from __future__ import annotations

import sys

import typer

from .errors import LlmdError

app = typer.Typer(
    name="llmd",
    help="llmd: a local LLM serving daemon for one GPU (or the CPU).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def fail(message: str) -> None:
    """Print one clear line on stderr and exit 1."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


# --- commands (each engineer inserts theirs below this line) ---


def main() -> None:
    try:
        app()
    except LlmdError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(1)
