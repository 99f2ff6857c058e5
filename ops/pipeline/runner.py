"""Run a pipeline: each stage a supervised ``ptops launch`` in ``PIPE/stages/NN-name``, hand-offs
verified.

Why a subprocess per stage: a stage is exactly what a user would launch by hand (same supervisor,
restarts, records, exporters), and the pipeline only reads run directories - one launch path.

The pipeline's ``events.jsonl`` is its record (``pipeline_started``, ``stage_started
{input_digest}``, ``stage_completed {checkpoint, digest}``, ``stage_skipped``, ``gate``,
``stage_failed``, ``pipeline_completed`` / ``pipeline_failed`` / ``pipeline_stopped``). Rerunning
the same command on the same directory skips every stage whose recorded final checkpoint still has
its recorded digest, and relaunches the stage that was running on its own run directory, which
resumes from its last good checkpoint. A stage's input is re-verified (every file against its
manifest) and re-digested right before it is used: a checkpoint that changed since its stage
completed stops the pipeline.

Signals: the pipeline handles SIGINT and SIGTERM itself, whatever it inherited (``nohup`` or a
script's background job start it with SIGINT ignored). The stage runs in its own session, so a
terminal's Ctrl-C reaches the pipeline only, which forwards each signal it gets to the stage's
supervisor once (the first asks the ranks to save and stop; a second stops at once), waits for it,
records ``pipeline_stopped`` and exits 130. A pipeline killed outright (SIGKILL, OOM killer) cannot
forward: each stage process is started with ``PR_SET_PDEATHSIG=SIGTERM``, so the kernel sends the
stage's supervisor the SIGTERM a scheduler would (save on request, ``stopped``, exit 143; its
torchrun and ranks go with it); no stage runs on unseen, and rerunning the pipeline resumes that
stage from its checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ptops.ckpt import digest, latest_good, verify
from ptops.ops.pipeline.spec import Gate, PipelineError, Resolved
from ptops.ops.runrecord.rundir import RunDir, final_metrics_by_step

SNAPSHOT = "pipeline.json"


@dataclass
class Outcome:
    code: int
    message: str
    stages: list[dict[str, Any]] = field(default_factory=list)


def stage_dirs(pipe_dir: Path, snap: dict) -> list[Path]:
    return [Path(pipe_dir) / "stages" / s["dir"] for s in snap["stages"]]


def _first_difference(a: Any, b: Any, where: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _first_difference(a.get(k), b.get(k), f"{where}.{k}" if where else k)
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{where}.{i}")
            if d:
                return d
        return None
    return (
        None
        if a == b
        else f"{where}: {json.dumps(a, default=str)} here, {json.dumps(b, default=str)} in the file"
    )


def gate_value(stage_dir: Path, metric: str) -> tuple[float | None, int | None]:
    """The metric's value at the latest step (rank 0) whose record has it as a finite number."""
    steps = final_metrics_by_step(RunDir(stage_dir).read_metrics())
    for step in sorted(steps, reverse=True):
        v = steps[step].get(metric)
        if (
            isinstance(v, (int, float))
            and not isinstance(v, bool)
            and v == v
            and abs(v) != float("inf")
        ):
            return float(v), step
    return None, None


def check_gate(gate: Gate, stage_dir: Path) -> dict[str, Any]:
    value, step = gate_value(stage_dir, gate.metric)
    return {
        "metric": gate.metric,
        "op": gate.op,
        "threshold": gate.value,
        "value": value,
        "step": step,
        "passed": value is not None and gate.passes(value),
    }


def final_checkpoint(stage_dir: Path, steps: int) -> Path:
    """The stage's verified final checkpoint (deep: every file against its manifest)."""
    good = latest_good(RunDir(stage_dir).checkpoints, deep=True)
    if good is None:
        raise PipelineError(f"{stage_dir}: the stage ended without a good checkpoint")
    if good.step != steps:
        raise PipelineError(
            f"{stage_dir}: the newest good checkpoint is step {good.step}, not the final step "
            f"{steps}"
        )
    return Path(good.path)


