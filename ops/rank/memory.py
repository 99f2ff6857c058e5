"""What a rank reports about its memory on every step record, so an OOM can be seen coming.

Why here: the probe stamps every record of every engine (titan, TRL, a user's script) in one place,
and the supervisor's memory monitor (``monitors/memory.py``, pure) forecasts from these keys alone:

- ``mem_rss_mb``: this process's resident set now (``/proc/self/statm``; cheap, read per step);
- ``mem_limit_mb``: what the kernel kills it at: the cgroup's limit (v2 ``memory.max``, v1
  ``memory.limit_in_bytes``), else the machine's RAM (read once per process);
- ``cuda_alloc_mb``, ``cuda_reserved_mb``, ``cuda_peak_mb``, ``cuda_total_mb``: where torch has
  initialised CUDA in this process (never initialised here: a CPU rank pays nothing for them).

Keys an engine already put on the record win (the probe only fills what is missing).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MB = 1 << 20
_UNLIMITED = 1 << 60  # cgroup v1 writes ~2^63 for "no limit"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_limit: list[float | None] = []  # read once per process


def rss_mb() -> float | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return round(int(f.read().split()[1]) * _PAGE / MB, 1)
    except (OSError, ValueError, IndexError):
        return None


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < _UNLIMITED else None


def _cgroup_paths(root: Path = Path("/sys/fs/cgroup")) -> list[Path]:
    """This process's cgroup limit files: its own group first, then the root's (a container)."""
    own: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        rel = parts[2].lstrip("/")
        if parts[0] == "0" and parts[1] == "":  # v2 unified hierarchy
            own.append(root / rel / "memory.max")
        elif "memory" in parts[1].split(","):  # v1 memory controller
            own.append(root / "memory" / rel / "memory.limit_in_bytes")
    return own + [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]


def _ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def limit_mb() -> float | None:
    """The host memory limit this process runs under, in MB (cgroup, else RAM); cached."""
    if not _limit:
        found = next((v for v in map(_read_limit, _cgroup_paths()) if v is not None), None)
        found = found if found is not None else _ram_bytes()
        _limit.append(round(found / MB, 1) if found else None)
    return _limit[0]


def cuda_mb() -> dict[str, float]:
    """CUDA allocator figures of the current device, only where torch already initialised CUDA."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return {}
        dev = torch.cuda.current_device()
        return {
            "cuda_alloc_mb": round(torch.cuda.memory_allocated(dev) / MB, 1),
            "cuda_reserved_mb": round(torch.cuda.memory_reserved(dev) / MB, 1),
            "cuda_peak_mb": round(torch.cuda.max_memory_reserved(dev) / MB, 1),
            "cuda_total_mb": round(torch.cuda.get_device_properties(dev).total_memory / MB, 1),
        }
    except Exception:  # a figure we cannot read is left out, never a failed step
        return {}


def sample() -> dict[str, float]:
    """The memory keys for this step's record (those that could be read)."""
    out: dict[str, float] = {}
    rss = rss_mb()
    if rss is not None:
        out["mem_rss_mb"] = rss
    lim = limit_mb()
    if lim is not None:
        out["mem_limit_mb"] = lim
    out.update(cuda_mb())
    return out
