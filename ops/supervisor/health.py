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
``skip`` (check names not to run), ``rendezvous_timeout_s``, ``max_clock_skew_s``,
``node_timeout_s``.

Under Slurm the table runs on every node of the allocation, spares included, in one ``srun`` step
before each attempt (``ops/node/health.py``); the context travels as JSON (:meth:`Context.to_dict`)
and each node measures its clock against the supervisor's (:class:`ClockServer`, NTP's offset from
the fastest of a few round trips). A local run has one clock: ``clock_skew`` does not apply.
"""

from __future__ import annotations

import errno
import hmac
import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

MB = 1 << 20
# a node check step's environment (ops/node/health.py): the context as JSON, the clock's token


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
    clock: tuple[str, int] | None = None  # the supervisor's ClockServer; None: one node, one clock
    clock_token: str = ""
    max_clock_skew_s: float = 1.0
    clock_offset_s: float = 0.0  # injected (fault clock-skew): added to this node's clock reading
    kmsg: str = "/dev/kmsg"  # the kernel log (XIDs); a file in its format in the tests
    boot_id_path: str = "/proc/sys/kernel/random/boot_id"
    xid_mark: tuple[str, int] | None = None  # (boot id, last record seen) of the previous check
    xid_seen: tuple[str, int] | None = None  # set by gpu_xid: the next check's xid_mark

    def to_dict(self) -> dict[str, Any]:
        """What a node's check step needs (JSON; no NVML handle, no token: those stay local)."""
        d = asdict(self)
        d.pop("nvml"), d.pop("clock_token")
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any], token: str = "") -> "Context":
        return cls(
            ckpt_dir=Path(d["ckpt_dir"]),
            min_free_mb=float(d["min_free_mb"]),
            newest_ckpt=Path(d["newest_ckpt"]) if d.get("newest_ckpt") else None,
            rendezvous=[(str(h), int(p)) for h, p in d.get("rendezvous") or []],
            timeout_s=float(d.get("timeout_s", 2.0)),
            expected_gpus=None if d.get("expected_gpus") is None else int(d["expected_gpus"]),
            nproc=int(d.get("nproc", 1)),
            clock=(str(d["clock"][0]), int(d["clock"][1])) if d.get("clock") else None,
            clock_token=token,
            max_clock_skew_s=float(d.get("max_clock_skew_s", 1.0)),
            clock_offset_s=float(d.get("clock_offset_s", 0.0)),
            kmsg=str(d.get("kmsg") or "/dev/kmsg"),
            boot_id_path=str(d.get("boot_id_path") or "/proc/sys/kernel/random/boot_id"),
            xid_mark=(str(d["xid_mark"][0]), int(d["xid_mark"][1])) if d.get("xid_mark") else None,
        )


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool | None  # None: does not apply here
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}

    @classmethod
    def from_report(cls, d: Any) -> "Result":
        """One result from a node's report file (written by a process on another node: trusted
        only as far as its shape; an unknown name or a wrong type is a failed ``report``)."""
        if not isinstance(d, dict) or d.get("name") not in NAMES or d.get("ok") not in (
            True, False, None
        ):  # fmt: skip
            return cls("report", False, f"a malformed result in the node's report: {str(d)[:120]}")
        return cls(str(d["name"]), d["ok"], str(d.get("detail", ""))[:500])


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
            import pynvml as nv  # only here
        nv.nvmlInit()
    except Exception as e:  # no library, no driver
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
        bad = [x for i in range(n) for x in _device_faults(nv, i)]
        if bad:
            return False, "; ".join(bad)
        return True, (
            f"{n} GPU(s) ({want} wanted): no uncorrected ECC errors, no pending page retirement "
            "or row remap, no hardware slowdown"
        )
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass


# hardware clock-slowdown reasons (nvmlClocksEventReason*): a GPU held there straggles the job
HW_SLOWDOWN = {0x8: "hw_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown"}


def _device_faults(nv: Any, i: int) -> list[str]:
    """What is wrong with GPU ``i``; each field read on its own (a field a GPU does not support
    is skipped, not a failure)."""
    h = nv.nvmlDeviceGetHandleByIndex(i)
    out = []

    def read(name: str, *args: Any) -> Any:
        fn = getattr(nv, name, None)
        try:
            return None if fn is None else fn(h, *args)
        except Exception:  # NVMLError_NotSupported and kin
            return None

    ecc = read("nvmlDeviceGetTotalEccErrors", 1, 0)  # uncorrected, volatile
    if ecc:
        out.append(f"GPU {i}: {ecc} uncorrected ECC error(s)")
    if read("nvmlDeviceGetRetiredPagesPendingStatus") == 1:
        out.append(f"GPU {i}: retired memory pages pending (a GPU reset is needed)")
    rows = read("nvmlDeviceGetRemappedRows")  # (corrected, uncorrected, pending, failed)
    if isinstance(rows, (tuple, list)) and len(rows) == 4:
        if rows[3]:
            out.append(f"GPU {i}: row remapping failed (the GPU needs replacing)")
        elif rows[2]:
            out.append(f"GPU {i}: row remap pending (a GPU reset is needed)")
    reasons = read("nvmlDeviceGetCurrentClocksEventReasons")
    if reasons is None:
        reasons = read("nvmlDeviceGetCurrentClocksThrottleReasons")
    slow = [label for bit, label in HW_SLOWDOWN.items() if int(reasons or 0) & bit]
    if slow:
        out.append(f"GPU {i}: clocks held down by {', '.join(slow)}")
    return out


# XIDs that mean the GPU must be reset or the node drained (runbooks/GPUErrors.md)
CRITICAL_XIDS = (48, 63, 64, 74, 79, 94, 95)
_XID = re.compile(rb"NVRM: Xid \(([^)]*)\): (\d+)")


