"""`ptops launch --slurm --dry-run` (no cluster needed) and the node relay on loopback (no
Slurm)."""

from __future__ import annotations

import json
import socket
import time

from conftest import run_ptops

from ptops.ops.rank.channel import ChannelClient, new_token
from ptops.ops.supervisor.channel import ChannelServer


def test_dry_run_4_nodes_x_8_gpus_has_the_directives_that_matter(tmp_path):
    out = run_ptops(
        "launch",
        "titan-tiny",
        "--supervise",
        "--slurm",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--spare-nodes",
        "1",
        "--time",
        "04:00:00",
        "--partition",
        "gpu",
        "--account",
        "proj",
        "--qos",
        "high",
        "--set",
        'slurm.exclude=["bad7"]',
        "--set",
        "slurm.signal_s=300",
        "--run-dir",
        str(tmp_path / "run"),
        "--dry-run",
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    directives = {
        ln.split()[1].split("=")[0]: ln.split()[1] for ln in lines if ln.startswith("#SBATCH ")
    }
    assert directives["--nodes"] == "--nodes=5"  # 4 + 1 spare
    assert directives["--ntasks-per-node"] == "--ntasks-per-node=1"  # one node agent per node
    assert directives["--gpus-per-node"] == "--gpus-per-node=8"
    assert directives["--signal"] == "--signal=B:USR1@300"
    assert "--requeue" in directives and "--open-mode" in directives
    assert directives["--open-mode"] == "--open-mode=append"
    assert directives["--exclude"] == "--exclude=bad7"
    assert (
        directives["--time"] == "--time=04:00:00" and directives["--partition"] == "--partition=gpu"
    )
    assert directives["--account"] == "--account=proj" and directives["--qos"] == "--qos=high"
    # the supervisor is exec'd: the batch shell's USR1 reaches it
    assert any(ln.startswith("exec ") and "ptops.ops.slurm.inside" in ln for ln in lines)
    assert not (tmp_path / "run").exists()  # a dry run writes nothing

    js = run_ptops(
        "launch",
        "titan-tiny",
        "--supervise",
        "--slurm",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--run-dir",
        str(tmp_path / "run"),
        "--dry-run",
        "--json",
    )
    assert js.returncode == 0, js.stderr
    assert json.loads(js.stdout)["world_size"] == 32


def test_slurm_needs_supervise(tmp_path):
    out = run_ptops(
        "launch", "titan-tiny", "--slurm", "--run-dir", str(tmp_path / "r"), "--dry-run"
    )
    assert out.returncode == 2 and "error:" in out.stderr and "--supervise" in out.stderr


def test_no_gpu_request_without_gpus(tmp_path):
    out = run_ptops(
        "launch",
        "titan-tiny",
        "--supervise",
        "--slurm",
        "--nodes",
        "2",
        "--run-dir",
        str(tmp_path / "r"),
        "--dry-run",
    )
    assert out.returncode == 0, out.stderr
    assert "--gpus-per-node" not in out.stdout and "#SBATCH --nodes=2" in out.stdout
    assert "--exclude" not in out.stdout


def _recv_line(sock: socket.socket, timeout: float = 5.0) -> dict:
    sock.settimeout(timeout)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        assert chunk, "connection closed"
        buf += chunk
    return json.loads(buf.splitlines()[0])


def test_relay_frames_become_the_same_per_rank_messages():
    """One node connection carrying two ranks: the supervisor's inbox sees each rank as if it were
    connected directly (hello, messages, EOF), and a command to a rank goes back wrapped for the
    agent."""
    server = ChannelServer()
    try:
        node = ChannelClient(
            server.address(), server.token, {"role": "node", "node": "n2", "attempt": 1}
        )
        raw = node.sock
        for c, rank in ((1, 2), (2, 3)):
            node.send(
                {
                    "t": "r",
                    "c": c,
                    "m": {
                        "t": "hello",
                        "role": "rank",
                        "rank": rank,
                        "pid": 100 + rank,
                        "host": "n2",
                        "attempt": 1,
                    },
                }
            )
        node.send({"t": "r", "c": 2, "m": {"t": "beat", "step": 7}})
        node.send({"t": "g", "c": 1})
        got = []
        deadline = time.monotonic() + 5
        while len(got) < 5 and time.monotonic() < deadline:
            peer, msg, _ = server.inbox.get(timeout=5)
            got.append((peer.role, peer.rank, msg["t"], peer))
        kinds = [(role, rank, t) for role, rank, t, _ in got]
        assert kinds == [
            ("node", None, "_hello"),
            ("rank", 2, "_hello"),
            ("rank", 3, "_hello"),
            ("rank", 3, "beat"),
            ("rank", 2, "_eof"),
        ], kinds
        rank3 = got[2][3]
        assert rank3.hello["node"] == "n2" and rank3.via is got[0][3]
        assert server.send(rank3, {"cmd": "stacks", "id": 3})
        frame = _recv_line(raw)
        while frame.get("t") == "ka":  # keepalives may come first
            frame = _recv_line(raw)
        assert frame == {"t": "r", "c": 2, "m": {"cmd": "stacks", "id": 3}}
        node.close()
        peer, msg, _ = server.inbox.get(timeout=5)
        assert (peer.rank, msg["t"]) == (3, "_eof")  # the node's remaining ranks go with it
        peer, msg, _ = server.inbox.get(timeout=5)
        assert (peer.role, msg["t"]) == ("node", "_eof")
    finally:
        server.close()


def test_relay_refuses_a_wrong_token():
    server = ChannelServer()
    try:
        bad = ChannelClient(
            server.address(), new_token(), {"role": "node", "node": "evil", "attempt": 1}
        )
        bad.send({"t": "r", "c": 1, "m": {"t": "hello", "role": "rank", "rank": 0, "attempt": 1}})
        time.sleep(0.3)
        assert server.inbox.empty()
        bad.close()
    finally:
        server.close()
