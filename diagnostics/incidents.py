"""Findings and events grouped into incidents: one per attempt end (crash, hang, early exit,
stop, preemption, failure) and one per anomaly episode (numeric, straggler, RL, checkpoint).

An incident is what the on-call reads first: a one-line title, where (attempt, step, rank, host),
evidence (short strings: the signal in words, the odd rank's frame, loss around the NaN), the
runbook, and what the supervisor did about it (the restart or rollback that followed).

Shape (``diagnose()["incidents"]``; keys only ever added, extras go under ``details``)::

    {"id", "kind", "title", "severity", "ts", "ts_end", "attempt", "step", "rank", "ranks",
     "ranks_text", "host", "evidence", "runbook", "action", "details"}

``ranks_text`` is ``ranks`` as ranges (``0-7,9,12-4095 (4090 ranks)``: ``ops/runrecord/ranks.py``),
what a page or a line shows; null when no rank is named.
"""

from __future__ import annotations

import math
import socket
from pathlib import Path
from typing import Any

from ptops.diagnostics import crash as crashes
from ptops.diagnostics import flightrec
from ptops.diagnostics import stacks as hangstacks
from ptops.diagnostics.memcurve import about_memory, curve_lines, memory_curve
from ptops.ops.runrecord.events import is_all_clear
from ptops.ops.runrecord.ranks import rank_list

# anomaly findings of one monitor closer than this many steps are one episode
EPISODE_GAP_STEPS = 10
CONTEXT_STEPS = 3
_SEV_ORDER = {"critical": 0, "warning": 1, "info": 2}


