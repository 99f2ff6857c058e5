"""Silent data corruption, rank side: exact fingerprints of a rank's own training state.

Why: a device that flips a bit in memory does not crash; the weights go wrong and every checkpoint
after it is "good". Two cheap checks, both from one fingerprint (each tensor's bytes summed as
64-bit words, wrapping: any single flipped bit changes its sum by +-2^b, so it is always seen):

- at rest: every ``every`` steps the rank fingerprints its parameters and optimizer state right
  after its optimizer step and again at the start of the next step. Nothing may change them in
  between (the checkpoint save only reads them), so a difference is a change outside the
  optimizer, on this rank: the record of that next step says ``sdc_rest`` (how many tensors
  changed; 0 when checked and equal) and ``sdc_rest_tensor`` (the first one). Works for FSDP
  shards and DDP replicas alike;
- replicas: where every rank holds the same state (DDP: ``replicated=True``), the after-step
  fingerprint goes into the step's record as ``sdc_fp`` (hex); the ``sdc`` monitor compares the
  ranks (``monitors/sdc.py``).

- recheck (no replica: FSDP shards): every ``recheck_every`` steps, between the backward and the
  optimizer, every rank fingerprints its gradients, computes them again from the same batch and
  weights (``rerun``: the adapter's forward-backward and clipping) and compares. A deterministic
  step gives the same bits; a rank whose bits differ had a fault in one of the two runs, so all
  ranks run a third time (they agree on it: the backward's collectives need every rank) and the
  majority stands: the gradients in place after the last run are the majority's whenever there
  is one, so the corrupt ones are discarded before the weights see them. The record says
  ``sdc_recheck`` (tensors that differed; 0 when equal), ``sdc_recheck_tensor`` and
  ``sdc_recheck_kept`` (``recompute``: the first run was wrong; ``first``: the second was;
  ``none``: three different answers, a device that cannot compute the same thing twice).

- contributions (FSDP: what the rank hands to the gradient reduce-scatter, before any other rank
  adds to it; ``tap``): fingerprinted in each run of a recheck. The reduce-scatter spreads one
  rank's compute error over every rank's shard, so a shard that differs names where the error
  landed, not who made it: a rank whose own contribution differed between its runs is the one
  (``sdc_recheck_contrib``), and on a disagreement the ranks exchange that flag so each record says
  who computed wrong (``sdc_recheck_compute``: ranks; a rank whose shard differed and is not among
  them received the error, it did not make it).
- on another rank (``partner``): a device that is wrong the same way every time agrees with itself,
  so no re-run on the same rank can see it. Every ``partner_every`` steps, and whenever the
  same-rank runs were inconclusive (three answers), each rank also computes the batch of the rank
  before it in the ring (the gradients restored afterwards) and the contributions are compared
  across devices: ``sdc_partner`` (batches whose two devices disagreed; 0: all equal) and
  ``sdc_partner_suspects`` (the devices common to every disagreement: one rank from 3 ranks up,
  both of a pair of 2).

``sdc_s`` in a record is the time the checks took for it (not part of ``step_s``).

The adapter calls ``before_step(step)`` right after ``probe.before_step`` (the ``bitflip`` fault
hook, ``probe.faults.flip_bits``, is called from here: it flips between steps, where the check
looks) and merges ``after_step(step)`` into the step's metrics. ``every`` is
``[monitors.sdc] every`` (0 or the monitor off: nothing is computed). Imports torch lazily.
"""

from __future__ import annotations

import time
from typing import Any, Callable

MASK64 = (1 << 64) - 1

Named = list[tuple[str, Any]]


def local(t: Any) -> Any:
    """A DTensor's local shard (FSDP2), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def tensor_sum(t: Any) -> int:
    """The exact sum, wrapping at 2^64, of the tensor's bytes read as 64-bit integers (its last
    0-7 bytes as unsigned bytes), as a Python int. One flipped bit changes one word by +-2^b, so it
    always changes the sum. 64-bit words: a sum at memory speed, where summing an int32 view into
    int64 is ~30x slower on a CPU (bench/README.md, silent data corruption)."""
    import torch

    flat = t.detach().contiguous().view(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.numel() * flat.element_size() % 8 == 0 and flat.element_size() <= 8:
        try:  # the usual case, in one view: whole 64-bit words, 8-byte aligned
            return int(flat.view(torch.int64).sum()) & MASK64
        except RuntimeError:
            pass
    raw = flat.view(torch.uint8)
    whole = raw.numel() // 8 * 8
    total = 0
    if whole:
        try:
            total = int(raw[:whole].view(torch.int64).sum())
        except RuntimeError:  # storage not 8-byte aligned: the same words, summed as int32 halves
            total = int(raw[:whole].view(torch.int32).sum(dtype=torch.int64))
    if whole < raw.numel():
        total += int(raw[whole:].sum(dtype=torch.int64))
    return total & MASK64


def fingerprint(named: Named) -> list[int]:
    """One exact sum per tensor, in ``named``'s order."""
    return [tensor_sum(t) for _, t in named]


