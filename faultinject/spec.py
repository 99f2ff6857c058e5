"""Fault specs: ``KIND[:key=value,...]``, e.g. ``crash:rank=1,step=12``.

Grammar (design.md): a kind, then optionally ``:`` and comma-separated
``key=value`` pairs. Every kind understands ``attempt=N`` (default 1: a fault
fires in the first attempt only; ``attempt=0`` means every attempt) and
``rank=R`` (default: every rank). Keys per kind:

=============  ==========================================  =========================================
kind           keys                                        effect (rank side, see faultinject.inject)
=============  ==========================================  =========================================
crash          step (req), rank, attempt, code, signal,    the rank dies at the start of ``step``:
               phase                                       SIGKILL by default, ``code=N`` exits N,
                                                           ``signal=TERM|SEGV|...`` kills with it;
                                                           ``phase=save``: in the middle of the save
                                                           of ``step`` instead (every rank has begun
                                                           it, this rank's part is not written: a
                                                           half-written checkpoint that must never
                                                           be committed nor resumed from); both
                                                           engine adapters honour it
hang           step (req), rank, attempt, seconds,         the rank stops making progress at the
               mode, phase                                 start of ``step`` (``seconds``: default
                                                           forever; ``mode=sleep`` keeps its
                                                           liveness pings, ``mode=stop`` SIGSTOPs);
                                                           ``phase=import|rendezvous|build|load``
                                                           (no step): in that start-up section
                                                           instead (TRL has no separate
                                                           rendezvous: transformers inits the
                                                           process group inside its build)
slow           step (req), rank, attempt, seconds,         the rank sleeps ``seconds`` (default 1)
               steps                                       at the start of ``steps`` steps (default 1)
nan            step (req), rank, attempt                   the step's loss is multiplied by NaN
oom            step (req), rank, attempt                   ``torch.OutOfMemoryError`` (MemoryError
                                                           without torch) at the start of ``step``
preempt        step (req), attempt                         SIGTERM to the job as a scheduler sends it
                                                           before a time limit: rank 0 signals the
                                                           supervisor (which asks the ranks to save,
                                                           stops, exits 143; relaunching resumes) or,
                                                           unsupervised, torchrun, at ``step``'s start
kill-supervisor step (req), attempt                        rank 0 SIGKILLs the supervisor at the start
                                                           of ``step`` (the ranks die with it;
                                                           relaunching adopts the run). No effect
                                                           without a supervisor
enospc         step (req), rank, attempt                   ``OSError(ENOSPC)`` from
                                                           ``probe.phase("checkpoint", step)``, i.e.
                                                           inside the adapter's save (every rank by
                                                           default: a full disk is everyone's)
corrupt-ckpt   step (req), rank, attempt, mode             after the checkpoint of ``step`` is written
                                                           (committed), one rank (default 0) damages
                                                           one shard: its own DCP shard
                                                           ``__R_0.distcp`` when there is one, else the
                                                           largest file; ``mode=truncate`` (default:
                                                           cut to half) or ``mode=flip`` (invert 64
                                                           bytes in the middle, size unchanged)
hold           step (req), rank, attempt, seconds,         every rank (or ``rank``) stops *before*
               until, phase                                      ``step`` (before any other fault there;
                                                           outside any collective), keeps its
                                                           liveness pings, reports the declared
                                                           pause phase ``hold`` (not a hang) and waits
                                                           for ``release`` or ``seconds`` (default
                                                           600); ``until=committed``: also ends once
                                                           the last checkpoint the rank began is
                                                           committed (an async save in flight is
                                                           durable before what follows);
                                                           ``hold_released`` records the end;
                                                           ``phase=eval``: the pause is reported as
                                                           the engine's eval pause (judged by the
                                                           learned eval budget, not unbounded)
release        rank, attempt (no step)                     live only (``ptops inject RUN_DIR
                                                           release``): ends the holds in effect and
                                                           cancels this attempt's pending ones
slow-save      step (req), rank, attempt, seconds, until   slow storage: the commit of the save of
                                                           ``step`` waits ``seconds`` (default 10;
                                                           ``probe.faults.before_commit``): an
                                                           async save stays "writing" while training
                                                           goes on, a sync one blocks;
                                                           ``until=skipped``: ends as soon as a later
                                                           save was skipped because this one was
                                                           still writing (at most ``seconds``,
                                                           default 600 then; async saves only)
misrendezvous  rank, attempt (no step)                     launch only: before the engine is imported
                                                           (so before its process group init) the
                                                           rank points its rendezvous at a store of
                                                           its own on localhost, world size 1, as a
                                                           rank whose endpoint fell back to localhost
                                                           does; the supervisor stops the attempt
                                                           (``misconfigured``), no restart
leak           rank, attempt, step, mb                     from ``step`` (default 1) on, the rank
                                                           allocates ``mb`` MB (default 64) of host
                                                           memory at the start of every step and
                                                           keeps it (written, so resident): its RSS
                                                           climbs linearly towards the limit, as a
                                                           leak does (the memory monitor's forecast)
bitflip        step (req), rank, attempt, target, mode     silent data corruption: before ``step``
                                                           (between steps, at rest) the rank (default
                                                           0) flips exponent bit 4 (x/÷ 2^16: stays
                                                           finite) of one element of one of its own
                                                           tensors, ``target=param`` (default) or
                                                           ``optim`` (optimizer state); ``grad``: in
                                                           ``step`` itself, after the backward and
                                                           before the optimizer (the step's compute
                                                           went wrong; ``probe.faults.flip_bits(step,
                                                           tensors, GRAD)``); ``compute``:
                                                           what the rank hands to FSDP's gradient
                                                           reduce-scatter in ``step`` (its first
                                                           bucket; persistent: every bucket of
                                                           every run from ``step`` on, the same
                                                           element in every run of a step, a
                                                           device wrong the same way each time,
                                                           which only the partner run sees); the tensor
                                                           and element follow from the spec (same
                                                           spec, same flip). ``mode=persistent``: a
                                                           bad device, again before every step from
                                                           ``step`` on and in every attempt (unless
                                                           ``attempt=`` says otherwise); the adapter
                                                           hands its tensors to
                                                           ``probe.faults.flip_bits(step, tensors)``
stale-sync     step (req), rank, attempt, mode              ``[trl.vllm]`` runs: the weight sync to the
                                                           engine before ``step``'s rollouts returns
                                                           and changes nothing (an engine that keeps
                                                           serving stale weights); the re-sync after
                                                           the check works, unless
                                                           ``mode=persistent`` (every sync from
                                                           ``step`` on: the run stops)
sync-hang      step (req), rank, attempt, seconds, mode    ``[trl.vllm]`` runs: the rank hangs inside
                                                           the weight sync before ``step``'s
                                                           rollouts (as ``hang``: ``seconds`` default
                                                           forever, ``mode=sleep|stop``); the hang is
                                                           reported in phase ``engine_sync``
engine-crash   step (req), attempt                         ``[trl.vllm] mode = "server"``: before
                                                           ``step``'s rollouts the engine's process
                                                           exits (through its own RPC, as a crashed
                                                           engine does); the sidecar supervision
                                                           restarts it, the seam finds the restarted
                                                           engine's version, syncs and generates
engine-hang    step (req), rank, attempt, seconds          ``[trl.vllm]`` runs, before ``step``'s
                                                           rollouts: server mode, the engine's
                                                           processes stop (SIGSTOP: alive, silent);
                                                           the sidecar's health checks fail and it
                                                           is restarted, the seam re-syncs it;
                                                           colocate, the rank stalls inside the
                                                           engine's generate (``seconds`` default
                                                           forever): a hang in phase
                                                           ``engine_generate``
grader-crash   step (req), rank, attempt, mode             GRPO / RLOO: ``step``'s reward call
                                                           fails as a grader whose process died
                                                           does (``GraderCrashed``); retried once
                                                           (transient: the retry scores as an
                                                           uninterrupted run); ``mode=persistent``
                                                           (every try from ``step`` on): no verdict,
                                                           the completions unscorable and counted
grader-timeout step (req), rank, attempt, seconds, mode    GRPO / RLOO: the rank stalls inside
                                                           ``step``'s reward call (as ``hang``:
                                                           ``seconds`` default forever,
                                                           ``mode=sleep|stop``): a hang in phase
                                                           ``reward``
clock-skew     node (req), offset_s, attempt (no step)     multi-node (``--slurm``) only: the health
                                                           check step on ``node`` reads its clock
                                                           ``offset_s`` seconds (default 30) ahead,
                                                           as a node whose NTP died does (every
                                                           node of the test cluster shares one
                                                           clock); every attempt unless
                                                           ``attempt=`` says otherwise. Its
                                                           ``clock_skew`` check fails and the node
                                                           is replaced before the attempt starts
=============  ==========================================  =========================================

Parsing is strict: an unknown kind or key, a missing ``step``, a value of the
wrong type each raise :class:`FaultSpecError` with one line naming the spec,
the key and what was expected.
"""  # noqa: E501

