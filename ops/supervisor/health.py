"""Health checks before work: run before attempt 1 and before each restart, as one table.

Why: a restart onto a node whose disk is full, whose rendezvous address does not route or whose
GPUs lost a device fails again after minutes of start-up (or, worse, trains on a bad device);
NVIDIA's ft_launcher checks GPUs, NICs and storage before each restart, and so does ptops. A check
is one row of :data:`CHECKS` (name, why, function): adding one touches this table only. Each returns
``ok`` True / False, or None when it does not apply here (no GPU: no NVML check). The supervisor
records every result in one ``health_check`` event per attempt and ends a run whose check failed
(``failed``, exit 1: the node, not the job, is at fault; under Slurm a requeue onto other nodes may
help); the incident names the check.

``[supervisor.health]`` (``recipes/schema.py::HealthConfig``): ``enabled``, ``min_free_mb`` (free
space the checkpoint directory needs: at least this, and twice the newest checkpoint's size),
``skip`` (check names not to run), ``rendezvous_timeout_s``.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

MB = 1 << 20


@dataclass
class Context:
    """What the checks look at, gathered by the supervisor before an attempt."""

    ckpt_dir: Path
    min_free_mb: float
    newest_ckpt: Path | None = None
    rendezvous: list[tuple[str, int]] = field(
        default_factory=list
    )  # (host, port) the ranks will dial
    timeout_s: float = 2.0
    expected_gpus: int | None = (
        None  # GPUs a node must have; None: launch.nproc where NVML sees any
    )
    nproc: int = 1
    nvml: Any = None  # pynvml or a stand-in; None: imported on demand


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool | None  # None: does not apply here
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


def _dir_mb(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total / MB


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def checkpoint_space(ctx: Context) -> tuple[bool | None, str]:
    need = ctx.min_free_mb
    why = f"supervisor.health.min_free_mb={ctx.min_free_mb:g}"
    if ctx.newest_ckpt is not None and ctx.newest_ckpt.exists():
        twice = 2 * _dir_mb(ctx.newest_ckpt)
        if twice > need:
            need, why = twice, f"twice the newest checkpoint {ctx.newest_ckpt.name}"
    free = shutil.disk_usage(_existing(ctx.ckpt_dir)).free / MB
    ok = free >= need
    return ok, f"{free:.0f} MB free in {ctx.ckpt_dir}, {need:.0f} MB needed ({why})"


def checkpoint_writable(ctx: Context) -> tuple[bool | None, str]:
    ctx.ckpt_dir.mkdir(parents=True, exist_ok=True)
    probe = ctx.ckpt_dir / f".health-{uuid.uuid4().hex[:8]}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return (
            False,
            f"cannot write {ctx.ckpt_dir}: {errno.errorcode.get(e.errno, e.errno)} {e.strerror}",
        )
    finally:
        probe.unlink(missing_ok=True)
    return True, f"wrote and removed 4 KiB in {ctx.ckpt_dir}"


def rendezvous(ctx: Context) -> tuple[bool | None, str]:
    """Each address resolves and routes (a UDP connect sends nothing: the kernel picks a route or
    says the network is unreachable); nothing listens there yet, so no TCP handshake is tried."""
    if not ctx.rendezvous:
        return None, "no rendezvous address"
    for host, port in ctx.rendezvous:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except OSError as e:
            return False, f"{host}:{port} does not resolve: {e}"
        family, kind, proto, _, addr = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.settimeout(ctx.timeout_s)
            try:
                s.connect(addr)
            except OSError as e:
                return False, f"{host}:{port} ({addr[0]}) is not reachable: {e.strerror or e}"
    return True, ", ".join(f"{h}:{p}" for h, p in ctx.rendezvous) + " resolve and route"


def gpus(ctx: Context) -> tuple[bool | None, str]:
    """NVML: as many devices as the run wants, none with uncorrected ECC errors (volatile count).
    Without a stated count (``slurm.gpus_per_node``), a node where NVML sees no GPU runs on CPU."""
    if ctx.expected_gpus == 0:
        return None, "a CPU run: no GPU expected"
    nv = ctx.nvml
    try:
        if nv is None:
            import pynvml as nv  # noqa: PLC0415 - only here
        nv.nvmlInit()
    except Exception as e:  # noqa: BLE001 - no library, no driver
        if ctx.expected_gpus is None:
            return None, f"no NVML here ({type(e).__name__}): a CPU run"
        return (
            False,
            f"NVML unavailable ({type(e).__name__}: {e}); {ctx.expected_gpus} GPU(s) expected",
        )
    try:
        n = nv.nvmlDeviceGetCount()
        want = ctx.nproc if ctx.expected_gpus is None else ctx.expected_gpus
        if ctx.expected_gpus is None and n == 0:
            return None, "NVML sees no GPU: a CPU run"
        if n < want:
            return False, f"{n} GPU(s) visible, {want} expected"
        bad = []
        for i in range(n):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            try:
                ecc = nv.nvmlDeviceGetTotalEccErrors(h, 1, 0)  # uncorrected, volatile
            except Exception:  # noqa: BLE001 - ECC not supported on this device
                continue
            if ecc:
                bad.append(f"GPU {i}: {ecc} uncorrected ECC error(s)")
        if bad:
            return False, "; ".join(bad)
        return True, f"{n} GPU(s) ({want} wanted), no uncorrected ECC errors"
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


@dataclass(frozen=True)
class Check:
    name: str
    why: str
    run: Callable[[Context], tuple[bool | None, str]]


CHECKS: tuple[Check, ...] = (
    Check(
        "checkpoint_space",
        "a save that hits a full disk loses the steps since the last one",
        checkpoint_space,
    ),
    Check(
        "checkpoint_writable", "a read-only or vanished mount fails every save", checkpoint_writable
    ),
    Check(
        "rendezvous",
        "ranks that cannot reach the rendezvous hang in start-up until a timeout",
        rendezvous,
    ),
    Check("gpus", "a lost device or uncorrected ECC errors crash or corrupt the run", gpus),
)
NAMES = tuple(c.name for c in CHECKS)


def run_checks(ctx: Context, skip: tuple[str, ...] | list[str] = ()) -> list[Result]:
    """Every check not skipped, in table order; a check that raises fails with its error."""
    out = []
    for c in CHECKS:
        if c.name in skip:
            continue
        try:
            ok, detail = c.run(ctx)
        except Exception as e:  # noqa: BLE001 - a broken check is a failed check, named
            ok, detail = False, f"{type(e).__name__}: {e}"
        out.append(Result(c.name, ok, detail))
    return out
