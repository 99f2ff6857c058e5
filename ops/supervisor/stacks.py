"""Stacks of ranks that are not answering over the channel: py-spy, run by their node agent.

py-spy reads a process' memory from outside (``--nonblocking``), so it works on a
SIGSTOPped rank or one stuck in C code; the rank allows it via ``PR_SET_PTRACER``
(``ops/rank/entry.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def py_spy() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    candidate = Path(sys.executable).parent / "py-spy"
    return str(candidate) if candidate.exists() else None


def with_py_spy(pid: int, timeout_s: float = 20.0) -> tuple[str | None, str]:
    """(stack text, note). ``None`` text when py-spy is missing or failed."""
    exe = py_spy()
    if exe is None:
        return None, "py-spy not installed"
    try:
        out = subprocess.run(
            [exe, "dump", "--pid", str(pid), "--nonblocking", "--locals"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return None, f"py-spy timed out after {timeout_s:g} s"
    if out.returncode != 0 or not out.stdout.strip():
        return None, f"py-spy failed ({out.returncode}): {(out.stderr or out.stdout).strip()[:300]}"
    return out.stdout, "py-spy dump --nonblocking"


def write_private(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    for d in (path.parent.parent, path.parent):
        try:
            os.chmod(d, 0o700)
        except OSError:
            pass
    data = text.encode() if isinstance(text, str) else text
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
