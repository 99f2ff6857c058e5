"""The rank side of the grader seam: a grader's own failure is no verdict, never a 0 or a 1.

A reward function can fail for reasons that say nothing about the completion: its helper process
died, a remote verifier dropped the connection, its sandbox could not start. Scored 0, such a
failure teaches the policy that a right answer is wrong (and a 1 would pay for nothing); a crash of
the rank loses the steps since the checkpoint. So each GRPO / RLOO reward call goes through
:class:`GraderSeam`:

- **Retried, then no verdict.** A reward function that raises an infrastructure error
  (:data:`INFRA_ERRORS`: ``OSError`` and its kin such as ``ConnectionError``, ``EOFError``,
  :class:`GraderCrashed`) is called again once; failing again, it has no verdict for the batch. A
  recipe's own mistake (``ValueError``, ``TypeError``, ...) is not caught: it is a bug to see.
- **No verdict for one grader is no verdict for the sample.** A completion that a weighted grader
  could not judge (its call failed, or it returned None itself: the judge past its bound) is None
  for every reward function: TRL then counts it unscorable (out of its group's baseline, advantage
  0). Otherwise the other functions' sum (a format bonus) would stand in for the missing score: a
  correct answer scored as a wrong one. Weight-0 functions (logged only) are left as they are.
- **Counted.** ``grader/no_verdict`` (completions of the step without a verdict) and
  ``grader/retries`` on each step's record; each failed try is a ``grader_failed`` event (the
  grader, the error, the step, whether it was retried, the completions left without a verdict).
  The whole reward call is the rank's ``reward`` phase, so a grader that hangs is a hang named by
  its seam.

TRL calls the reward functions one after another with the same arguments; the first wrapper
computes every function's column for the batch (the mask needs them all) and the others return
theirs. TRL's per-function timing then charges the whole call to the first function. Reward models
(``nn.Module``) and async functions are left to TRL: they are not wrapped.

A component: :meth:`GraderSeam.attach` to the trainer, :meth:`GraderSeam.metrics` for each step's
record.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any


class GraderCrashed(ConnectionResetError):
    """A grader's process or service went away in the middle of a call (the ``grader-crash``
    fault raises it where the failure would surface)."""


# what a grader's infrastructure raises; anything else is the recipe's bug and crashes the rank
INFRA_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError, TimeoutError)
RETRIES = 1  # further tries of a failed call before its batch has no verdict


class GraderSeam:
    def __init__(self, probe: Any = None) -> None:
        self.probe = probe
        self.trainer: Any = None
        self.funcs: list[Any] = []
        self.plain: list[bool] = []  # which of them the seam calls (the others are TRL's)
        self.weights: list[float] = []
        self._batch: Any = None  # the completions list the cached columns were computed for
        self._columns: list[list[float | None]] = []
        self.no_verdict = 0  # completions without a verdict since the last record
        self.retries = 0
        self.stepped = False

    # ------------------------------------------------------------ wiring
    def attach(self, trainer: Any) -> None:
        """Wrap the trainer's plain reward functions and its reward call (the ``reward`` phase)."""
        self.trainer = trainer
        funcs = list(getattr(trainer, "reward_funcs", None) or [])
        weights = getattr(trainer, "reward_weights", None)
        self.weights = [float(w) for w in weights] if weights is not None else [1.0] * len(funcs)
        self.funcs = funcs
        self.plain = [_plain(f) for f in funcs]
        for i, plain in enumerate(self.plain):
            if plain:
                trainer.reward_funcs[i] = self._column(i)
        calc = getattr(trainer, "_calculate_rewards", None)
        if calc is not None:

            def scored(*args: Any, **kw: Any) -> Any:
                with self._phase():
                    return calc(*args, **kw)

            trainer._calculate_rewards = scored

    def _column(self, i: int) -> Callable[..., list[float | None]]:
        def column(**kw: Any) -> list[float | None]:
            completions = kw.get("completions")
            if completions is None or completions is not self._batch:
                self._columns = self._grade(kw)
                self._batch = completions
            return self._columns[i]

        column.__name__ = getattr(self.funcs[i], "__name__", type(self.funcs[i]).__name__)
        return column

    # ------------------------------------------------------------ one batch
    def _grade(self, kw: dict[str, Any]) -> list[list[float | None]]:
        n = len(kw.get("completions") or [])
        step = self._step()
        columns: list[list[float | None]] = []
        for f, plain in zip(self.funcs, self.plain):
            columns.append(self._call(f, kw, n, step) if plain else [0.0] * n)
        # a sample a weighted grader could not judge has no verdict at all
        unjudged = [
            any(self.weights[j] != 0 and columns[j][k] is None for j in range(len(columns)))
            for k in range(n)
        ]
        for j, plain in enumerate(self.plain):
            if plain:
                columns[j] = [None if unjudged[k] else columns[j][k] for k in range(n)]
        self.no_verdict += sum(unjudged)
        return columns

    def _call(self, f: Any, kw: dict[str, Any], n: int, step: int) -> list[float | None]:
        name = getattr(f, "__name__", type(f).__name__)
        faults = self.probe.faults if self.probe is not None else None
        for attempt in range(RETRIES + 1):
            try:
                if faults is not None and faults.grader_crash(step):
                    raise GraderCrashed(f"grader {name!r}: its process went away (injected)")
                out = list(f(**kw))
                if len(out) != n:  # TRL's own check, with the grader's name
                    raise ValueError(f"reward function {name!r} returned {len(out)} for {n}")
                return [None if v is None else float(v) for v in out]
            except INFRA_ERRORS as e:
                again = attempt < RETRIES
                self.retries += again
                # every failure is recorded: a grader that needs its retry often is failing
                self._event(
                    "grader_failed",
                    step=step,
                    grader=name,
                    error=f"{type(e).__name__}: {e}",
                    attempt_of_call=attempt + 1,
                    retried=again,
                    no_verdict=0 if again else n,
                )
        return [None] * n

    # ------------------------------------------------------------ the record
    def metrics(self) -> dict[str, float]:
        self.stepped = True
        out = {"grader/no_verdict": float(self.no_verdict), "grader/retries": float(self.retries)}
        self.no_verdict = self.retries = 0
        return out

    def _step(self) -> int:
        """The step whose rollouts are graded (the trainer's next step)."""
        return int(self.trainer.state.global_step) + 1 if self.trainer is not None else 0

    @contextlib.contextmanager
    def _phase(self) -> Iterator[None]:
        """The rank's ``reward`` phase (after the attempt's first step, which its own section
        judges); ``grader-timeout`` stalls here."""
        step = self._step()
        probe = self.probe
        if probe is None:
            yield
            return
        if self.stepped:
            probe.phase("reward", step)
        try:
            probe.faults.in_reward(step)
            yield
        finally:
            if self.stepped:
                probe.phase("step", step)

    def _event(self, kind: str, **fields: Any) -> None:
        if self.probe is not None:
            self.probe.event(kind, **fields)


def _plain(f: Any) -> bool:
    """A plain (sync, not ``nn.Module``) reward function: the kind the seam wraps."""
    if inspect.iscoroutinefunction(f) or inspect.iscoroutinefunction(getattr(f, "__call__", None)):
        return False
    return callable(f) and not hasattr(f, "forward")