def _kernel_log(path: str) -> list[tuple[int, bytes]]:
    """(sequence, message) of every record in the kernel log (``/dev/kmsg`` format:
    ``prio,seq,usec,flags;message``; a regular file in that format reads the same)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    chunks = []
    try:
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break  # the end of /dev/kmsg
            except BrokenPipeError:
                continue  # a record overwritten while reading: the next one
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(fd)
    out = []
    for line in b"".join(chunks).splitlines():
        head, sep, msg = line.partition(b";")
        fields = head.split(b",")
        if sep and len(fields) >= 3 and fields[1].isdigit():
            out.append((int(fields[1]), msg))
    return out


def gpu_xid(ctx: Context) -> tuple[bool | None, str]:
    """Critical XID events in the kernel log since this node's last check (the whole boot at the
    first check of a supervisor): the driver's word that a GPU fell off the bus or lost memory."""
    if ctx.expected_gpus == 0:
        return None, "a CPU run: no GPU expected"
    try:
        boot = Path(ctx.boot_id_path).read_text().strip()
        records = _kernel_log(ctx.kmsg)
    except OSError as e:
        return None, f"kernel log {ctx.kmsg} not readable here ({e.strerror or e})"
    since = ctx.xid_mark[1] if ctx.xid_mark and ctx.xid_mark[0] == boot else -1
    ctx.xid_seen = (boot, max((seq for seq, _ in records), default=since))
    xids = []
    for seq, msg in records:
        m = _XID.search(msg)
        if m and seq > since:
            xids.append((m.group(1).decode(errors="replace"), int(m.group(2))))
    if not xids and not any(b"NVRM" in msg for _, msg in records):
        if ctx.expected_gpus is None:
            return None, "no NVIDIA driver messages in the kernel log: a CPU node"
    crit = [f"Xid {code} on {pci}" for pci, code in xids if code in CRITICAL_XIDS]
    other = len(xids) - len(crit)
    window = "since the last check" if since >= 0 else "since boot"
    if crit:
        return False, f"{'; '.join(crit[:5])} {window}" + (f" (+{other} other)" if other else "")
    return True, f"no critical XID {window}" + (f" ({other} other)" if other else "")


class ClockServer:
    """The supervisor's clock for ``clock_skew``: a UDP responder that answers a request carrying
    the token with its ``time.time()`` (runs while the nodes are checked; a request without the
    token gets no answer)."""

    def __init__(self, token: str, host: str = "0.0.0.0"):
        self.token = token.encode()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ptops-clock", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self.sock.recvfrom(512)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            try:
                req = json.loads(data)
                ok = hmac.compare_digest(str(req["token"]).encode(), self.token)
                nonce = str(req["n"])[:64]
            except (ValueError, KeyError, TypeError):
                continue
            if ok:
                reply = json.dumps({"n": nonce, "t": time.time()}).encode()
                try:
                    self.sock.sendto(reply, peer)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()

    def __enter__(self) -> "ClockServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def clock_offset(
    addr: tuple[str, int], token: str, tries: int = 5, timeout_s: float = 1.0, skew: float = 0.0
) -> tuple[float, float] | None:
    """(offset, half round trip) of the server's clock minus this node's (plus ``skew``, an
    injected error), from the fastest of ``tries`` round trips (NTP's estimate); None: no answer."""
    best: tuple[float, float] | None = None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout_s)
        for i in range(tries):
            nonce = f"{uuid.uuid4().hex}-{i}"
            t0 = time.time() + skew
            try:
                s.sendto(json.dumps({"token": token, "n": nonce}).encode(), addr)
                while True:
                    data, _ = s.recvfrom(512)
                    reply = json.loads(data)
                    if isinstance(reply, dict) and reply.get("n") == nonce:
                        break
            except (OSError, ValueError):
                continue
            t1 = time.time() + skew
            server = reply.get("t")
            if not isinstance(server, (int, float)):
                continue
            half = (t1 - t0) / 2
            sample = (float(server) - (t0 + half), half)
            if best is None or sample[1] < best[1]:
                best = sample
    return best


def clock_skew(ctx: Context) -> tuple[bool | None, str]:
    """This node's clock against the supervisor's: rank events from every node land on one
    timeline (hang found times, goodput, an incident's order), so a skew reorders what happened."""
    if ctx.clock is None:
        return None, "one node, one clock: nothing to compare"
    got = clock_offset(ctx.clock, ctx.clock_token, timeout_s=ctx.timeout_s, skew=ctx.clock_offset_s)
    where = f"{ctx.clock[0]}:{ctx.clock[1]}"
    if got is None:
        return False, f"no answer from the supervisor's clock at {where} within {ctx.timeout_s:g} s"
    offset, half = got
    ok = abs(offset) - half <= ctx.max_clock_skew_s
    side = "behind" if offset > 0 else "ahead of"
    return ok, (
        f"this node's clock is {abs(offset):.3f} s {side} the supervisor's (+-{half * 1000:.1f} "
        f"ms; at most {ctx.max_clock_skew_s:g} s allowed)"
    )


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
    Check(
        "gpus",
        "a lost device, uncorrected ECC errors or pending memory repairs crash or corrupt the "
        "run; a GPU held down by hardware slowdown straggles it",
        gpus,
    ),
    Check(
        "gpu_xid",
        "a GPU that fell off the bus or lost memory since the last check fails the next attempt",
        gpu_xid,
    ),
    Check(
        "clock_skew",
        "events from a node whose clock is off land out of order on the run's timeline",
        clock_skew,
    ),
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
        except Exception as e:  # a broken check is a failed check, named
            ok, detail = False, f"{type(e).__name__}: {e}"
        out.append(Result(c.name, ok, detail))
    return out
