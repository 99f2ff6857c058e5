"""Silent data corruption: a rank's state changed where nothing may change it.

Why: a device that flips bits does not crash; its weights go wrong and every later checkpoint is
"valid". The ranks fingerprint their own state exactly (``recipes/sdc.py``); this monitor reads
two record keys:

- ``sdc_rest`` (at rest): how many of the rank's tensors changed between the end of the previous
  step (after its optimizer) and the start of this one. Any change is corruption on that rank
  (``kind at_rest``). The checkpoint of the previous step was written inside that window, so it is
  not proven clean: the finding's ``step`` is the previous step (the rollback goes to a
  checkpoint strictly before it);
- ``sdc_fp`` (replicas, DDP): the fingerprint after the optimizer step, the same on every rank
  that holds the same state. Ranks that disagree at a step are corrupt (``kind replica``); the
  rank named is the one outside the majority (with two ranks there is none: ``rank`` is None),
  judged once every rank seen in the attempt has reported the step.
  The finding's ``step`` is the last step at which they agreed in this attempt (or the one before
  the attempt's first record).

- ``sdc_recheck`` (no replica: FSDP shards): how many of the rank's gradient tensors differed when
  it computed them again from the same batch and weights (``recheck_every``; 0: equal), and
  ``sdc_recheck_kept``, which run a third one sided with. A first catch whose corrupt run was
  outvoted is ``recompute transient`` (warning): the corrupt gradients were discarded before the
  optimizer, the weights never saw them, nothing to roll back (``policy.contained_sdc``). A rank
  caught again (or whose three runs all differ) is ``recompute persistent`` (critical): a device
  that computes wrong between rechecks too, so the finding's ``step`` is the rank's last clean
  recheck (the rollback goes before it) and the policy strikes its node.
  ``sdc_recheck_contrib`` counts what the rank handed to the reduce-scatter that differed between
  its runs: its own compute went wrong. A rank whose shard differed while ``sdc_recheck_compute``
  (the ranks whose compute differed) names others only received the error: no finding for it.
- ``sdc_partner`` (the re-run on another rank): batches whose two devices disagreed (0: all
  equal), ``sdc_partner_suspects`` the devices common to every disagreement. A device wrong the
  same way every time passes its own rechecks, so the finding (``partner``, critical, once per
  attempt) goes back to the last clean partner check. One suspect is a bad device (``partner
  persistent``, ``value`` 2: the policy strikes its node); two (a pair of ranks) cannot be told
  apart (``partner unattributed``: ``rank`` None, rolled back, nobody struck).

One finding per rank (or per disagreement) and attempt: the attempt is torn down on it. A rank
caught in an earlier attempt too is ``persistent`` (a bad device, not a one-off upset): the
policy then strikes its node. ``Finding.value`` is how many attempts caught that rank (1:
transient so far). The detail starts with ``at_rest`` or ``replica`` and ``transient`` or
``persistent``.
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import Finding, record_attempt, record_ts, step_and_rank
from .config import SdcConfig

_KEYS = ("sdc_rest", "sdc_fp", "sdc_recheck", "sdc_partner")  # a record without them: nothing


class SdcMonitor:
    name = "sdc"

    def __init__(self, config: SdcConfig | None = None) -> None:
        self.config = config or SdcConfig()
        self.reset()

    def reset(self) -> None:
        self._caught: dict[Any, set[Any]] = {}  # rank (None: a pair) -> attempts that caught it
        self._done: set[tuple[Any, Any]] = set()  # (attempt, rank) already reported
        self._fps: dict[tuple[Any, int], dict[int, str]] = {}  # (attempt, step) -> rank -> fp
        self._agreed: dict[Any, int] = {}  # attempt -> last step all ranks agreed
        self._first: dict[Any, int] = {}  # attempt -> its first step seen
        self._ranks: dict[Any, set[int]] = {}  # attempt -> the ranks that reported in it
        self._rechecked: dict[Any, int] = {}  # rank -> gradient rechecks it failed
        self._clean: dict[tuple[Any, Any], int] = {}  # (attempt, rank) -> last equal recheck
        self._paired: dict[Any, int] = {}  # attempt -> last step every partner batch agreed

    def _finding(
        self, kind: str, step: int, rank: int | None, attempt: Any, rec: Mapping, what: str
    ) -> list[Finding]:
        if (attempt, rank) in self._done:
            return []
        self._done.add((attempt, rank))
        seen = self._caught.setdefault(rank, set())
        seen.add(attempt)
        persistent = len(seen) > 1
        how = "persistent" if persistent else "transient"
        who = f"rank {rank}" if rank is not None else "a rank (two replicas: which one is unknown)"
        detail = f"{kind} {how}: {who} {what}" + (
            f"; caught again in attempt {attempt} (a bad device)" if persistent else ""
        )
        return [
            Finding(
                self.name,
                step,
                float(len(seen)),
                detail,
                "critical",
                rank=rank,
                attempt=attempt,
                ts=record_ts(rec),
            )
        ]

    def feed(self, record: Mapping[str, Any]) -> list[Finding]:
        step, rank = step_and_rank(record)
        if step is None:
            return []
        attempt = record_attempt(record)
        self._first.setdefault(attempt, step)
        self._ranks.setdefault(attempt, set()).add(rank)
        out: list[Finding] = []
        changed = record.get("sdc_rest")
        if isinstance(changed, int) and changed > 0:
            tensor = record.get("sdc_rest_tensor") or "?"
            out += self._finding(
                "at_rest",
                step - 1,
                rank,
                attempt,
                record,
                f"changed {changed} tensor(s) ({tensor}) between the end of step {step - 1} and "
                f"the start of step {step}, outside its optimizer",
            )
        fp = record.get("sdc_fp")
        if isinstance(fp, str):
            out += self._replica(attempt, step, rank, fp, record)
        differed = record.get("sdc_recheck")
        computed = record.get("sdc_recheck_contrib")
        if isinstance(computed, int) and computed > 0:
            out += self._recheck(step, rank, attempt, record, computed, "computation")
        elif isinstance(differed, int) and differed == 0:
            self._clean[(attempt, rank)] = step
        elif isinstance(differed, int) and differed > 0:
            culprits = record.get("sdc_recheck_compute") or []
            if not culprits or rank in culprits:  # else: another rank's error reached its shard
                out += self._recheck(step, rank, attempt, record, differed, "gradients")
        paired = record.get("sdc_partner")
        if isinstance(paired, int) and paired == 0:
            self._paired[attempt] = max(self._paired.get(attempt, 0), step)
        elif isinstance(paired, int) and paired > 0:
            out += self._partner(step, attempt, record, paired)
        return out

    def _partner(self, step: int, attempt: Any, rec: Mapping, paired: int) -> list[Finding]:
        if (attempt, "partner") in self._done:
            return []
        self._done.add((attempt, "partner"))
        suspects = [s for s in rec.get("sdc_partner_suspects") or [] if isinstance(s, int)]
        since = self._paired.get(attempt, self._first[attempt] - 1)
        one = suspects[0] if len(suspects) == 1 else None
        who = (
            f"rank {one} computes differently from another device"
            if one is not None
            else "ranks " + " and ".join(map(str, suspects)) + " disagree (which one is wrong "
            "is unknown with two)"
        )
        detail = (
            f"partner {'persistent' if one is not None else 'unattributed'}: {who}: {paired} "
            f"batch(es) of step {step} gave different gradients on their own rank and on the "
            "next one, while the same-rank re-runs agreed (a device wrong the same way each "
            f"time); the weights may hold corruption since the last clean partner check, step "
            f"{since}"
        )
        return [
            Finding(
                self.name, since, 2.0 if one is not None else 1.0, detail, "critical",
                rank=one, attempt=attempt, ts=record_ts(rec),
            )
        ]  # fmt: skip

    def _recheck(
        self, step: int, rank: int, attempt: Any, rec: Mapping, differed: int, what: str
    ) -> list[Finding]:
        n = self._rechecked[rank] = self._rechecked.get(rank, 0) + 1
        kept = rec.get("sdc_recheck_kept")
        where = (
            f"{differed} reduce-scatter bucket(s) it computed"
            if what == "computation"
            else f"{differed} tensor(s), {rec.get('sdc_recheck_tensor') or '?'}"
        )
        what = (
            f"rank {rank}'s {what} at step {step} differed when computed again from the same "
            f"batch and weights ({where})"
        )
        if n == 1 and kept in ("recompute", "first"):
            side = "second" if kept == "recompute" else "first"
            detail = (
                f"recompute transient: {what}; a third run sided with the {side}: the corrupt "
                "ones were discarded before the optimizer (the weights never saw them)"
            )
            return [
                Finding(
                    self.name, step, 1.0, detail, "warning", rank=rank, attempt=attempt,
                    ts=record_ts(rec),
                )
            ]  # fmt: skip
        if (attempt, rank) in self._done:
            return []
        self._done.add((attempt, rank))
        since = self._clean.get((attempt, rank), self._first[attempt] - 1)
        why = "three runs gave three answers" if kept == "none" else f"caught {n} times"
        detail = (
            f"recompute persistent: {what}; {why} (a bad device): its weights may hold "
            f"corruption since its last clean recheck, step {since}"
        )
        return [
            Finding(
                self.name, since, float(max(n, 2)), detail, "critical", rank=rank,
                attempt=attempt, ts=record_ts(rec),
            )
        ]  # fmt: skip

    def _replica(self, attempt: Any, step: int, rank: int, fp: str, rec: Mapping) -> list[Finding]:
        if len(self._fps) > 64:  # a few steps in flight at most: forget the oldest
            for key in sorted(self._fps, key=lambda k: k[1])[:32]:
                del self._fps[key]
        group = self._fps.setdefault((attempt, step), {})
        group[rank] = fp
        if not self._ranks[attempt] <= group.keys():
            return []  # judged once every rank of the attempt has reported the step
        values = set(group.values())
        if len(values) == 1:
            if len(group) > 1:
                self._agreed[attempt] = max(self._agreed.get(attempt, 0), step)
            return []
        counts: dict[str, list[int]] = {}
        for r, v in sorted(group.items()):
            counts.setdefault(v, []).append(r)
        ranked = sorted(counts.values(), key=len, reverse=True)
        odd = None
        if len(ranked[0]) > len(ranked[1]) and sum(len(x) for x in ranked[1:]) == 1:
            odd = ranked[1][0]
        since = self._agreed.get(attempt, self._first[attempt] - 1)
        what = (
            f"holds state that its replicas do not at step {step} (fingerprints by rank: "
            + ", ".join(f"{r}={v}" for r, v in sorted(group.items()))
            + f"; last agreed at step {since})"
        )
        # the pair (None) or the odd rank is reported once per attempt
        return self._finding("replica", since, odd, attempt, rec, what)

    def feed_at(self, record: Mapping[str, Any], keys: Any, step: int, rank: int) -> list[Finding]:
        if not any(k in keys for k in _KEYS):
            return []
        return self.feed(record)
