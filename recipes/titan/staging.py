"""``FlatStager``: the async checkpoint's CPU staging copy as one batched copy into buffers that
persist.

DCP's ``DefaultStager`` deep-copies the state dict tensor by tensor (``new_empty`` + ``set_`` + a
storage copy each, in Python); with ~1,400 tensors that is 40-50 ms per save over a plain memcpy
(bench/README.md). This stager keeps one CPU buffer per state-dict path, allocated and touched once,
and refills all of them with ONE ``torch._foreach_copy_`` per save, in a background thread (the
``AsyncStager`` protocol that ``dcp.async_save(..., async_stager=)`` accepts: ``stage`` returns a
Future of the staged dict).

Handled exactly: plain tensors and ``nn.Parameter`` (staged as plain tensors: DCP writes their
values), DTensors (their local shard is staged and re-wrapped with the same ``DTensorSpec``, as
DefaultStager's deep copy keeps it), nested dicts / lists / tuples; other values are deep-copied.
Anything else that is a tensor (ShardedTensor, other subclasses) goes through DCP's own
``StateDictStager`` (with its storage cache). CPU only: the adapter keeps DefaultStager (pinned
memory, a CUDA stream) when CUDA is available.

The buffers are reused: a staged dict is valid until the next ``stage`` call. The adapter never
stages while the previous save is still writing (``ProbeCheckpointManager._skip_busy``).

``stage_then`` is the same copy followed, on the same background thread, by a function of the staged
dict (the fused-QKV split, ``qkvsplit.py``): the writer waits for both, training only for the copy
(``copied``).

The checkpoint manager's other staging pieces live here too: ``_pinned_stager`` (DefaultStager with
pinned memory, CUDA), ``_stateful_to_state_dict`` and ``_save_staged`` (what ``dcp.async_save`` does
on the caller's thread and on its own, taken apart so that the FlatStager path can run them).
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class FlatStager:
    """One batched copy per save into persistent CPU buffers (see the module docstring)."""

    # dcp.async_save calls synchronize_staging right after stage() when this is True; False lets the
    # copy overlap the caller's next forward/backward (the adapter waits on the Future itself)
    should_synchronize_after_execute = False

    def __init__(self, threaded: bool = True) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._exec = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="ptops-stage")
            if threaded
            else None
        )
        self._future: Future | None = None
        self._fallback: Any = None

    def stage(self, state_dict: dict, **_: Any) -> Future | dict:
        if self._exec is None:
            return self._stage(state_dict)
        self._future = self._exec.submit(self._stage, state_dict)
        return self._future

    def stage_then(self, state_dict: dict, then: Any = None) -> tuple[Future, Future]:
        """(copied, done): the copy, then ``then(staged)`` on the stager's thread; ``done`` holds
        its result (the staged dict itself without ``then``)."""
        copied: Future = Future()
        done: Future = Future()

        def run() -> None:
            try:
                staged = self._stage(state_dict)
            except BaseException as e:  # both futures carry it (DCP then fails the save)
                copied.set_exception(e)
                done.set_exception(e)
                return
            copied.set_result(None)
            try:
                done.set_result(then(staged) if then is not None else staged)
            except BaseException as e:
                done.set_exception(e)

        if self._exec is None:
            run()
        else:
            self._exec.submit(run)
        self._future = done
        return copied, done

    def synchronize_staging(self) -> None:
        if self._future is not None:
            self._future.result()

    def close(self) -> None:
        if self._exec is not None:
            self._exec.shutdown(wait=True)
        if self._fallback is not None:
            self._fallback.close()
        self._bufs.clear()

    @torch.no_grad()
    def _stage(self, state_dict: dict) -> dict:
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        staged = self._walk(state_dict, (), dsts, srcs)
        if srcs:
            torch._foreach_copy_(dsts, srcs)
        return staged

    def _buffer(self, path: tuple, src: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(path)
        if (
            buf is None
            or buf.dtype != src.dtype
            or buf.shape != src.shape
            or buf.stride() != src.stride()
        ):
            # preserve_format keeps the strides of a dense tensor (contiguous otherwise); fill once
            # so the pages are faulted in now, not during the first timed copy
            buf = torch.empty_like(src, device="cpu", memory_format=torch.preserve_format)
            buf.copy_(src)
            self._bufs[path] = buf
        return buf

    def _walk(self, x: Any, path: tuple, dsts: list, srcs: list) -> Any:
        if isinstance(x, torch.Tensor):
            t = type(x)
            if t is torch.Tensor or t is torch.nn.Parameter:
                buf = self._buffer(path, x)
                dsts.append(buf)
                srcs.append(x.detach())
                return buf
            from torch.distributed.tensor import DTensor

            if t is DTensor and type(x._local_tensor) is torch.Tensor:
                buf = self._buffer(path, x._local_tensor)
                dsts.append(buf)
                srcs.append(x._local_tensor.detach())
                return DTensor(buf, x._spec, requires_grad=False)
            return self._fallback_stager().stage(x)
        if isinstance(x, dict):
            return (
                type(x)((k, self._walk(v, path + (k,), dsts, srcs)) for k, v in x.items())
                if type(x) is dict
                else self._dict_like(x, path, dsts, srcs)
            )
        if type(x) in (list, tuple):
            return type(x)(self._walk(v, path + (i,), dsts, srcs) for i, v in enumerate(x))
        return copy.deepcopy(x)

    def _dict_like(self, x: dict, path: tuple, dsts: list, srcs: list) -> dict:
        y = copy.copy(x)  # OrderedDict and friends keep their type
        for k, v in x.items():
            y[k] = self._walk(v, path + (k,), dsts, srcs)
        return y

    def _fallback_stager(self) -> Any:
        if self._fallback is None:
            from torch.distributed.checkpoint._state_dict_stager import StateDictStager

            self._fallback = StateDictStager(pin_memory=False, share_memory=False)
        return self._fallback


def _pinned_stager(use_shared_memory: bool) -> Any:
    """DCP's DefaultStager with pinned buffers and a copy stream (CUDA); shared memory when the
    stager hands its buffers to another process (the pinned-memory async mode)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=True,
            use_shared_memory=use_shared_memory,
            use_async_staging=True,
            use_non_blocking_copy=True,
        )
    )


def _stateful_to_state_dict(states: dict) -> dict:
    """What ``dcp.async_save`` does first on the caller's thread (``Stateful`` values -> their state
    dicts), without its logging wrapper around every entry (~0.1 ms each: a message dict built for a
    NullHandler)."""
    from torch.distributed.checkpoint.stateful import Stateful

    # a tensor is never Stateful; the Protocol check (getattr_static) is the slow part for the ~50
    # entries
    return {
        k: v if isinstance(v, torch.Tensor) or not isinstance(v, Stateful) else v.state_dict()
        for k, v in states.items()
    }


def _save_staged(staged: Any, checkpoint_id: str, pg: Any) -> Any:
    """The write thread: what ``dcp.async_save``'s thread runs (its ``save_wrapper``): wait for the
    staged dict, then ``dcp.save`` of it on the checkpoint's process group."""
    import torch.distributed.checkpoint as dcp

    return dcp.save(staged.result(), checkpoint_id=checkpoint_id, process_group=pg)
