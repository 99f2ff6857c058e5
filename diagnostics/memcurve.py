"""The memory curve of a crashed rank, for an OOM incident in ``ptops diagnose``.

Why: "killed by the OOM killer" says what, not how; the rank's own records (``mem_rss_mb`` against
``mem_limit_mb``, ``cuda_reserved_mb`` against ``cuda_total_mb``, stamped by the probe every step)
show whether memory climbed for many steps (a leak: the ``memory`` monitor's forecast) or jumped
at the last one (a batch or a save too big). Pure: records in, rows out.
"""

from __future__ import annotations

from typing import Any

KEYS = ("mem_rss_mb", "mem_limit_mb", "cuda_reserved_mb", "cuda_total_mb")
WORDS = ("memory", "oom", "OutOfMemory", "MemoryError")


def about_memory(info: dict[str, Any]) -> bool:
    """Whether a crash explanation (``diagnostics.crash.explain``) is about memory."""
    exc = info.get("exception") or {}
    text = " ".join(
        str(x)
        for x in (info.get("words"), info.get("cause"), exc.get("type"), exc.get("message"))
        if x
    )
    return any(w.lower() in text.lower() for w in WORDS)


def memory_curve(
    metrics: list[dict[str, Any]], attempt: int | None, rank: int | None, n: int = 12
) -> list[dict[str, Any]]:
    """The last ``n`` records of ``rank`` in ``attempt`` that carry memory keys, oldest first."""
    if rank is None:
        return []
    rows = [
        {"step": r["step"], **{k: r[k] for k in KEYS if r.get(k) is not None}}
        for r in metrics
        if r.get("rank") == rank
        and (attempt is None or r.get("attempt") in (attempt, None))
        and isinstance(r.get("step"), int)
        and any(r.get(k) is not None for k in KEYS)
    ]
    return rows[-n:]


def curve_lines(curve: list[dict[str, Any]]) -> list[str]:
    """One line a step: host RSS of its limit, and CUDA reserved of the device where recorded."""
    out = []
    for r in curve:
        parts = []
        if "mem_rss_mb" in r:
            lim = r.get("mem_limit_mb")
            parts.append(f"RSS {r['mem_rss_mb']:.0f} MB" + (f" of {lim:.0f} MB" if lim else ""))
        if "cuda_reserved_mb" in r:
            tot = r.get("cuda_total_mb")
            parts.append(
                f"CUDA reserved {r['cuda_reserved_mb']:.0f} MB"
                + (f" of {tot:.0f} MB" if tot else "")
            )
        out.append(f"step {r['step']}: " + ", ".join(parts))
    return out