from __future__ import annotations

import json
import signal as _signal
from dataclasses import asdict, dataclass, field
from typing import Any


class FaultSpecError(ValueError):
    """One clear line about a bad ``--fault`` spec."""


_INT, _FLOAT, _STR = "int", "float", "str"

# kind -> {key: type}; "step" is required for every kind below
KINDS: dict[str, dict[str, str]] = {
    "crash": {
        "step": _INT,
        "rank": _INT,
        "attempt": _INT,
        "code": _INT,
        "signal": _STR,
        "phase": _STR,
    },
    "hang": {
        "step": _INT,
        "rank": _INT,
        "attempt": _INT,
        "seconds": _FLOAT,
        "mode": _STR,
        "phase": _STR,
    },
    "slow": {"step": _INT, "rank": _INT, "attempt": _INT, "seconds": _FLOAT, "steps": _INT},
    "nan": {"step": _INT, "rank": _INT, "attempt": _INT},
    "oom": {"step": _INT, "rank": _INT, "attempt": _INT},
    "preempt": {"step": _INT, "attempt": _INT},
    "kill-supervisor": {"step": _INT, "attempt": _INT},
    "enospc": {"step": _INT, "rank": _INT, "attempt": _INT},
    "corrupt-ckpt": {"step": _INT, "rank": _INT, "attempt": _INT, "mode": _STR},
    "hold": {
        "step": _INT,
        "rank": _INT,
        "attempt": _INT,
        "seconds": _FLOAT,
        "until": _STR,
        "phase": _STR,
    },
    "release": {"rank": _INT, "attempt": _INT},
    "slow-save": {"step": _INT, "rank": _INT, "attempt": _INT, "seconds": _FLOAT, "until": _STR},
    "misrendezvous": {"rank": _INT, "attempt": _INT},
    "leak": {"step": _INT, "rank": _INT, "attempt": _INT, "mb": _FLOAT},
    "bitflip": {"step": _INT, "rank": _INT, "attempt": _INT, "target": _STR, "mode": _STR},
    "clock-skew": {"node": _STR, "offset_s": _FLOAT, "attempt": _INT},
    "stale-sync": {"step": _INT, "rank": _INT, "attempt": _INT, "mode": _STR},
    "engine-crash": {"step": _INT, "attempt": _INT},
    "sync-hang": {"step": _INT, "rank": _INT, "attempt": _INT, "seconds": _FLOAT, "mode": _STR},
    "engine-hang": {"step": _INT, "rank": _INT, "attempt": _INT, "seconds": _FLOAT},
    "grader-crash": {"step": _INT, "rank": _INT, "attempt": _INT, "mode": _STR},
    "grader-timeout": {
        "step": _INT,
        "rank": _INT,
        "attempt": _INT,
        "seconds": _FLOAT,
        "mode": _STR,
    },
}
REQUIRED = ("step",)  # for every kind that has a step (``release`` has none: it acts at once)
HOLD_DEFAULT_S = 600.0  # a forgotten hold ends by itself
HOLD_UNTIL = ("release", "committed")
HOLD_PHASES = (
    "hold",
    "eval",
)  # eval: the pause is declared as the engine's evaluation (its own hang budget)
# Kinds that only make sense in a live run (``ptops inject``), not at launch.
LIVE_ONLY_KINDS = ("release",)
# Kinds that act before the first step (start-up), so only at launch: injected live they could never
# fire.
LAUNCH_ONLY_KINDS = ("misrendezvous", "clock-skew")
# Kinds that act on a node of a multi-node run (its health check step), not in a rank.
NODE_KINDS = ("clock-skew",)
CLOCK_SKEW_DEFAULT_S = 30.0
SLOW_SAVE_DEFAULT_S = 10.0  # slow-save without until
LEAK_DEFAULT_MB = 64.0  # leak without mb: MB kept per step
SLOW_SAVE_UNTIL = ("skipped",)
BITFLIP_TARGETS = ("param", "optim", "grad", "compute")
# where an engine calls flip_bits, what it flips: at rest, gradients before the optimizer, and what
# a rank hands to the gradient reduce-scatter (its own compute, before any other rank adds to it)
AT_REST, GRAD, COMPUTE = ("param", "optim"), ("grad",), ("compute",)
BITFLIP_MODES = ("transient", "persistent")
STALE_SYNC_MODES = ("transient", "persistent")
HANG_MODES = ("sleep", "stop")
# where a hang fires: the start of ``step`` (default), or a start-up section (no step then)
HANG_PHASES = ("step", "import", "rendezvous", "build", "load")
CRASH_PHASES = (
    "step",
    "save",
)  # where a crash fires: start of the step (default), middle of its save
CORRUPT_MODES = ("truncate", "flip")
# Kinds that one rank carries out for the whole job: rank 0 unless ``rank=`` says otherwise.
ONE_RANK_KINDS = ("preempt", "kill-supervisor", "corrupt-ckpt")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None  # None: every rank
    attempt: int = 1  # 0: every attempt
    params: dict[str, Any] = field(default_factory=dict)
    text: str = ""

    def applies(self, rank: int, attempt: int) -> bool:
        return (self.rank is None or self.rank == rank) and (
            self.attempt == 0 or self.attempt == attempt
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Fault":
        return cls(
            kind=d["kind"],
            step=int(d["step"]),
            rank=None if d.get("rank") is None else int(d["rank"]),
            attempt=int(d.get("attempt", 1)),
            params=dict(d.get("params") or {}),
            text=d.get("text", ""),
        )

    def __str__(self) -> str:
        return self.text or format_spec(self)


def _convert(spec: str, key: str, raw: str, kind: str) -> Any:
    try:
        if kind == _INT:
            return int(raw)
        if kind == _FLOAT:
            return float(raw)
    except ValueError:
        expected = "an integer" if kind == _INT else "a number"
        raise FaultSpecError(
            f"fault {spec!r}: key '{key}': expected {expected}, got {raw!r}"
        ) from None
    return raw


def parse(spec: str) -> Fault:
    """Parse one ``KIND[:key=value,...]`` spec."""
    text = spec.strip()
    if not text:
        raise FaultSpecError(
            "fault '': empty spec (expected KIND[:key=value,...], e.g. crash:rank=1,step=12)"
        )
    kind, _, rest = text.partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise FaultSpecError(
            f"fault {spec!r}: unknown kind {kind!r} (expected one of: {', '.join(KINDS)})"
        )
    allowed = KINDS[kind]
    values: dict[str, Any] = {}
    if rest.strip():
        for item in rest.split(","):
            key, sep, raw = item.partition("=")
            key, raw = key.strip(), raw.strip()
            if not sep or not key or not raw:
                raise FaultSpecError(
                    f"fault {spec!r}: bad item {item.strip()!r} (expected key=value, e.g. step=12)"
                )
            if key not in allowed:
                raise FaultSpecError(
                    f"fault {spec!r}: key '{key}': unknown key for {kind} (expected one of: "
                    f"{', '.join(allowed)})"
                )
            if key in values:
                raise FaultSpecError(f"fault {spec!r}: key '{key}': given twice")
            values[key] = _convert(spec, key, raw, allowed[key])
    elif ":" in text:
        raise FaultSpecError(
            f"fault {spec!r}: nothing after ':' (expected key=value, e.g. {kind}:step=12)"
        )
    startup_hang = kind == "hang" and values.get("phase", "step") != "step"
    if kind == "hang" and values.get("phase", "step") not in HANG_PHASES:
        raise FaultSpecError(
            f"fault {spec!r}: key 'phase': expected one of {', '.join(HANG_PHASES)} (got "
            f"{values['phase']!r})"
        )
    if startup_hang and "step" in values:
        raise FaultSpecError(
            f"fault {spec!r}: key 'step': a start-up hang (phase={values['phase']}) has no step"
        )
    if startup_hang:
        values["step"] = 1  # unused: it fires in the start-up section
    if kind == "leak":
        values.setdefault("step", 1)  # a leak runs from the start unless told
        if values.setdefault("mb", LEAK_DEFAULT_MB) <= 0:
            raise FaultSpecError(f"fault {spec!r}: key 'mb': must be > 0 (got {values['mb']})")
    if kind == "bitflip":
        values.setdefault("rank", 0)  # one rank's device lies
        if values.get("target", "param") not in BITFLIP_TARGETS:
            raise FaultSpecError(
                f"fault {spec!r}: key 'target': expected one of {', '.join(BITFLIP_TARGETS)} "
                f"(got {values['target']!r})"
            )
        if values.get("mode", "transient") not in BITFLIP_MODES:
            raise FaultSpecError(
                f"fault {spec!r}: key 'mode': expected one of {', '.join(BITFLIP_MODES)} "
                f"(got {values['mode']!r})"
            )
        if values.get("mode") == "persistent":
            values.setdefault("attempt", 0)  # a bad device stays bad across restarts
    if kind in ("stale-sync", "grader-crash") and values.get("mode", "transient") not in (
        STALE_SYNC_MODES
    ):
        raise FaultSpecError(
            f"fault {spec!r}: key 'mode': expected one of {', '.join(STALE_SYNC_MODES)} "
            f"(got {values['mode']!r})"
        )
    if kind == "clock-skew":
        if "node" not in values:
            raise FaultSpecError(
                f"fault {spec!r}: key 'node': missing (required, e.g. clock-skew:node=n2)"
            )
        values.setdefault("offset_s", CLOCK_SKEW_DEFAULT_S)
        values.setdefault("attempt", 0)  # a node whose clock is off stays off
    for key in REQUIRED:
        if key in allowed and key not in values:
            raise FaultSpecError(
                f"fault {spec!r}: key '{key}': missing (required, e.g. {kind}:step=12)"
            )
    step = values.pop("step", 0)
    if "step" in allowed and step < 1:
        raise FaultSpecError(f"fault {spec!r}: key 'step': must be >= 1 (got {step})")
    rank = values.pop("rank", None)
    if rank is not None and rank < 0:
        raise FaultSpecError(f"fault {spec!r}: key 'rank': must be >= 0 (got {rank})")
    attempt = values.pop("attempt", 1)
    if attempt < 0:
        raise FaultSpecError(
            f"fault {spec!r}: key 'attempt': must be >= 0 (0 = every attempt; got {attempt})"
        )
    if "seconds" in values and values["seconds"] < 0:
        raise FaultSpecError(
            f"fault {spec!r}: key 'seconds': must be >= 0 (got {values['seconds']})"
        )
    if "steps" in values and values["steps"] < 1:
        raise FaultSpecError(f"fault {spec!r}: key 'steps': must be >= 1 (got {values['steps']})")
    if kind in ("hang", "sync-hang", "grader-timeout") and values.get("mode", "sleep") not in (
        HANG_MODES
    ):
        raise FaultSpecError(
            f"fault {spec!r}: key 'mode': expected one of {', '.join(HANG_MODES)} (got "
            f"{values['mode']!r})"
        )
    if kind == "corrupt-ckpt" and values.get("mode", "truncate") not in CORRUPT_MODES:
        raise FaultSpecError(
            f"fault {spec!r}: key 'mode': expected one of {', '.join(CORRUPT_MODES)} (got "
            f"{values['mode']!r})"
        )
    if kind == "crash" and values.get("phase", "step") not in CRASH_PHASES:
        raise FaultSpecError(
            f"fault {spec!r}: key 'phase': expected one of {', '.join(CRASH_PHASES)} (got "
            f"{values['phase']!r})"
        )
    if kind == "hold" and values.get("phase", "hold") not in HOLD_PHASES:
        raise FaultSpecError(
            f"fault {spec!r}: key 'phase': expected one of {', '.join(HOLD_PHASES)} (got "
            f"{values['phase']!r})"
        )
    if kind == "hold" and values.get("until", "release") not in HOLD_UNTIL:
        raise FaultSpecError(
            f"fault {spec!r}: key 'until': expected one of {', '.join(HOLD_UNTIL)} (got "
            f"{values['until']!r})"
        )
    if kind == "slow-save" and "until" in values and values["until"] not in SLOW_SAVE_UNTIL:
        raise FaultSpecError(
            f"fault {spec!r}: key 'until': expected one of {', '.join(SLOW_SAVE_UNTIL)} "
            f"(got {values['until']!r})"
        )
    if "signal" in values:
        name = values["signal"].upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if not isinstance(getattr(_signal, name, None), _signal.Signals):
            raise FaultSpecError(
                f"fault {spec!r}: key 'signal': unknown signal {values['signal']!r} (e.g. KILL, "
                "TERM, SEGV)"
            )
        values["signal"] = name
    if "code" in values and "signal" in values:
        raise FaultSpecError(f"fault {spec!r}: keys 'code' and 'signal': give one, not both")
    return Fault(kind=kind, step=step, rank=rank, attempt=attempt, params=values, text=text)


def parse_all(specs: list[str] | tuple[str, ...]) -> list[Fault]:
    """The faults of a launch (``--fault``): a live-only kind is an error here."""
    faults = [parse(s) for s in specs]
    for f in faults:
        if f.kind in LIVE_ONLY_KINDS:
            raise FaultSpecError(
                f"fault {f.text!r}: {f.kind} acts on a live run only (ptops inject RUN_DIR "
                f"{f.kind}), not at launch"
            )
    return faults


def parse_live(spec: str) -> Fault:
    """A fault for a live run (``ptops inject``): a launch-only kind is an error here."""
    fault = parse(spec)
    if fault.kind in LAUNCH_ONLY_KINDS:
        raise FaultSpecError(
            f"fault {spec!r}: {fault.kind} acts before the first step, at launch only "
            f"(ptops launch --fault {fault.text})"
        )
    return fault


def format_spec(fault: Fault) -> str:
    has_step = "step" in KINDS.get(fault.kind, {"step": _INT}) and fault.params.get(
        "phase", "step"
    ) in ("step", "save")
    items = [f"step={fault.step}"] if has_step else []
    if fault.rank is not None:
        items.append(f"rank={fault.rank}")
    if fault.attempt != 1:
        items.append(f"attempt={fault.attempt}")
    items += [f"{k}={v}" for k, v in sorted(fault.params.items())]
    return f"{fault.kind}:{','.join(items)}" if items else fault.kind


def to_env(faults: list[Fault]) -> str:
    """Serialise for ``PTOPS_FAULTS`` (JSON list)."""
    return json.dumps([f.to_dict() for f in faults], separators=(",", ":"))


def from_env(text: str | None) -> list[Fault]:
    if not text:
        return []
    try:
        return [Fault.from_dict(d) for d in json.loads(text)]
    except (ValueError, KeyError, TypeError) as e:
        raise FaultSpecError(f"PTOPS_FAULTS: not a valid fault list ({e})") from None