def total(sums: list[int]) -> str:
    """The state's fingerprint: the sums combined by position (16 hex digits)."""
    acc = 0
    for i, s in enumerate(sums):
        acc = (acc * 1000003 + s + i) & MASK64
    return f"{acc:016x}"


def optim_tensors(optimizers: list[Any]) -> Named:
    """Every tensor of the optimizers' state, named by (optimizer, group, param, key), in their
    parameter order."""
    out: Named = []
    for o, opt in enumerate(optimizers):
        state = getattr(opt, "state", {})
        for g, group in enumerate(getattr(opt, "param_groups", [])):
            for p, param in enumerate(group.get("params", [])):
                for key, value in sorted((state.get(param) or {}).items()):
                    if hasattr(value, "dtype") and hasattr(value, "numel"):
                        out.append((f"optim{o}.g{g}.p{p}.{key}", local(value)))
    return out


class StateChecks:
    """One rank's at-rest and replica checks (see the module docstring).

    ``params()`` and ``optims()`` list the rank's named local tensors (called at check steps only);
    ``probe`` is the rank probe (its faults' ``flip_bits`` hook runs before each step)."""

    def __init__(
        self,
        every: int,
        probe: Any,
        params: Callable[[], Named],
        optims: Callable[[], Named],
        replicated: bool = False,
        recheck_every: int = 0,
        partner_every: int = 0,
        tap: Any = None,
    ):
        self.every = max(0, int(every))
        self.recheck_every = max(0, int(recheck_every))
        self.partner_every = max(0, int(partner_every))
        self.tap = tap  # the engine's contribution tap: ``arm(bool)``, ``take() -> list[int]``
        self.probe = probe
        self.params, self.optims = params, optims
        self.replicated = replicated
        self._after: tuple[int, list[int], list[str]] | None = None  # (step, sums, names)
        self._keys: dict[str, Any] = {}
        self._spent = 0.0  # seconds the checks took since the last record (``sdc_s``)

    def tensors(self, target: str = "all") -> Named:
        if target == "param":
            return self.params()
        if target == "optim":
            return self.optims()
        return self.params() + self.optims()

    def before_step(self, step: int) -> None:
        """The fault hook first (a flip lands between steps), then the at-rest comparison with the
        fingerprint taken at the end of the previous step (if that step was a check step)."""
        faults = getattr(self.probe, "faults", None)
        if faults is not None:
            faults.flip_bits(step, self.tensors)
        if self.tap is not None:  # contributions are fingerprinted at check steps only
            self.tap.arm(self._rechecks(step) or self._partners(step))
        after, self._after = self._after, None
        self._keys = {}
        if after is None or after[0] != step - 1:
            return
        t0 = time.perf_counter()
        named = self.tensors()
        now = fingerprint(named)
        names = [n for n, _ in named]
        if names != after[2]:
            return  # the state's layout changed (optimizer state created lazily): not comparable
        changed = [n for n, a, b in zip(names, after[1], now) if a != b]
        self._keys = {"sdc_rest": len(changed)}
        if changed:
            self._keys["sdc_rest_tensor"] = changed[0]
        self._spent += time.perf_counter() - t0

    def _rechecks(self, step: int) -> bool:
        return bool(self.recheck_every) and step % self.recheck_every == 0

    def _partners(self, step: int) -> bool:
        return bool(self.partner_every) and step % self.partner_every == 0

    def _contribs(self) -> list[int]:
        return self.tap.take() if self.tap is not None else []

    def before_optimizer(
        self,
        step: int,
        grads: Callable[[], Named],
        rerun: Callable[[], None] | None = None,
        agree: Callable[[bool], bool] = bool,
        exchange: Callable[[bool], list[bool]] | None = None,
        partner: Callable[[list[int]], tuple[list[int], list[int]] | None] | None = None,
    ) -> None:
        """Between the backward and the optimizer: ``bitflip target=grad`` faults, then at a
        recheck step the gradients compared with a second computation (``rerun`` recomputes them
        in place, None where the engine cannot: DDP replicas are compared after the optimizer
        instead; ``agree`` is true on every rank when any rank's flag is; ``exchange`` gives every
        rank's flag, by rank), and at a partner step the re-run on another rank (``partner``: given
        this rank's contributions, the batches whose devices disagreed and the suspects, the same
        on every rank; None where it cannot run)."""
        faults = getattr(self.probe, "faults", None)
        if faults is not None:
            faults.flip_bits(step, lambda _target: grads(), faults.GRAD)
        recheck = rerun is not None and self._rechecks(step)
        pair = partner is not None and self._partners(step)
        if not (recheck or pair):
            self._contribs()  # nothing is compared: forget what the tap saw
            return
        t0 = time.perf_counter()
        own = self._contribs()
        keys: dict[str, Any] = {}
        if recheck:
            inconclusive, own = self._recheck(grads, rerun, agree, exchange, own, keys)
            pair = pair or (partner is not None and agree(inconclusive))
        if pair and partner is not None:
            verdict = partner(own)
            if verdict is not None:
                mismatched, suspects = verdict
                keys["sdc_partner"] = len(mismatched)
                if mismatched:
                    keys["sdc_partner_suspects"] = suspects
        self._keys.update(keys)
        self._spent += time.perf_counter() - t0

    def _recheck(
        self,
        grads: Callable[[], Named],
        rerun: Any,
        agree: Callable[[bool], bool],
        exchange: Callable[[bool], list[bool]] | None,
        c1: list[int],
        keys: dict[str, Any],
    ) -> tuple[bool, list[int]]:
        """The same-rank runs (see the module docstring). Returns whether they were inconclusive
        (three answers) and the contributions of the run that stands."""
        named = grads()
        names = [n for n, _ in named]
        first = fingerprint(named)
        rerun()
        second, c2 = fingerprint(grads()), self._contribs()
        differ = [n for n, a, b in zip(names, first, second) if a != b]
        cdiff = sum(a != b for a, b in zip(c1, c2)) + abs(len(c1) - len(c2))
        keys["sdc_recheck"] = len(differ)
        if self.tap is not None:
            keys["sdc_recheck_contrib"] = cdiff
        if not agree(bool(differ or cdiff)):  # a third run, on every rank: its collectives need all
            return False, c1
        rerun()
        third, c3 = fingerprint(grads()), self._contribs()
        kept = ckept = None
        if differ:
            kept = _vote(first, second, third)
            keys.update(sdc_recheck_tensor=differ[0], sdc_recheck_kept=kept)
        if cdiff:
            ckept = keys["sdc_recheck_kept"] = _vote(c1, c2, c3)  # the compute's verdict first
        if exchange is not None:
            keys["sdc_recheck_compute"] = [r for r, f in enumerate(exchange(bool(cdiff))) if f]
        stands = c2 if c3 == c2 else c1 if c3 == c1 else c3
        return "none" in (kept, ckept), stands

    def after_step(self, step: int) -> dict[str, Any]:
        """Record keys for ``step``: the at-rest verdict of its start, and at a check step the
        fingerprint after the optimizer (kept for the next start; ``sdc_fp`` when replicated)."""
        keys, self._keys = self._keys, {}
        if self.every and step % self.every == 0:
            t0 = time.perf_counter()
            named = self.tensors()
            sums = fingerprint(named)
            self._after = (step, sums, [n for n, _ in named])
            if self.replicated:
                keys["sdc_fp"] = total(sums)
            self._spent += time.perf_counter() - t0
        if self._spent:
            keys["sdc_s"] = round(self._spent, 6)  # the checks' cost, outside ``step_s``
            self._spent = 0.0
        return keys


