"""Ctrl-C / SIGTERM: ask the ranks to checkpoint (if their engine can), then stop everything.

Why a part of its own: stopping is the one path that must work when everything else is
on fire; a second signal cuts every wait short.

Used as a mixin of :class:`ptops.ops.supervisor.core.Supervisor`.
"""

from __future__ import annotations

import signal
import time

from ptops.ops.runrecord.events import RunState
from ptops.ops.supervisor import launcher, procs


class StopMixin:
    def _on_signal(self, signum, _frame) -> None:
        self._signals += 1
        if self.stop_signal is None:
            self.stop_signal = signum

    def graceful_stop(self) -> None:
        """Ctrl-C / SIGTERM: ask ranks to save (if they can), then stop everything."""
        self.transition(RunState.STOPPING, "stop_signal")
        self.write_status(force=True)
        name = signal.Signals(self.stop_signal).name
        live = [i for i in self.ranks.values() if i.peer is not None and i.gone_ts is None]
        for info in live:
            self.server.send(
                info.peer, {"cmd": "stop", "reason": name, **getattr(self, "stop_extra", {})}
            )
        deadline = time.monotonic() + min(2.0, self.cfg.grace_s)
        while time.monotonic() < deadline and len(self.stop_acks) < len(live) and self._signals < 2:
            self.pump(0.1, drain=True)
        supported = bool(self.stop_acks) and all(
            a.get("supported") for a in self.stop_acks.values()
        )
        if supported and self.cfg.grace_s > 0:
            self.say(
                f"{name}: asking the ranks to checkpoint (up to {self.cfg.grace_s:g} s; again to "
                "stop now)"
            )
            deadline = time.monotonic() + self.cfg.grace_s
            while time.monotonic() < deadline and self.proc.poll() is None and self._signals < 2:
                self.pump(0.1, drain=True)
        else:
            self.say(
                f"{name}: the engine cannot checkpoint on request; stopping (last good "
                f"checkpoint: {(self.good or {}).get('step', 'none')})"
            )
        procs.teardown(
            self.proc, self.run.path, self._rank_pids(), grace_s=min(self.cfg.kill_timeout_s, 5.0)
        )
        self.pump(0.2, drain=True)
        self.step = max(self.step, launcher.completed_step(self.run))