def _f(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return "-" if v is None else str(v)


def attempt_at(ts: Any, launches: list[tuple[float, int]]) -> int | None:
    """The attempt running at ``ts``: the latest launch at or before it."""
    if not isinstance(ts, (int, float)):
        return None
    cur = None
    for t, a in launches:
        if t <= ts:
            cur = a
    return cur


def _attempt_of(e: dict[str, Any], launches: list[tuple[float, int]]) -> int | None:
    if isinstance(e.get("attempt"), int):
        return e["attempt"]
    return attempt_at(e.get("ts"), launches)


def _after(events: list[dict[str, Any]], ts: Any, kinds: tuple[str, ...]) -> dict[str, Any] | None:
    if not isinstance(ts, (int, float)):
        return None
    return next(
        (
            e
            for e in events
            if e.get("kind") in kinds and isinstance(e.get("ts"), (int, float)) and e["ts"] >= ts
        ),
        None,
    )


def _action(events: list[dict[str, Any]], ts: Any) -> str | None:
    """What the supervisor did next: the first restart / rollback / end after ``ts``."""
    e = _after(
        events, ts, ("restart", "rollback", "failed", "stopped", "completed", "exclude_node")
    )
    if e is None:
        return None
    k = e["kind"]
    if k == "restart":
        return f"restarted as attempt {e.get('attempt')} from step {e.get('from_step')}"
    if k == "rollback":
        lr = f", lr x{e['lr_scale']}" if e.get("lr_scale") not in (None, 1, 1.0) else ""
        skip = f", skipping {e['skip_batches']} batch(es)" if e.get("skip_batches") else ""
        return f"rolled back from step {e.get('from_step')} to step {e.get('to_step')}{lr}{skip}"
    if k == "failed":
        return f"gave up: {e.get('reason')}"
    if k == "stopped":
        return f"stopped ({e.get('reason') or 'signal'})"
    if k == "exclude_node":
        return (
            f"asked to exclude host {e.get('host')} (rank {e.get('rank')}; acted: "
            f"{e.get('acted', False)})"
        )
    return None


def _last_step(
    metrics: list[dict[str, Any]], attempt: int | None, rank: int | None = None
) -> int | None:
    steps = [
        r["step"]
        for r in metrics
        if isinstance(r.get("step"), int)
        and (attempt is None or r.get("attempt", 1) == attempt)
        and (rank is None or r.get("rank") == rank)
    ]
    return max(steps, default=None)


def _context(metrics: list[dict[str, Any]], step: int, attempt: int | None) -> list[dict[str, Any]]:
    """Loss and grad norm of rank 0 a few steps either side of ``step`` in that attempt."""
    rows = {}
    for r in metrics:
        s = r.get("step")
        if not isinstance(s, int) or abs(s - step) > CONTEXT_STEPS or r.get("rank", 0) != 0:
            continue
        if attempt is not None and r.get("attempt", 1) != attempt:
            continue
        rows[s] = {"step": s, "loss": r.get("loss"), "grad_norm": r.get("grad_norm")}
    return [rows[s] for s in sorted(rows)]


def _host_here(host: str | None) -> bool:
    return host in (None, "localhost", socket.gethostname())


# a rank's stack note or a flight-recorder error that is the collection failing, not the rank
_INTERNAL = ("failed", "error", "exception", "traceback", "timed out", "not installed", "assert")


def _internal(text: str) -> bool:
    t = text.lower()
    return any(w in t for w in _INTERNAL)


def _group_where(g: dict[str, Any], notes: list[str]) -> str:
    """A stack group's place in words (``forward (train.py:11 in forward)``); a rank without a
    stack says so, and why when the reason is about the rank (never connected, node unreachable),
    while a dump that failed (py-spy's error) goes to the collection notes."""
    if g.get("where"):
        return str(g["where"])
    if g.get("frame"):
        return str(g["frame"])
    note = str(g.get("note") or "").strip()
    if not note:
        return "no stack"
    if _internal(note):
        why = note.removeprefix("no stack:").strip()
        notes.append(f"stacks of rank(s) {rank_list(g['ranks'], bare=True)}: {why}")
        return "no stack (its dump failed: see the collection notes)"
    return note


def _flight_recorder_note(error: str) -> str:
    """A flight-recorder analysis that failed, as a note about the collection. torch <= 2.11's
    analyser asserts that a dump's backend is NCCL (``name formatting error? gloo != 'nccl'``)."""
    if "gloo" in error and "nccl" in error:
        return (
            "flight recorder: not available with gloo (this torch's analyser reads NCCL dumps only)"
        )
    return f"flight recorder: the dumps could not be analysed ({error[:200]})"


def _others(odd: dict[str, Any], groups: list[dict[str, Any]]) -> str:
    """The title's tail: where the ranks other than the odd ones are. "wait in a collective" only
    when every one of them is in one (by its stack)."""
    rest = [g for g in groups if g is not odd]
    if not rest:
        return ""
    if all(g.get("place") == "collective" for g in rest):
        within = sorted({g["within"] for g in rest if g.get("within")})
        return " while the others wait in a collective" + (
            f" (in {', '.join(within)})" if within else ""
        )
    if len(rest) <= 2:
        return "".join(
            f"; rank(s) {rank_list(g['ranks'], bare=True)}: "
            f"{g.get('where') or g.get('frame') or 'no stack'}"
            for g in rest
        )
    return f"; the others in {len(rest)} other places (evidence)"


class _Builder:
    def __init__(
        self,
        run_dir: Path,
        events: list[dict[str, Any]],
        metrics: list[dict[str, Any]],
        findings: list[dict[str, Any]],
        hosts: dict[int, str],
        runbooks: dict[str, str],
    ):
        self.run_dir, self.events, self.metrics, self.findings = run_dir, events, metrics, findings
        self.hosts, self.runbooks = hosts, runbooks
        self.launches = [
            (e["ts"], e["attempt"])
            for e in events
            if e.get("kind") == "launch"
            and isinstance(e.get("ts"), (int, float))
            and isinstance(e.get("attempt"), int)
        ]
        self.out: list[dict[str, Any]] = []

    def add(
        self,
        kind: str,
        title: str,
        severity: str,
        *,
        ts=None,
        ts_end=None,
        attempt=None,
        step=None,
        rank=None,
        ranks=None,
        host=None,
        evidence=None,
        runbook=None,
        action=None,
        details=None,
    ) -> dict[str, Any]:
        ranks = sorted({int(r) for r in (ranks or ([] if rank is None else [rank]))})
        if host is None and rank is not None:
            host = self.hosts.get(rank)
        inc = {
            "id": 0,
            "kind": kind,
            "title": title,
            "severity": severity,
            "ts": ts,
            "ts_end": ts_end,
            "attempt": attempt,
            "step": step,
            "rank": rank,
            "ranks": ranks,
            "ranks_text": rank_list(ranks, bare=True) if ranks else None,
            "host": host,
            "evidence": [str(x) for x in (evidence or []) if x],
            "runbook": runbook,
            "action": action,
            "details": details or {},
        }
        self.out.append(inc)
        return inc

    # attempt ends ---------------------------------------------------------------------------------
    def crash(self, e: dict[str, Any]) -> None:
        attempt, rank = _attempt_of(e, self.launches), e.get("rank")
        rank = rank if isinstance(rank, int) else None
        host = e.get("host") or (self.hosts.get(rank) if rank is not None else None)
        pids = self._pids(attempt)
        info = crashes.explain(
            self.run_dir,
            {**e, "attempt": attempt},
            self.events,
            same_host=_host_here(host),
            pids={rank: pids.get(rank)} if rank is not None and pids.get(rank) else {},
        )
        step = (
            e.get("step")
            if isinstance(e.get("step"), int)
            else _last_step(self.metrics, attempt, rank)
        )
        exc = info["exception"]
        what = (
            f"{exc['type']}: {exc['message']}"[:120]
            if exc and info["signal"] is None
            else info["words"]
        )
        title = (
            f"rank {rank if rank is not None else '?'} crashed in attempt {attempt}"
            f"{f' near step {step}' if step is not None else ''}: {what}"
        )
        ev = [info["words"]]
        if info["cause"]:
            ev.append(f"cause: {info['cause']}")
        if exc:
            ev.append(f"exception: {exc['type']}: {exc['message']}"[:300])
        curve = memory_curve(self.metrics, attempt, rank) if about_memory(info) else []
        if (
            curve
        ):  # an OOM: how the rank's memory got there (the memory monitor's input); all in details
            ev.append(f"memory of rank {rank}, last steps of attempt {attempt}:")
            ev += ["  " + line for line in curve_lines(curve[-8:])]
        ev += [f"log: {p}" for p in info["patterns"]]
        ev += [f"checked: {c}" for c in info["checked"]]
        if info["last_lines"]:
            ev.append(f"last lines of logs/attempt-{attempt}/rank-{rank}.log:")
            ev += ["  " + ln for ln in info["last_lines"]]
        elif not info["exists"]:
            ev.append(f"no log at logs/attempt-{attempt}/rank-{rank}.log")
        self.add(
            "crash",
            title,
            "critical",
            ts=e.get("ts"),
            attempt=attempt,
            step=step,
            rank=rank,
            host=host,
            evidence=ev,
            runbook=self.runbooks.get("crash"),
            action=_action(self.events, e.get("ts")),
            details={
                "exit_code": e.get("exit_code"),
                "signal": info["signal"],
                "cause": info["cause"],
                "exception": exc,
                "patterns": info["patterns"],
                "last_lines": info["last_lines"],
                "injected": info["injected"],
                "how": e.get("how"),
                "memory_curve": curve,
            },
        )

    def _pids(self, attempt: int | None) -> dict[int, int]:
        out: dict[int, int] = {}
        try:  # status.json lists the pids of the latest attempt
            import json

            st = json.loads((self.run_dir / "status.json").read_text())
            if st.get("attempt") == attempt:
                for r in st.get("ranks") or []:
                    if (
                        isinstance(r, dict)
                        and isinstance(r.get("rank"), int)
                        and isinstance(r.get("pid"), int)
                    ):
                        out[r["rank"]] = r["pid"]
        except (OSError, ValueError, AttributeError):
            pass
        for e in self.events:
            if _attempt_of(e, self.launches) == attempt and isinstance(e.get("ranks"), list):
                for r in e["ranks"]:
                    if (
                        isinstance(r, dict)
                        and isinstance(r.get("rank"), int)
                        and isinstance(r.get("pid"), int)
                    ):
                        out[r["rank"]] = r["pid"]
        return out

    def hang(self, e: dict[str, Any]) -> None:
        attempt = _attempt_of(e, self.launches)
        blamed = [r for r in e.get("ranks", []) if isinstance(r, int)]
        step = e.get("step") if isinstance(e.get("step"), int) else None
        stack_dir = (
            self.run_dir / "stacks" / f"attempt-{attempt}"
        )  # not e["stacks"]: the run dir may have moved
        st = hangstacks.analyse(stack_dir, blamed)
        launch = next(
            (
                ev
                for ev in self.events
                if ev.get("kind") == "launch" and ev.get("attempt") == attempt
            ),
            {},
        )
        nproc = launch.get("nproc") if isinstance(launch.get("nproc"), int) else None
        fr = flightrec.analyse(
            stack_dir,
            world=nproc,
            extra_dir=self.run_dir / "titan" / "comm_traces",
            after_ts=launch.get("ts") if isinstance(launch.get("ts"), (int, float)) else None,
        )
        odd = (st or {}).get("odd")
        ev = [
            f"silent {_f(e.get('silent_s'))} s (budget {_f(e.get('timeout_s'))} s, "
            f"{e.get('phase') or 'step'}"
            f"{', ' + str(e.get('why')) if e.get('why') else ''})"
        ]
        also = [r for r in e.get("also_quiet") or [] if isinstance(r, int)]
        if also:  # quiet past ping_stale_s when the budget ran out, silent for less: not blamed
            ev.append(
                f"also quiet, not named (silent for less): rank(s) {rank_list(also, bare=True)}"
            )
        notes: list[str] = []  # about the collection (a dump that failed): not the hang's cause
        if st:
            for g in st["groups"]:
                src = [x for x in g["sources"] if x != "?"]  # a rank without a stack: none
                ev.append(
                    f"rank(s) {rank_list(g['ranks'], bare=True)}: {_group_where(g, notes)}"
                    + (f" [{', '.join(src)}]" if src else "")
                )
        else:
            ev.append(f"no stacks in stacks/attempt-{attempt}/")
        if fr:
            if fr.get("error"):
                notes.append(_flight_recorder_note(str(fr["error"])))
            else:
                ev += [f"flight recorder: {m}" for m in fr.get("summary", [])]
        who = odd["ranks"] if odd else blamed
        if odd and odd["frame"]:
            title = (
                f"hang in attempt {attempt} at step {step}: rank "
                f"{rank_list(odd['ranks'], bare=True)} stuck in {odd.get('where') or odd['frame']}"
                + _others(odd, st["groups"])
            )
        else:
            title = (
                f"hang in attempt {attempt} at step {step}: rank(s) "
                f"{rank_list(blamed, bare=True) or '?'} silent"
            )
            if st and len(st["groups"]) == 1 and st["groups"][0].get("where"):
                title += f", all in {st['groups'][0]['where']}"
        self.add(
            "hang",
            title,
            "critical",
            ts=e.get("ts"),
            attempt=attempt,
            step=step,
            rank=who[0] if len(who) == 1 else None,
            ranks=who,
            evidence=ev,
            runbook=self.runbooks.get("hang"),
            action=_action(self.events, e.get("ts")),
            details={
                "blamed": blamed,
                "silent_s": e.get("silent_s"),
                "phase": e.get("phase"),
                "stacks": st,
                "flight_recorder": fr,
                "stack_sources": e.get("stack_sources"),
                "collection_notes": notes,
            },
        )

    def end(self, e: dict[str, Any]) -> None:
        kind, attempt = e["kind"], _attempt_of(e, self.launches)
        if kind == "early_exit":
            self.add(
                "crash",
                f"attempt {attempt} exited cleanly before the last step (at step {e.get('step')})",
                "critical",
                ts=e.get("ts"),
                attempt=attempt,
                step=e.get("step"),
                evidence=["torchrun exited 0 before the last step"],
                runbook=self.runbooks.get("early_exit"),
                action=_action(self.events, e.get("ts")),
                details={"event": "early_exit"},
            )
        elif kind == "stopped":
            preempt = any(
                ev.get("kind") == "fault_injected"
                and str(ev.get("fault", "")).startswith("preempt")
                and _attempt_of(ev, self.launches) == attempt
                for ev in self.events
            )
            sig, _ = (
                crashes.signal_words(-int(e["signal"]))
                if isinstance(e.get("signal"), int)
                else ("no signal", None)
            )
            k = "preempt" if preempt else "stop"
            what = (
                "preempted (SIGTERM from the scheduler)"
                if preempt
                else f"stopped: {e.get('reason') or sig}"
            )
            self.add(
                k,
                f"attempt {attempt} {what} at step {e.get('step')}",
                "warning" if preempt else "info",
                ts=e.get("ts"),
                attempt=attempt,
                step=e.get("step"),
                evidence=[sig, str(e.get("reason") or "")],
                runbook=None,
                action=_action(self.events, (e.get("ts") or 0) + 1e-6),
                details={"signal": e.get("signal"), "reason": e.get("reason")},
            )
        elif kind == "failed":
            reason = str(e.get("reason", ""))
            # a failure that ends an attempt already told as a crash/hang is that incident's action
            prior = [
                i
                for i in self.out
                if i["attempt"] == attempt and i["kind"] in ("crash", "hang", "health")
            ]
            if prior:
                return
            rb = next((rb for k, rb in self.runbooks.items() if k in reason), None)
            self.add(
                "failed",
                f"run failed: {reason}",
                "critical",
                ts=e.get("ts"),
                attempt=attempt,
                evidence=[reason],
                runbook=rb,
                details={"exit_code": e.get("exit_code")},
            )

    def health(self, e: dict[str, Any]) -> None:
        """One incident per node that failed its checks before an attempt (every node of a Slurm
        job is checked, spares too), with what was done: replaced, resubmitted without, gave up."""
        attempt = e.get("attempt")
        checks = [c for c in e.get("checks") or [] if isinstance(c, dict) and c.get("ok") is False]
        nodes = e.get("failed_nodes") or {None: e.get("failed") or []}
        for node, names in nodes.items():
            mine = [c for c in checks if c.get("node", node) == node]
            done = next(
                (
                    x
                    for x in self.events
                    if x.get("kind") in ("node_replaced", "slurm_requeue", "failed")
                    and x.get("attempt", attempt) == attempt
                    and (x.get("kind") != "node_replaced" or x.get("node") == node)
                    and isinstance(x.get("ts"), (int, float))
                    and x["ts"] >= (e.get("ts") or 0)
                ),
                None,
            )
            if done is None:
                action = None
            elif done["kind"] == "node_replaced":
                action = f"replaced by spare {done.get('by')} before attempt {attempt}"
            elif done["kind"] == "slurm_requeue":
                action = (
                    f"resubmitted as job {done.get('new_job_id')} without {done.get('exclude')}"
                )
            else:
                action = f"gave up: {done.get('reason')}"
            where = f"node {node}" if node is not None else "this node"
            self.add(
                "health",
                f"{where} failed its health check before attempt {attempt}: {', '.join(names)}",
                "warning" if done is not None and done["kind"] == "node_replaced" else "critical",
                ts=e.get("ts"),
                attempt=attempt,
                host=node,
                evidence=[f"{c.get('name')}: {c.get('detail')}" for c in mine],
                runbook=self.runbooks.get("health_check"),
                action=action,
                details={"node": node, "checks": names},
            )

    def checkpoint(self, e: dict[str, Any]) -> None:
        attempt = _attempt_of(e, self.launches)
        path = str(e.get("path", ""))
        short = path[path.find("checkpoints/") :] if "checkpoints/" in path else path
        if e["kind"] == "checkpoint_invalid":
            title = f"checkpoint {short} invalid: {e.get('reason')}"
            ev = [
                f"reason: {e.get('reason')}",
                f"set aside to {e['moved_to']}" if e.get("moved_to") else "",
                "found by rank 0's background read-back of the commit"
                if e.get("found_by") == "background_verify"
                else "",
            ]
            nxt = _after(self.events, e.get("ts"), ("restart", "launch"))
            action = (
                f"restart resumed from step {nxt.get('from_step')}"
                if nxt and nxt.get("from_step") is not None
                else _action(self.events, e.get("ts"))
            )
            sev, rb = "critical", self.runbooks.get("checkpoint_invalid")
            # one damaged checkpoint is one incident: found in the background first, set aside at
            # the restart
            same = next(
                (
                    i
                    for i in self.out
                    if i["kind"] == "checkpoint"
                    and i["details"].get("path") == short
                    and i["details"].get("event") == "checkpoint_invalid"
                ),
                None,
            )
            if same is not None:
                same["evidence"] += [x for x in ev if x and x not in same["evidence"]]
                same["action"] = action or same["action"]
                return
        else:
            title = f"checkpoint save at step {e.get('step')} failed: {str(e.get('error'))[:120]}"
            ev, action = [f"error: {e.get('error')}", "final save" if e.get("final") else ""], None
            sev, rb = "warning", self.runbooks.get("checkpoint_failed")
        step = e.get("step") if isinstance(e.get("step"), int) else None
        if step is None:
            try:
                step = int(short.rstrip("/").rsplit("step-", 1)[1])
            except (IndexError, ValueError):
                step = None
        self.add(
            "checkpoint",
            title,
            sev,
            ts=e.get("ts"),
            attempt=attempt,
            step=step,
            rank=e.get("rank") if isinstance(e.get("rank"), int) else None,
            evidence=ev,
            runbook=rb,
            action=action,
            details={
                "path": short,
                "event": e["kind"],
                "reason": e.get("reason") or e.get("error"),
            },
        )

    # anomaly episodes -----------------------------------------------------------------------------
    def episodes(self) -> None:
        groups: dict[tuple, list[list[dict[str, Any]]]] = {}
        for f in self.findings:
            if f["source"] == "event" and f["family"] == "incident":
                continue  # events told above as attempt ends / checkpoints
            fam = f["family"]
            key = (
                fam,
                f["attempt"],
                f["rank"] if fam in ("straggler", "sdc") else None,
                f["monitor"] if fam == "rl" else None,
            )
            eps = groups.setdefault(key, [])
            s = f["step"] if isinstance(f["step"], int) else None
            if (
                f.get("episode") is not None
            ):  # the monitor numbered its episodes (open/escalate/resolved): use them
                same = next((ep for ep in eps if ep[0].get("episode") == f["episode"]), None)
                if same is not None:
                    same.append(f)
                else:
                    eps.append([f])
                continue
            if eps and (
                s is None
                or eps[-1][-1]["step"] is None
                or s - eps[-1][-1]["step"] <= EPISODE_GAP_STEPS
                or fam == "straggler"
            ):
                eps[-1].append(f)
            else:
                eps.append([f])
        for (fam, attempt, _r, _m), eps in groups.items():
            for ep in eps:
                getattr(
                    self, f"_{fam}" if fam in ("numeric", "straggler", "rl", "sdc") else "_other"
                )(ep, attempt)

    def _span(self, ep):
        steps = [f["step"] for f in ep if isinstance(f["step"], int)]
        tss = [f["ts"] for f in ep if isinstance(f["ts"], (int, float))]
        sev = min((f["severity"] for f in ep), key=lambda s: _SEV_ORDER.get(s, 1))
        return (
            min(steps, default=None),
            max(steps, default=None),
            min(tss, default=None),
            max(tss, default=None),
            sev if sev in _SEV_ORDER else "warning",
        )

    def _numeric(self, ep, attempt) -> None:
        s0, s1, t0, t1, sev = self._span(ep)
        monitors = sorted({f["monitor"] for f in ep})
        first = ep[0]
        ctx = _context(self.metrics, s0, attempt) if s0 is not None else []
        ev = [f"{f['monitor']} at step {f['step']}: {f['detail']}" for f in ep[:5]]
        if ctx:
            ev.append(
                "around it (rank 0): "
                + "; ".join(
                    f"step {c['step']} loss {_f(c['loss'])} grad_norm {_f(c['grad_norm'])}"
                    for c in ctx
                )
            )

        def ours(
            e: dict[str, Any],
        ) -> bool:  # the rollback this episode caused: same attempt, soon after, its monitor
            ts = e.get("ts")
            if _attempt_of(e, self.launches) != attempt or (
                e.get("monitor") and e["monitor"] not in monitors
            ):
                return False
            return (
                t0 is None or not isinstance(ts, (int, float)) or t0 - 5 <= ts <= (t1 or t0) + 300
            )

        rb = next((e for e in self.events if e.get("kind") == "rollback" and ours(e)), None)
        applied = (
            []
            if rb is None
            else [
                e
                for e in self.events
                if e.get("kind") == "rollback_applied"
                and (_attempt_of(e, self.launches) or 0) > (attempt or 0)
                and (e.get("to_step") is None or e.get("to_step") == rb.get("to_step"))
            ]
        )
        action = None
        if rb is not None:
            action = (
                _action(self.events, rb["ts"]) if isinstance(rb.get("ts"), (int, float)) else None
            )
            if applied:
                ev += [
                    f"rollback applied: {a.get('what')} at step {a.get('step')}"
                    + (f" (lr x{a['lr_factor']})" if a.get("lr_factor") is not None else "")
                    for a in applied[:2]
                ]
        else:
            action = _action(self.events, t1) if t1 is not None else None
            if action and not action.startswith("rolled"):
                action = None
        self.add(
            "numeric",
            f"{'/'.join(monitors)} at step {s0}{f'-{s1}' if s1 != s0 else ''}"
            f"{f' (attempt {attempt})' if attempt else ''}: {first['detail']}"[:200],
            sev,
            ts=t0,
            ts_end=t1,
            attempt=attempt,
            step=s0,
            rank=first["rank"],
            evidence=ev,
            runbook=first["runbook"],
            action=action,
            details={
                "monitors": monitors,
                "findings": len(ep),
                "last_step": s1,
                "context": ctx,
                "rollback": {
                    k: rb.get(k)
                    for k in ("from_step", "to_step", "lr_scale", "skip_batches", "reason")
                    if k in rb
                }
                if rb
                else None,
                "live": any(f["live"] for f in ep),
            },
        )

    def _excluded(self, rank, attempt) -> dict | None:
        """The ``exclude_node`` event the policy recorded for ``rank`` in ``attempt``, if any."""
        return next(
            (
                e
                for e in self.events
                if e.get("kind") == "exclude_node"
                and e.get("rank") == rank
                and _attempt_of(e, self.launches) == attempt
            ),
            None,
        )

    def _straggler(self, ep, attempt) -> None:
        s0, s1, t0, t1, sev = self._span(ep)
        rank = ep[0]["rank"]
        vals = [f["value"] for f in ep if isinstance(f["value"], (int, float))]
        ex = self._excluded(rank, attempt)
        ev = [f["detail"] for f in ep[:3]]
        self.add(
            "straggler",
            f"rank {rank} straggling from step {s0}{f' (attempt {attempt})' if attempt else ''}: "
            f"{ep[0]['detail']}"[:200],
            sev,
            ts=t0,
            ts_end=t1,
            attempt=attempt,
            step=s0,
            rank=rank,
            evidence=ev,
            runbook=ep[0]["runbook"],
            action=(
                f"asked to exclude host {ex.get('host')} (acted: {ex.get('acted', False)})"
                if ex
                else None
            ),
            details={"max_ratio": max(vals, default=None), "last_step": s1, "findings": len(ep)},
        )

    def _sdc(self, ep, attempt) -> None:
        """Silent data corruption: the rank, its node, the kind (at rest / replicas) and whether
        it was a one-off or a bad device, and what the policy did about it."""
        s0, _s1, t0, t1, sev = self._span(ep)
        f = ep[0]
        rank = f["rank"]
        head = str(f["detail"]).split(":", 1)[0].split()  # "at_rest persistent: rank 1 ..."
        kind = head[0] if head else "sdc"
        persistent = any("persistent" in str(x["detail"]).split(":", 1)[0] for x in ep)
        ex = self._excluded(rank, attempt)
        seen = next(  # the live finding's event: the host as the attempt knew it
            (
                e.get("host")
                for e in self.events
                if e.get("kind") == "anomaly"
                and e.get("monitor") == "sdc"
                and e.get("rank") == rank
                and _attempt_of(e, self.launches) == attempt
                and e.get("host")
            ),
            None,
        )
        host = None
        if rank is not None:
            host = (ex or {}).get("host") or seen or self.hosts.get(rank)
        rb = next(
            (
                e
                for e in self.events
                if e.get("kind") == "rollback"
                and e.get("monitor") == "sdc"
                and _attempt_of(e, self.launches) == attempt
            ),
            None,
        )
        failed = next(
            (
                e
                for e in self.events
                if e.get("kind") == "failed" and _attempt_of(e, self.launches) == attempt
            ),
            None,
        )
        action = f"gave up: {failed.get('reason')}" if failed is not None else None
        if rb is not None:
            action = (
                f"rolled back exactly from step {rb.get('from_step')} to checkpoint step "
                f"{rb.get('to_step')} (checkpoints from step {rb.get('from_step')} on set aside)"
            )
        if ex is not None:
            action = f"node {ex.get('host')} struck (acted: {ex.get('acted', False)})" + (
                f"; {action}" if action else ""
            )
        if action is None and kind == "recompute" and not persistent:
            action = "the corrupt gradients were discarded before the optimizer: no rollback"
        who = f"rank {rank}" + (f" on {host}" if host else "") if rank is not None else "a replica"
        self.add(
            "sdc",
            f"silent data corruption ({kind}, {'persistent' if persistent else 'transient'}) on "
            f"{who} at step {s0}{f' (attempt {attempt})' if attempt else ''}"[:200],
            sev,
            ts=t0,
            ts_end=t1,
            attempt=attempt,
            step=s0,
            rank=rank,
            host=host,
            evidence=[x["detail"] for x in ep[:3]],
            runbook=f["runbook"],
            action=action,
            details={
                "kind": kind,
                "persistent": persistent,
                "caught_in_attempts": f["value"],
                "rollback": {k: rb.get(k) for k in ("from_step", "to_step", "to_path")}
                if rb
                else None,
            },
        )

    def _rl(self, ep, attempt) -> None:
        # an episode's all-clear (phase "resolved") ends it; the incident is the warning/escalation
        # before it
        clear = next((f for f in ep if is_all_clear(f)), None)
        body = [f for f in ep if not is_all_clear(f)] or ep
        s0, s1, t0, t1, sev = self._span(body)
        m = body[0]["monitor"]
        tail = f" (all clear at step {clear['step']})" if clear is not None else ""
        self.add(
            "rl",
            f"{m} from step {s0}{f' to {s1}' if s1 != s0 else ''}: {body[-1]['detail']}"[:200]
            + tail,
            sev,
            ts=t0,
            ts_end=clear["ts"] if clear is not None and clear.get("ts") is not None else t1,
            attempt=attempt,
            step=s0,
            rank=body[0]["rank"],
            evidence=[f"step {f['step']}: {f['detail']}" for f in ep[:5]],
            runbook=body[0]["runbook"],
            action=_action(self.events, t0)
            if t0 is not None and any(e.get("kind") == "rollback" for e in self.events)
            else None,
            details={
                "monitor": m,
                "last_step": s1,
                "findings": len(body),
                "episode": body[0].get("episode"),
                "resolved_step": clear["step"] if clear is not None else None,
            },
        )

    def _other(self, ep, attempt) -> None:
        s0, s1, t0, t1, sev = self._span(ep)
        f = ep[0]
        self.add(
            f["family"] or "other",
            f"{f['monitor']}: {f['detail']}"[:200],
            sev,
            ts=t0,
            ts_end=t1,
            attempt=attempt,
            step=s0,
            rank=f["rank"],
            evidence=[x["detail"] for x in ep[:5]],
            runbook=f["runbook"],
        )


def build(
    run_dir: Path,
    events: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    findings: list[dict[str, Any]],
    hosts: dict[int, str],
    runbooks: dict[str, str],
) -> list[dict[str, Any]]:
    """The incidents of a run, in time order, numbered from 1."""
    b = _Builder(Path(run_dir), events, metrics, findings, hosts, runbooks)
    for e in events:
        k = e.get("kind")
        if k == "crash":
            b.crash(e)
        elif k == "hang":
            b.hang(e)
        elif k == "health_check" and e.get("ok") is False:
            b.health(e)
        elif k in ("early_exit", "stopped", "failed"):
            b.end(e)
        elif k in ("checkpoint_invalid", "checkpoint_failed"):
            b.checkpoint(e)
        elif k == "monitor_error":
            b.add(
                "monitor",
                f"monitor {e.get('monitor')} raised: {e.get('error')}"[:200],
                "warning",
                ts=e.get("ts"),
                attempt=_attempt_of(e, b.launches),
                step=e.get("step"),
                evidence=[str(e.get("error"))],
            )
    b.episodes()
    big = float("inf")
    out = sorted(
        b.out,
        key=lambda i: (
            i["ts"] if isinstance(i["ts"], (int, float)) else big,
            i["step"] if isinstance(i["step"], int) else -1,
        ),
    )
    for n, inc in enumerate(out, 1):
        inc["id"] = n
    return out
