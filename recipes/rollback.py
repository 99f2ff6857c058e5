"""The rollback contract between the supervisor and the engine adapters (the stdlib and
ptops' environment names only).

When a monitor finding's action is ``rollback`` (``[monitors.<name>] action``),
the supervisor tears the attempt down, moves every checkpoint at or after the
anomaly step aside (``ptops.ckpt.quarantine``), and starts the next attempt
from the newest good checkpoint before the anomaly with ``PTOPS_ROLLBACK`` in
every rank's environment, a JSON object::

    {"from_step": 12, "to_step": 10, "skip_batches": 1, "skip_at_step": 12,
     "lr_scale": 0.5, "lr_factor": 0.5, "count": 1, "reason": "nan: loss is nan at step 12"}

- ``skip_batches`` data batches (optimizer steps' worth) are discarded just
  before step ``skip_at_step`` is trained. ``skip_at_step`` is
  ``max(to_step + 1, from_step - skip_batches + 1)``: the skipped window ends at
  the anomaly step when the checkpoint is far enough back (``skip_batches=1``
  skips exactly the batch of the anomaly step), and starts right after the
  resume point otherwise (PaLM-style: restart before the spike, skip a few
  hundred batches). Step numbers do not move: the run still ends at
  ``train.steps``; it trains on later data instead.
- ``lr_factor`` is the *absolute* learning-rate factor for the rest of the run
  (the product of every rollback's ``lr_scale`` so far): the adapter sets the
  schedule's base learning rate to ``recipe lr x lr_factor`` whatever the
  checkpoint held, so a later crash restart or a second rollback never scales
  twice.
- The supervisor keeps passing the latest rollback to every later attempt of
  the run (rebuilt from ``events.jsonl`` by a supervisor that adopts the run).
  An adapter whose data position is part of its checkpoint (TorchTitan: the
  dataloader state is saved) skips only when it resumed before
  ``skip_at_step``; one that resumes its data position by counting steps
  (transformers/TRL) also re-applies the skip when it resumed after it.

Adapters report what they did with a ``rollback_applied`` event (rank 0).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Mapping

from ptops import envnames

ENV = envnames.ROLLBACK


def skip_start(from_step: int, to_step: int, skip_batches: int) -> int:
    """The step before which ``skip_batches`` batches are discarded (see the module docstring)."""
    return max(int(to_step) + 1, int(from_step) - int(skip_batches) + 1)


@dataclass(frozen=True)
class RollbackInfo:
    from_step: int
    to_step: int
    skip_batches: int = 0
    skip_at_step: int = 0
    lr_scale: float = 1.0
    lr_factor: float = 1.0
    count: int = 1
    reason: str = ""

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping) -> "RollbackInfo":
        from_step, to_step = int(d["from_step"]), int(d.get("to_step") or 0)
        skip = max(0, int(d.get("skip_batches") or 0))
        at = d.get("skip_at_step")
        return cls(
            from_step=from_step,
            to_step=to_step,
            skip_batches=skip,
            skip_at_step=int(at) if at is not None else skip_start(from_step, to_step, skip),
            lr_scale=float(d.get("lr_scale", 1.0) or 1.0),
            lr_factor=float(d.get("lr_factor", d.get("lr_scale", 1.0)) or 1.0),
            count=int(d.get("count", 1) or 1),
            reason=str(d.get("reason", "")),
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "RollbackInfo | None":
        """The rollback this attempt must honour, or None (also None for a malformed value, with a
        warning)."""
        raw = (os.environ if environ is None else environ).get(ENV, "").strip()
        if not raw:
            return None
        try:
            return cls.from_dict(json.loads(raw))
        except (ValueError, KeyError, TypeError) as e:
            from ptops.ops.runrecord import ranklog

            ranklog.get("rollback").warning("ignoring malformed %s=%r: %s", ENV, raw, e)
            return None

    def applied(self, what: str, step: int, **extra: object) -> dict:
        """The fields of the ``rollback_applied`` event an adapter sends when it carries out
        ``what`` (``lr`` or ``skip``) at ``step``: one shape for every engine."""
        return {
            "what": what, "step": step, **extra,
            "from_step": self.from_step, "to_step": self.to_step,
        }  # fmt: skip

    def batches_to_skip(
        self, step: int, first_step: int, position_in_checkpoint: bool = True
    ) -> int:
        """Optimizer steps' worth of batches to discard before training ``step`` in an attempt
        whose first trained step is ``first_step``.

        ``position_in_checkpoint``: the engine restores its data position from the checkpoint
        (TorchTitan); False when it recounts it from the step (transformers), in which case a
        resume past the skip window re-applies the skip on its first step.
        """
        if self.skip_batches <= 0:
            return 0
        at = self.skip_at_step
        if step == at and first_step <= at:
            return self.skip_batches
        if not position_in_checkpoint and step == first_step and first_step > at:
            return self.skip_batches
        return 0
