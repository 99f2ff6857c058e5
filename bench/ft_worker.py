"""The worker NVIDIA's ft_launcher runs in bench/goodput_soak.py: the ptops rank entry plus ft
heartbeats.

ft_launcher detects a hung rank only through heartbeats the training loop sends
(``RankMonitorClient().init_workload_monitoring()`` once, ``send_heartbeat()`` per step). A user of
nvidia-resiliency-ext adds those two calls to their loop; here the loop is the engine adapter's, so
this bench-side wrapper (no product code changed) connects the client, wraps the probe's per-step
hook (``Probe.before_step``, called at the start of every optimizer step) to send the heartbeat
first, and then runs the same entry the ranks always run (``python -m ptops.ops.rank.entry``). Run
by ft_launcher only (it sets the rank monitor's socket in the environment); needs bench/.nvrx on
PYTHONPATH (see bench/README.md).
"""

from __future__ import annotations

from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

from ptops.ops.rank import entry, probe

client = RankMonitorClient()
client.init_workload_monitoring()  # the initial heartbeat timeout runs from here to the first step
_before_step = probe.Probe.before_step


def before_step(self: probe.Probe, step: int) -> None:
    # before the fault hooks: a rank hung at this step has sent its last beat
    client.send_heartbeat()
    _before_step(self, step)


probe.Probe.before_step = before_step  # type: ignore[method-assign]

if __name__ == "__main__":
    entry.main()
