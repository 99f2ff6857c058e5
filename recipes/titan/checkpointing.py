"""``ProbeCheckpointManager``: torchtitan's DCP ``CheckpointManager`` with ptops' commit protocol
(manifest, LATEST, retention, ``checkpoint`` events), failed saves that do not end training, resume
from the newest *verified* checkpoint, and save-on-request (see its docstring).

Its own module: a save is what must be right when a run dies, and it is read apart from the train
step (the trainer only calls ``agree_any`` and sets ``stop_step``). Its helpers: ``staging.py`` (the
staging copy), ``qkvsplit.py`` (the fused-QKV split); ARCHITECTURE.md, "The titan async save on a
CPU", says what blocks training. Import only after ``compat.apply()`` (``registry`` does that).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
from torchtitan.components.checkpointer.base import MODEL

from ptops import envnames
from ptops.ckpt import versions
from ptops.recipes.titan.context import _dist_on, _err_text, _log, _rank, _world, get_probe
from ptops.recipes.titan.staging import _pinned_stager, _save_staged, _stateful_to_state_dict


@dataclass
class _Save:
    step: int
    path: Path
    t0: float  # time.monotonic() when the save began (training blocked from here)
    final: bool = False
    is_async: bool = False
    blocking_s: float = 0.0
    total_s: float = 0.0
    ok: bool = False
    error: str = ""
    done: Any = None  # threading.Event, set when committed or failed
    txn: Any = None  # ptops.ckpt.SaveTransaction
    staged: Any = (
        None  # threading.Event, set once blocking_s is final (the background staging copy is done)
    )
    waiting: bool = False  # training is waiting for the staging copy right now
    # where blocking_s went (the checkpoint event's breakdown): agreement + transaction begin, the
    # state dict, the save call, the wait for the staging copy before the optimizer step
    prep_s: float | None = None
    state_dict_s: float | None = None
    call_s: float | None = None
    call_t0: float | None = None  # when the save call began (call_s is measured from it)
    wait_s: float = 0.0
    qkv_split: str | None = (
        None  # "background" (qkvsplit.py) or "inline" (torchtitan's hook, training thread)
    )


class ProbeCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpointing with ptops' commit protocol (``ptops.ckpt``).

    Save (every ``interval`` steps, the final step, and the step at which a stop
    request was agreed):

    - the probe hears ``phase("checkpoint")`` (fault hooks fire here: ``enospc``
      raises ``OSError``) ... ``phase("step")`` around the part that blocks training;
    - one ``ptops.ckpt.SaveTransaction`` per save: ``begin`` (rank 0 marks
      ``step-N/.writing``, all ranks agree nobody failed so far), then DCP writes
      (``async_mode="async"``: training blocks only while the state is staged; the
      final and on-request saves are synchronous; the probe's ``in_save`` comes
      just before, where ``crash:phase=save`` fires), then ``commit``: rank 0 writes the
      manifest, moves LATEST and prunes to the newest ``keep`` (torchtitan's own
      keep_latest_k is off). An async save commits once DCP's save finished on
      rank 0: DCP gathers every rank's write result before it writes ``.metadata``.
      One ``checkpoint {step, path, blocking_s, total_s}`` event per commit;
    - a save that fails (``OSError`` such as ENOSPC / EACCES / EIO, DCP's
      ``CheckpointException``, a refused commit) is aborted (see
      ``SaveTransaction``: never LATEST, never resumed from) and emits
      ``checkpoint_failed {step, path, error}``; training continues: the next
      interval tries again. A failed *final* (or on-request) save raises, so the
      run ends non-zero instead of losing the last steps silently.

    Load: rank 0 asks ``ptops.ckpt.resume_point`` (the supervisor's verified
    choice, or the newest checkpoint that verifies deeply, newer invalid ones
    quarantined and reported as ``checkpoint_invalid``), broadcasts the step, and
    every rank loads that step explicitly (torchtitan alone would load the highest
    ``step-N`` that has ``.metadata``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        keep: int = 3
        """ptops retention: the newest ``keep`` good checkpoints stay (never the last good one)."""
        sdc_every: int = 0
        """``[monitors.sdc] every``: retention also keeps an sdc rollback's target."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        self.ptops_keep = max(1, int(getattr(config, "keep", 3)))
        self.ptops_sdc_every = int(getattr(config, "sdc_every", 0))
        self.stop_step: int | None = None
        self.records: list[_Save] = []
        self.failed_final: _Save | None = None
        self._inflight: _Save | None = None
        self._agree_pg: Any = None
        self._closed = False
        self._cpu_stager: Any = (
            None  # one stager for every async save (_stager): its staging buffers persist
        )
        self._split_plan: Any = (
            None  # _qkv_split: None = not decided yet, False = not for this model
        )
        self._write_exec: Any = None  # _writer: the async saves' write thread
        self.skipped: list[
            int
        ] = []  # interval saves skipped because the previous one was still writing
        self._verifier = _verifier()
        self._stage_lock = threading.Lock()
        super().__init__(config, **kwargs)
        if self.enable and _dist_on():
            # our own small gloo group: agreement all-reduces never interleave with
            # training collectives nor with DCP's background save (self.pg)
            self._agree_pg = dist.new_group(backend="gloo")

    # ------------------------------------------------------------ collectives
    def agree_any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank (all-reduce MAX)."""
        if not _dist_on():
            return bool(flag)
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._agree_pg)
        return bool(t.item())

    def _agree_flags(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag True on every rank when it is True on any rank (one all-reduce MAX for all)."""
        if not _dist_on():
            return tuple(bool(f) for f in flags)
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._agree_pg)
        return tuple(bool(x) for x in t.tolist())

    def _bcast_int(self, value: int) -> int:
        if not _dist_on():
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self._agree_pg)
        return int(t.item())

    # ------------------------------------------------------------ load
    def _pick_resume(self) -> int:
        """Rank 0: the step to resume from (-1: none); see ``ptops.recipes.resume``."""
        from ptops.recipes.resume import resume_entry

        entry = resume_entry(
            self.folder,
            probe=get_probe(),
            world_size=_world(),
            versions=versions("torch", "torchtitan"),
            log=_log,
        )
        return -1 if entry is None else entry.step

    def _load(self, step: int = -1) -> bool:
        if step != -1:  # an explicit --checkpoint.load_step is the user's call
            return super()._load(step)
        pick = self._pick_resume() if _rank() == 0 else -1
        pick = self._bcast_int(pick)
        if pick < 0:
            # nothing good: a fresh start (or initial_load_path), never the highest step-N blindly
            self._find_load_step = lambda folder="": -1  # type: ignore[method-assign]
            try:
                return super()._load(-1)
            finally:
                del self._find_load_step
        _log(f"resuming from verified checkpoint step-{pick}")
        return super()._load(pick)

    # ------------------------------------------------------------ save
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """One save: ``SaveTransaction.start`` (the probe's hooks, begin), one of the writes below,
        then the commit: here for a sync write, on a commit thread for an async one."""
        from ptops.ckpt import SaveTransaction

        forced = self.stop_step is not None and curr_step == self.stop_step and not self.load_only
        if not (self._should_save(curr_step, last_step) or forced):
            return False
        final = bool(last_step or forced)
        probe = get_probe()
        t0 = time.monotonic()
        if not final and self._skip_busy(probe, curr_step):
            return False
        self._wait_inflight()  # one save at a time; the previous one is committed (or failed) first
        path = Path(self._create_checkpoint_id(curr_step))
        txn = SaveTransaction(
            path.parent,
            curr_step,
            name=path.name,
            leader=_rank() == 0,
            agree=self.agree_any,
            world_size=_world(),
            versions=versions("torch", "torchtitan"),
            keep=self.ptops_keep,
            sdc_every=self.ptops_sdc_every,
        )
        rec = _Save(
            step=int(curr_step), path=path, t0=t0, final=final, done=threading.Event(), txn=txn
        )
        self.records.append(rec)
        try:
            if not txn.start(probe):
                return self._failed(rec, txn.error)
            if txn.moved_leftover is not None:
                _log(f"moved leftover {path} to {txn.moved_leftover}")
            err: BaseException | None = None
            try:
                if last_step and not forced:
                    self._save_last_step(curr_step)  # last_save_model_only / last_save_in_hf
                else:
                    self._write(rec, final, probe)
            except (Exception, CheckpointException) as e:  # a failed save must not end training
                err = e
            rec.blocking_s = time.monotonic() - t0
            if rec.call_t0 is not None:
                rec.call_s = time.monotonic() - rec.call_t0
            if rec.is_async and err is None:
                self._inflight = rec
                self.save_future.add_done_callback(lambda f, rec=rec: self._async_done(rec, f))
                return True
            if not txn.finish(err, probe):  # slow-save: a sync save blocks in it
                return self._failed(rec, txn.error)
            self._committed(rec)
            return True
        finally:
            if probe is not None:
                probe.phase("step", curr_step)
                probe.faults.after_checkpoint(curr_step)  # corrupt-ckpt, once it is committed

    def _write(self, rec: _Save, final: bool, probe: Any) -> None:
        """The state dict, then one of three writes: async with pinned CUDA memory, async on CPU
        (a persistent stager), or sync (the final save, or a fault that needs the files first)."""
        pinned = self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
        rec.is_async = (
            (self.async_mode == AsyncMode.ASYNC or pinned)
            and not final
            and not (probe is not None and probe.faults.sync_save_wanted(rec.step))
        )
        rec.prep_s = time.monotonic() - rec.t0
        t_sd = time.monotonic()
        split = self._qkv_split() if rec.is_async and not pinned else None
        states = split.states(self.states, MODEL) if split is not None else None
        if states is None:
            split = None
            states = self._flattened_model_states_sd()
        if rec.is_async:
            rec.qkv_split = "background" if split is not None else "inline"
        rec.call_t0 = time.monotonic()
        rec.state_dict_s = rec.call_t0 - t_sd
        if rec.is_async and pinned:
            self._write_async_pinned(rec, states)
        elif rec.is_async:
            self._write_async_cpu(rec, states, split)
        else:
            self.dcp_save(
                states,
                checkpoint_id=str(rec.path),
                async_mode=AsyncMode.DISABLED,
                enable_garbage_collection=True,
            )

    def _write_async_pinned(self, rec: _Save, states: dict) -> None:
        """GPU only: stage to pinned host memory in a process (torchtitan's path), then write."""
        if self.stager is None:
            self.stager = _pinned_stager(use_shared_memory=True)
        result = self.dcp_save(states, checkpoint_id=str(rec.path), async_mode=self.async_mode)
        self.staging_future = result.staging_completion
        self.save_future = result.upload_completion

    def _write_async_cpu(self, rec: _Save, states: dict, split: Any) -> None:
        """A persistent stager: the staging copy reuses the previous save's buffers (no allocation
        per save) and runs in a background thread, overlapped with the next step's forward and
        backward; training waits for it only before the optimizer step
        (``_maybe_wait_for_staging``), and that wait is counted in ``blocking_s``."""
        import torch.distributed.checkpoint as dcp

        from ptops.recipes.titan.staging import FlatStager

        stager = self._stager()
        rec.staged = threading.Event()
        if isinstance(stager, FlatStager):
            copied, staged = stager.stage_then(
                _stateful_to_state_dict(states), split.finish if split is not None else None
            )
            self.staging_future = copied
            self.save_future = self._writer().submit(_save_staged, staged, str(rec.path), self.pg)
        else:
            result = dcp.async_save(
                states, checkpoint_id=str(rec.path), process_group=self.pg, async_stager=stager
            )
            self.staging_future = result.staging_completion
            self.save_future = result.upload_completion
        self.staging_future.add_done_callback(lambda f, rec=rec: self._staging_done(rec))

    def _async_done(self, rec: _Save, fut: Any) -> None:
        exc = fut.exception()

        def finish() -> None:
            if rec.staged is not None:  # blocking_s is final once the staging copy is done
                rec.staged.wait(60.0)
            probe = get_probe()
            if probe is not None and exc is None:
                try:
                    probe.faults.before_commit(rec.step)  # slow-save: it stays "writing" meanwhile
                except Exception as e:  # a fault hook never costs the commit
                    _log(f"before_commit hook failed: {_err_text(e)}")
            try:
                if rec.txn.commit(exc, collective=False):
                    self._committed(rec)
                else:
                    self._failed(rec, rec.txn.error)
            except BaseException as e:  # never kill the process from here
                rec.error = rec.error or _err_text(e)
            finally:
                rec.done.set()

        threading.Thread(target=finish, name=f"ptops-ckpt-commit-{rec.step}", daemon=True).start()

    def _committed(self, rec: _Save) -> None:
        """Rank 0 reports the commit: one ``checkpoint`` event."""
        rec.ok = True
        rec.total_s = time.monotonic() - rec.t0
        if not rec.txn.leader:
            return
        if rec.txn.pruned:
            _log(f"retention: deleted {', '.join(rec.txn.pruned)}")
        if rec.txn.prune_error:
            _log(f"retention failed: {rec.txn.prune_error}")
        probe = get_probe()
        if probe is not None:
            extra = {
                k: round(v, 4)
                for k, v in (
                    ("prep_s", rec.prep_s),
                    ("state_dict_s", rec.state_dict_s),
                    ("call_s", rec.call_s),
                    ("wait_s", rec.wait_s),
                )
                if v is not None
            }
            if rec.qkv_split is not None:
                extra["qkv_split"] = rec.qkv_split
            probe.event(
                "checkpoint",
                step=rec.step,
                path=str(rec.path),
                blocking_s=round(rec.blocking_s, 4),
                total_s=round(rec.total_s, 4),
                mode="async" if rec.is_async else "sync",
                **extra,
            )
        _log(
            f"checkpoint step-{rec.step} committed (blocking {rec.blocking_s:.3f}s, total "
            f"{rec.total_s:.3f}s)"
        )
        self._verifier.submit(rec.step, rec.path)

    def _failed(self, rec: _Save, err: Any) -> bool:
        rec.ok = False
        rec.error = _err_text(err)
        rec.total_s = time.monotonic() - rec.t0
        if rec.done is not None and not rec.is_async:
            rec.done.set()
        _log(f"checkpoint step-{rec.step} FAILED, not committed ({rec.error})")
        probe = get_probe()
        if probe is not None and _rank() == 0:
            probe.event(
                "checkpoint_failed",
                step=rec.step,
                path=str(rec.path),
                error=rec.error,
                final=rec.final,
            )
        if rec.final:
            self.failed_final = rec
            raise RuntimeError(
                f"the {'final' if self.stop_step != rec.step else 'on-request'} checkpoint (step "
                f"{rec.step}) "
                f"could not be saved: {rec.error}; the last good checkpoint is the newest one "
                "committed"
            )
        return False

    def _maybe_wait_for_staging(self) -> None:
        """Training waits here (before the optimizer step changes the state) for the background
        staging copy of the last async save; the wait is part of that save's ``blocking_s``."""
        fut, self.staging_future = self.staging_future, None
        rec = self._inflight
        if fut is None:
            return
        with self._stage_lock:
            if rec is not None:
                rec.waiting = True
        t = time.monotonic()
        try:
            fut.result()
        except BaseException:  # the upload fails with it and reports checkpoint_failed
            pass
        with self._stage_lock:
            if rec is not None and rec.staged is not None and not rec.staged.is_set():
                rec.wait_s = time.monotonic() - t
                rec.blocking_s += rec.wait_s
                rec.staged.set()

    def _staging_done(self, rec: _Save) -> None:
        """The staging copy is done. If training is not waiting for it now, it will not wait later
        either (the wait returns at once), so ``blocking_s`` is final: the commit need not wait for
        the training thread (which a held or slow step would delay)."""
        with self._stage_lock:
            if not rec.waiting:
                rec.staged.set()

    def _qkv_split(self) -> Any:
        """The fused-QKV split plan for the CPU async path (``qkvsplit.QkvSplit``), or None: built
        at the first async save and agreed by every rank (its gathers are collectives), then kept
        for the run."""
        if self._split_plan is None:
            plan, why = None, "CUDA: DefaultStager path"
            if (
                os.environ.get(envnames.CKPT_QKV_SPLIT) == "inline"
            ):  # A/B and an escape hatch: torchtitan's hook
                why = "PTOPS_CKPT_QKV_SPLIT=inline"
            elif not torch.cuda.is_available():
                from ptops.recipes.titan.qkvsplit import QkvSplit

                try:
                    plan, why = QkvSplit.build(self.states.get(MODEL), self.pg)
                except Exception as e:  # never fail a save over an optimisation
                    plan, why = None, _err_text(e)
            (anyone_not,) = self._agree_flags(plan is None)
            if anyone_not and plan is not None:
                plan, why = None, "another rank cannot split in the background"
            self._split_plan = plan if plan is not None else False
            _log(
                "async checkpoint: fused-qkv split "
                + (
                    "after the staging copy, off the training thread"
                    if plan is not None
                    else f"in the state dict ({why})"
                )
            )
        return self._split_plan or None

    def _writer(self) -> Any:
        """The thread that writes async saves (one save in flight): ``dcp.async_save`` starts a new
        one per save."""
        if self._write_exec is None:
            from concurrent.futures import ThreadPoolExecutor

            self._write_exec = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="ptops-ckpt-write"
            )
        return self._write_exec

    def _stager(self) -> Any:
        """One stager for the whole run (its buffers persist). On a CPU ``FlatStager``: one batched
        copy per save, ~1.0x a memcpy where DefaultStager's per-tensor deep copy is ~1.4x
        (bench/README.md). With CUDA, DefaultStager as before (pinned buffers, a copy stream)."""
        if self._cpu_stager is None:
            if torch.cuda.is_available():
                self._cpu_stager = _pinned_stager(use_shared_memory=False)
            else:
                from ptops.recipes.titan.staging import FlatStager

                self._cpu_stager = FlatStager()
            _log(
                f"async checkpoint staging: {type(self._cpu_stager).__name__}, buffers kept "
                "across saves"
            )
        return self._cpu_stager

    def _skip_busy(self, probe: Any, step: int) -> bool:
        """An interval save that comes while the previous async save is still writing (on any rank)
        is skipped and recorded (``checkpoint_skipped``), never queued: one writer, and the staging
        buffers are not overwritten under it. A save a fault waits for (``corrupt-ckpt``,
        ``hold:until=committed``) is never skipped."""
        rec = self._inflight
        busy = rec is not None and rec.done is not None and not rec.done.is_set()
        waits = probe is not None and probe.faults.waits_for_save(step)
        any_busy, any_waits = self._agree_flags(busy, waits)
        if not any_busy or any_waits:
            return False
        self.skipped.append(int(step))
        if probe is not None:
            probe.faults.on_skip(int(step))  # ends a slow-save:until=skipped of the one writing
        _log(
            f"checkpoint step-{step} skipped: step-{rec.step if rec else '?'} is still being "
            "written"
        )
        if probe is not None and _rank() == 0:
            probe.event(
                "checkpoint_skipped",
                step=int(step),
                writing_step=rec.step if rec else None,
                writing_s=round(time.monotonic() - rec.t0, 3) if rec else None,
            )
        return True

    def _wait_inflight(self, timeout: float | None = None) -> None:
        self._maybe_wait_for_staging()
        rec, fut = self._inflight, self.save_future
        if fut is not None:
            try:
                fut.result(timeout=timeout)
            except BaseException:  # reported by _async_done as checkpoint_failed
                pass
        if rec is not None and rec.done is not None:
            rec.done.wait(timeout)
        self._inflight = None
        self.save_future = None

    def _wait_for_saving(self) -> None:
        self._wait_inflight()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wait_inflight(timeout=120.0)
        self._verifier.close(timeout=120.0)
        if (
            self._write_exec is not None
        ):  # idle after _wait_inflight; never wait here on a stuck write
            self._write_exec.shutdown(wait=False)
            self._write_exec = None
        if self._cpu_stager is not None:
            self._cpu_stager.close()
            self._cpu_stager = None
        super()._close()


def _verifier() -> Any:
    """Rank 0's background read-back verification of every committed checkpoint (``ptops.ckpt``),
    with its verdicts as events: ``checkpoint_verified``, or ``checkpoint_invalid`` (an alert)
    naming the file."""
    from ptops.ckpt import BackgroundVerifier

    def report(step: int, path: Path, ok: bool, reason: str, verify_s: float) -> None:
        probe = get_probe()
        if ok:
            if probe is not None:
                probe.event(
                    "checkpoint_verified", step=step, path=str(path), verify_s=round(verify_s, 4)
                )
            return
        _log(f"checkpoint step-{step} FAILED its background verification: {reason}")
        if probe is not None:
            probe.event(
                "checkpoint_invalid",
                path=str(path),
                reason=reason,
                step=step,
                found_by="background_verify",
            )

    return BackgroundVerifier(report)