def _vote(first: list[int], second: list[int], third: list[int]) -> str:
    """Which run a third one sided with: ``recompute`` (the second), ``first``, or ``none``."""
    return "recompute" if third == second else "first" if third == first else "none"


def partner_suspects(mismatched: list[int], world: int) -> list[int]:
    """The devices common to every disagreeing batch: batch ``i`` was computed by rank ``i`` and,
    on the partner run, by rank ``i + 1`` (mod ``world``). One bad device ``d`` spoils batch ``d``
    (its own) and ``d - 1`` (its partner duty): from 3 ranks up only ``d`` is common to both."""
    if not mismatched:
        return []
    common = set(range(world))
    for i in mismatched:
        common &= {i % world, (i + 1) % world}
    return sorted(common)


def grad_tensors(modules: list[Any]) -> Named:
    """Every parameter's local gradient (FSDP: its shard), named, in the modules' order."""
    return [
        (f"{i}.{n}.grad", local(p.grad))
        for i, m in enumerate(modules)
        for n, p in m.named_parameters()
        if p.grad is not None
    ]


def _sdc(recipe: Any) -> Any:
    """The recipe's ``[monitors.sdc]``, None when the monitors or the sdc monitor are off."""
    section = getattr(recipe, "monitors", None)
    sdc = getattr(section, "sdc", None)
    if section is None or sdc is None or not section.enabled or not sdc.enabled:
        return None
    return sdc


def every_of(recipe: Any) -> int:
    """``[monitors.sdc] every`` of the recipe (0 when off)."""
    sdc = _sdc(recipe)
    return 0 if sdc is None else int(sdc.every)


def recheck_of(recipe: Any) -> int:
    """``[monitors.sdc] recheck_every`` of the recipe (0 when off)."""
    sdc = _sdc(recipe)
    return 0 if sdc is None else int(sdc.recheck_every)


def partner_of(recipe: Any) -> int:
    """``[monitors.sdc] partner_every`` of the recipe (0 when off)."""
    sdc = _sdc(recipe)
    return 0 if sdc is None else int(sdc.partner_every)
