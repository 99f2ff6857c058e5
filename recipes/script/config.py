"""The ``[script]`` recipe section: the user's command, where it runs, extra environment (no torch
here)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ScriptSection(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    command: list[str] = Field(
        ...,
        min_length=1,
        description='the command each rank runs, e.g. ["python", "train.py", "--lr", "1e-3"]; '
        "a Python "
        "interpreter with a .py file or -m module runs inside the rank process (stacks, flight "
        "recorder, "
        "optimizer-step beats), any other program as a child process (liveness and exit code only)",
    )
    cwd: str = Field(
        "",
        description="working directory of the command (relative paths: from where ptops was "
        "launched); empty: where ptops was launched",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="extra environment variables of the command"
    )


def check(recipe: Any) -> "tuple[str, str] | None":
    if not recipe.script.command[0].strip():
        return "script.command", "the program (first word) is empty"
    return None
