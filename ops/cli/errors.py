"""The one way a ``ptops`` command fails: one ``error:`` line on stderr and an exit code (2: bad
input)."""

from __future__ import annotations

import typer


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