PR_SET_PDEATHSIG = 1
STAGE_DEATH_SIGNAL = signal.SIGTERM  # what a stage's supervisor gets when its pipeline dies unseen


def _stop_with_parent(parent: int) -> Callable[[], None]:
    """For ``preexec_fn`` (between fork and exec; tiny): the stage gets SIGTERM when the pipeline
    dies."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (
        OSError,
        AttributeError,
    ):  # not Linux: a killed pipeline leaves its stage to the rerun's adoption
        prctl = None

    def setup() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(STAGE_DEATH_SIGNAL), 0, 0, 0)
        if os.getppid() != parent:  # the pipeline died before prctl took effect
            os.kill(os.getpid(), STAGE_DEATH_SIGNAL)

    return setup


def _short(d: str | None) -> str:
    return (d or "")[:12]


class PipelineRunner:
    def __init__(
        self,
        pipe: Resolved,
        pipe_dir: Path,
        *,
        mlflow: bool = True,
        mlflow_uri: str | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.pipe = pipe
        self.dir = Path(pipe_dir).resolve()
        self.record = RunDir(self.dir)
        self.mlflow = mlflow
        self.mlflow_uri = mlflow_uri
        self.say = say or (lambda m: print(m, file=sys.stderr, flush=True))
        self.lineage: Any = None
        self._child: subprocess.Popen | None = None
        self._signals = 0  # SIGINT/SIGTERM received (each forwarded to the running stage)

    # ------------------------------------------------------------------ records

    def _event(self, kind: str, **fields: Any) -> None:
        self.record.event(kind, **fields)

    def _prepare(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        snap = self.pipe.snapshot()
        path = self.dir / SNAPSHOT
        if path.exists():
            stored = json.loads(path.read_text())
            mine = {k: v for k, v in snap.items() if k != "file"}
            theirs = {k: v for k, v in stored.items() if k != "file"}
            diff = _first_difference(theirs, mine)
            if diff:
                raise PipelineError(
                    f"{path}: this pipeline directory holds a different pipeline ({diff}); rerun "
                    f"it with the same file, or use a new --run-dir"
                )
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(snap, f, indent=2)

    def _completed(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for e in self.record.read_events():
            if e.get("kind") == "stage_completed":
                out[str(e.get("stage"))] = e
        return out

    def _still_good(self, stage: str, done: dict) -> str:
        """Re-verify and re-digest a completed stage's final checkpoint; it must match the
        record."""
        ck = Path(done["checkpoint"])
        if not ck.is_dir():
            raise PipelineError(
                f"stage {stage}: its final checkpoint {ck} is gone; move "
                f"{ck.parent.parent} away to redo the stage"
            )
        res = verify(ck, deep=True)
        if not res.ok:
            raise PipelineError(
                f"stage {stage}: its final checkpoint {ck} is no longer valid ({res.reason}); "
                f"move {ck.parent.parent} away to redo the stage"
            )
        now = digest(ck)
        if now != done["digest"]:
            raise PipelineError(
                f"stage {stage}: its final checkpoint {ck} changed since the stage completed "
                "(digest "
                f"recorded {_short(done['digest'])}, now {_short(now)}); refusing to build on it"
            )
        return now

    # ------------------------------------------------------------------ the run

    def run(self) -> Outcome:
        self._prepare()
        from ptops.ops.runrecord.lock import LockedError, acquire, release

        try:
            lock = acquire(self.dir)
        except LockedError as e:
            raise PipelineError(str(e)) from None
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            attempt = 1 + sum(
                1 for e in self.record.read_events() if e.get("kind") == "pipeline_started"
            )
            self._event(
                "pipeline_started", attempt=attempt, pipeline=self.pipe.model.name, pid=os.getpid()
            )
            if self.mlflow:
                from ptops.ops.pipeline.lineage import Lineage

                self.lineage = Lineage(self.dir, self.pipe.model.name, self.mlflow_uri)
                if self.lineage.error:
                    self.say(f"ptops pipeline: MLflow lineage off ({self.lineage.error})")
                self.mlflow_uri = self.lineage.uri
            try:
                outcome = self._stages()
            except KeyboardInterrupt:
                outcome = Outcome(
                    130, "pipeline stopped (interrupted); rerun the same command to resume"
                )
                self._event("pipeline_stopped", reason=outcome.message)
            except PipelineError as e:
                outcome = Outcome(1, f"pipeline stopped: {e}")
                self._event("pipeline_failed", reason=str(e))
            if self.lineage is not None:
                state = (
                    "completed"
                    if outcome.code == 0
                    else "stopped"
                    if outcome.code == 130
                    else "failed"
                )
                self.lineage.finish(state, None if outcome.code == 0 else outcome.message)
            return outcome
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            release(lock)

    def _on_signal(self, signum, frame) -> None:
        """SIGINT / SIGTERM, installed whatever the pipeline inherited (SIGINT may come in ignored).
        A running stage gets the signal forwarded and is waited for (``_run_child``); else stop
        here."""
        self._signals += 1
        child = self._child
        if child is not None and child.poll() is None:
            try:
                self.say(
                    f"ptops pipeline: {signal.Signals(signum).name}: stopping the running stage"
                    + (
                        " now"
                        if self._signals > 1
                        else " (it checkpoints first; again to stop now)"
                    )
                )
            except RuntimeError:  # reentrant write: the signal came in the middle of another line
                pass
            try:
                child.send_signal(signum)
            except ProcessLookupError:
                pass
            return
        raise KeyboardInterrupt

    def _stages(self) -> Outcome:
        stages = self.pipe.stages
        n = len(stages)
        done = self._completed()
        digests: dict[str, str] = {}
        for i, s in enumerate(stages):
            rec = self.pipe.recipes[s.name]
            sdir = self.dir / "stages" / self.pipe.stage_dir_name(i)
            tag = f"stage {i + 1}/{n} {s.name}"
            if s.name in done:
                digests[s.name] = self._still_good(s.name, done[s.name])
                self._event("stage_skipped", stage=s.name, index=i, digest=digests[s.name])
                self.say(
                    f"ptops pipeline: {tag}: completed earlier (digest "
                    f"{_short(digests[s.name])}), skipped"
                )
            else:
                code, reason, ev_in = self._launch_stage(i, s, rec, sdir, done, digests)
                if code != 0:
                    msg = (
                        f"pipeline stopped: {tag} failed (exit "
                        f"{code}{': ' + reason if reason else ''}); "
                        f"rerun the same command to resume it from its last good checkpoint"
                        + (
                            f" (exit {code}: look first, see `ptops diagnose {sdir}`)"
                            if code in (3, 4)
                            else ""
                        )
                    )
                    self._event(
                        "stage_failed", stage=s.name, index=i, exit_code=code, reason=reason
                    )
                    self._event("pipeline_failed", stage=s.name, reason=msg)
                    if self.lineage is not None:
                        self.lineage.stage_done(s.name, sdir, {"state": "failed"})
                    return Outcome(code if code in (1, 3, 130) else 1, msg)
                ck = final_checkpoint(sdir, rec.train.steps)
                digests[s.name] = digest(ck)
                ev = dict(
                    stage=s.name,
                    index=i,
                    step=rec.train.steps,
                    checkpoint=str(ck),
                    digest=digests[s.name],
                )
                self._event("stage_completed", **ev)
                done[s.name] = ev
                if self.lineage is not None:
                    self.lineage.stage_done(
                        s.name,
                        sdir,
                        {
                            "state": "completed",
                            "output_digest": digests[s.name],
                            "input_stage": s.input,
                            "input_digest": ev_in.get("input_digest"),
                            "output_checkpoint": str(ck),
                            "final_step": rec.train.steps,
                        },
                    )
                self.say(
                    f"ptops pipeline: {tag}: completed, final checkpoint {ck.name} digest "
                    f"{_short(digests[s.name])}"
                )
            if s.gate is not None:
                g = check_gate(s.gate, sdir)
                self._event("gate", stage=s.name, index=i, **g)
                if self.lineage is not None:
                    self.lineage.stage_done(
                        s.name,
                        sdir,
                        {
                            "gate": s.gate.text(),
                            "gate_value": g["value"],
                            "gate_passed": g["passed"],
                        },
                    )
                if not g["passed"]:
                    got = (
                        "never recorded"
                        if g["value"] is None
                        else f"{g['value']:.4g} at step {g['step']}"
                    )
                    msg = (
                        f"pipeline stopped at {tag}: gate failed: {s.gate.metric} = {got}, needs "
                        f"{s.gate.op} {s.gate.value:g}"
                    )
                    self._event("pipeline_failed", stage=s.name, reason=msg)
                    return Outcome(1, msg)
                self.say(
                    f"ptops pipeline: {tag}: gate passed ({s.gate.metric} = {g['value']:.4g} "
                    f"{s.gate.op} {s.gate.value:g})"
                )
        self._event("pipeline_completed", stages=n)
        return Outcome(0, f"pipeline {self.pipe.model.name} completed: {n} stages")

    def _launch_stage(
        self, i: int, s, rec, sdir: Path, done: dict, digests: dict
    ) -> tuple[int, str | None, dict]:
        n = len(self.pipe.stages)
        inp_ck = inp_digest = None
        if s.input is not None:
            inp_ck = done[s.input]["checkpoint"]
            inp_digest = digests.get(s.input) or self._still_good(s.input, done[s.input])
            if inp_digest != done[s.input]["digest"]:  # belt and braces: _still_good raised already
                raise PipelineError(f"stage {s.name}: input {s.input} digest mismatch")
        # {checkpoint:NAME} in `set`: other earlier stages' final checkpoints, verified and digested
        # like the input
        from ptops.ops.pipeline.spec import expand, refs

        extra_refs = {}
        for name in dict.fromkeys(r for o in s.set for r in refs(o)):
            extra_refs[name] = {
                "checkpoint": done[name]["checkpoint"],
                "digest": digests.get(name) or self._still_good(name, done[name]),
            }
        overrides = [expand(o, {n: r["checkpoint"] for n, r in extra_refs.items()}) for o in s.set]
        resumed = (sdir / "recipe.json").exists()
        sdir.mkdir(parents=True, exist_ok=True)
        os.chmod(sdir, 0o700)
        if self.lineage is not None:
            rdict = json.loads(
                rec.model_dump_json(exclude_none=True)
            )  # {checkpoint:X} values show as "/(X)"
            if inp_ck:
                rdict["train"]["init_from"] = inp_ck
            self.lineage.child(s.name, i, sdir, rdict, s.input, inp_digest)
            if extra_refs:
                self.lineage.stage_done(
                    s.name, sdir, {f"ref.{n}.digest": r["digest"] for n, r in extra_refs.items()}
                )
        fields = dict(
            stage=s.name,
            index=i,
            run_dir=str(sdir),
            input_stage=s.input,
            input_checkpoint=inp_ck,
            input_digest=inp_digest,
            resumed=resumed,
            **({"refs": extra_refs} if extra_refs else {}),
        )
        self._event("stage_started", **fields)
        # the stage's own record names its input too (ptops status / diagnose of the stage alone)
        RunDir(sdir).event("stage_input", pipeline=self.pipe.model.name, **fields)
        self.say(
            f"ptops pipeline: stage {i + 1}/{n} {s.name}"
            + (
                f" <- {s.input} ({Path(inp_ck).name}, digest {_short(inp_digest)})"
                if s.input
                else ""
            )
            + (" (resuming its run directory)" if resumed else "")
            + f" -> {sdir}"
        )
        extra: list[str] = []
        if s.kind == "rejection-sampling":
            data, err = self._rejection_sample(s, sdir, inp_ck)
            if err:
                return 1, err, fields
            extra.append(f"train.data_file={data}")
        cmd = [
            sys.executable,
            "-m",
            "ptops",
            "launch",
            str(self.pipe.recipe_paths[s.name]),
            "--supervise",
            "--run-dir",
            str(sdir),
            "--json",
        ]
        for o in [*overrides, *([f"train.init_from={inp_ck}"] if inp_ck else []), *extra]:
            cmd += ["--set", o]
        for f in s.faults:
            cmd += ["--fault", f]
        cmd += (
            ["--mlflow", "--mlflow-uri", self.mlflow_uri]  # explicit: PTOPS_MLFLOW may say 0
            if self.mlflow and self.mlflow_uri
            else ["--no-mlflow"]
        )
        code, out = self._run_child(cmd, rec)
        reason = None
        try:
            reason = json.loads(out[out.index("{") :]).get("reason") if "{" in (out or "") else None
        except ValueError:
            reason = None
        return code, reason, fields

    def _rejection_sample(self, s, sdir: Path, inp_ck: str) -> tuple[Path, str | None]:
        """Generate the stage's SFT rows once (kept across reruns while the file matches its
        recorded sha256)."""
        from ptops.recipes.trl.rejection import sha256

        data = sdir / "rejection-sampling.jsonl"
        stats_path = data.with_suffix(".json")
        try:
            stats = json.loads(stats_path.read_text())
            if (
                stats.get("source") == inp_ck
                and data.is_file()
                and sha256(data) == stats.get("sha256")
            ):
                self.say(
                    f"ptops pipeline: {s.name}: rejection-sampled rows kept from before "
                    f"({stats['kept']} rows)"
                )
                return data, None
        except (OSError, ValueError):
            pass
        self.say(
            f"ptops pipeline: {s.name}: rejection sampling {s.sampling.n} answers x "
            f"{s.sampling.prompts} prompts "
            f"from {Path(inp_ck).name}"
        )
        cmd = [
            sys.executable,
            "-m",
            "ptops.recipes.trl.rejection",
            "--from",
            inp_ck,
            "--out",
            str(data),
            *s.sampling.argv(),
        ]
        code, out = self._run_child(cmd, self.pipe.recipes[s.name])
        if code != 0:
            return data, f"rejection sampling failed (exit {code})"
        stats = json.loads(out.strip().splitlines()[-1])
        self._event(
            "rejection_sampled",
            stage=s.name,
            **{
                k: stats[k]
                for k in (
                    "data",
                    "sha256",
                    "source",
                    "n",
                    "prompts",
                    "kept",
                    "mean_best",
                    "mean_sampled",
                )
            },
        )
        self.say(
            f"ptops pipeline: {s.name}: kept {stats['kept']}/{stats['prompts']} prompts' best "
            "answers "
            f"(verifier: best {stats['mean_best']:.3f}, sampled {stats['mean_sampled']:.3f})"
        )
        if not stats["kept"]:
            return (
                data,
                "rejection sampling kept no rows (lower sampling.min_score or raise sampling.n)",
            )
        return data, None

    def _run_child(self, cmd: list[str], rec) -> tuple[int, str]:
        """A stage (or rejection sampling) in its own session, stopped by the kernel if the pipeline
        dies; signals reach it through ``_on_signal``. Returns its exit code and stdout; a stop
        signal during it raises KeyboardInterrupt once it has ended."""
        seen = self._signals
        child = self._child = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=_stop_with_parent(os.getpid()),
        )
        bound = rec.supervisor.grace_s + rec.supervisor.kill_timeout_s + 30  # after a stop signal
        chunks: list[str] = []
        stop_at: float | None = None
        try:
            while True:
                try:
                    out, _ = child.communicate(timeout=0.5)
                    chunks.append(out or "")
                    break
                except subprocess.TimeoutExpired:
                    pass
                if self._signals > seen and stop_at is None:
                    stop_at = time.monotonic() + bound
                if stop_at is not None and time.monotonic() > stop_at:
                    self.say(
                        f"ptops pipeline: the stage did not stop within {bound:g} s; killing it"
                    )
                    child.kill()
        finally:
            if child.poll() is None:  # an error here: never leave the stage behind
                child.kill()
                child.wait()
            self._child = None
        if self._signals > seen:
            raise KeyboardInterrupt
        return child.returncode, "".join(chunks)
