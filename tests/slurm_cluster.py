"""The real Slurm cluster of the Slurm tests: 3 slurmd nodes in network namespaces on one machine.

Started once per session (``slurm_cluster`` fixture in conftest.py) by ``scripts/slurm_cluster.sh``;
3 nodes so that a 2-node run with one spare node fits. Under CI a missing Slurm or missing root is a
failure; elsewhere a skip with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import REPO

SCRIPT = REPO / "scripts" / "slurm_cluster.sh"
STATE = Path(os.environ.get("PTOPS_SLURM_DIR", "/tmp/ptops-slurm"))


def _missing(why: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"the Slurm tests cannot run: {why}")
    pytest.skip(why)


@dataclass
class Cluster:
    nodes: int
    env: dict = field(default_factory=dict)

    @classmethod
    def start(cls, nodes: int = 3) -> "Cluster":
        if os.geteuid() != 0:
            _missing("a multi-node Slurm on one machine needs root (network namespaces)")
        for prog in ("slurmctld", "slurmd", "sbatch", "munged", "nsenter", "unshare", "ip"):
            if shutil.which(prog) is None:
                _missing(
                    f"{prog} is not installed (bash scripts/setup.sh installs Slurm from Debian)"
                )
        out = subprocess.run(
            ["bash", str(SCRIPT), "up", "--nodes", str(nodes)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if out.returncode != 0:
            raise AssertionError(f"slurm_cluster.sh up failed:\n{out.stdout}\n{out.stderr}")
        return cls(nodes, {"SLURM_CONF": str(STATE / "slurm.conf")})

    def stop(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "down"], capture_output=True, text=True, timeout=120)

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env},
        )

    def link(self, node: str, up: bool) -> None:
        """Cut (or restore) a node's network, as a failed NIC or switch port: its veth on the
        bridge."""
        subprocess.run(["ip", "link", "set", f"pv-{node}", "up" if up else "down"], check=True)

    def unreachable(self, node: str, to: str, cut: bool = True) -> None:
        """``node`` loses its route to ``to`` (an unreachable route in its namespace: a bad route
        or NIC on one path), or gets it back; the rest of its network, the controller included,
        still works."""
        addr = f"10.77.0.{10 + int(to.lstrip('n'))}/32"
        subprocess.run(
            ["ip", "-n", f"ptops-{node}", "route", "add" if cut else "del", "unreachable", addr],
            check=cut, capture_output=True,
        )  # fmt: skip

    def mount_tmpfs(self, node: str, path: Path, size: str) -> None:
        """A small tmpfs over ``path`` in ``node``'s mount namespace only (its slurmd's, which every
        step on the node inherits): that node alone sees a nearly full filesystem there."""
        pid = (STATE / f"node-{node}.pid").read_text().strip()
        subprocess.run(
            ["nsenter", "--target", pid, "--mount", "--", "mount", "-t", "tmpfs", "-o",
             f"size={size}", "ptops-test", str(path)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip

    def umount(self, node: str, path: Path) -> None:
        pid = (STATE / f"node-{node}.pid").read_text().strip()
        subprocess.run(["nsenter", "--target", pid, "--mount", "--", "umount", str(path)])

    def resume(self, node: str) -> None:
        """Return a node that Slurm marked down to service."""
        self.run("scontrol", "update", f"NodeName={node}", "State=RESUME")
