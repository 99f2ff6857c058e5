"""Does a rank keep pinging through long calls? The largest gap between its channel messages.

    .venv/bin/python bench/ping_gaps.py

A rank (a subprocess with a real probe, heartbeat 1 s) runs 6 s of torch matmuls, a ``torch.save``
of a 400 MB tensor, then builds and sorts a 30M-element list (one C call that holds the GIL); the
receiving side (its agent's listener) records the longest silence in each. The liveness rule
(`ping_stale_s`, default 4 s, never below the step budget) must not fire on the first two.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CODE = """
import os, sys, time, torch
from ptops.ops.rank.probe import Probe
tmp, addr, token = sys.argv[1:4]
p = Probe(tmp, 0, 1, channel=addr, token=token, heartbeat_s=1.0)
p.phase('matmul', 1)
a = torch.randn(2000, 2000); t = time.monotonic()
while time.monotonic() - t < 6: a @ a
p.phase('torch.save 400 MB', 1)
torch.save(torch.randn(100_000_000), os.path.join(tmp, 'big.pt')); os.remove(os.path.join(tmp, 'big.pt'))
p.phase('GIL-holding C call', 1)
sorted(list(range(30_000_000, 0, -1)))
p.phase('end', 1)
p.close()
"""  # noqa: E501


def _lines(listen: socket.socket):
    """The rank's lines as they arrive, stamped (a rank's channel is its node agent's loopback
    listener; what matters here is when the rank sends, so a plain listener stands in for it)."""
    conn, _ = listen.accept()
    buf = b""
    while True:
        data = conn.recv(65536)
        if not data:
            return
        ts, buf = time.monotonic(), buf + data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield json.loads(line), ts


def main() -> int:
    listen = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{listen.getsockname()[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, "-c", CODE, tmp, addr, "token"], cwd=REPO)
        last, gaps, phase = None, {}, "start"
        for msg, ts in _lines(listen):
            if msg.get("t") == "beat":
                if last is not None:
                    gaps[phase] = max(gaps.get(phase, 0.0), ts - last)
                phase, last = msg.get("phase"), ts
            elif msg.get("t") == "ping":
                if last is not None:
                    gaps[phase] = max(gaps.get(phase, 0.0), ts - last)
                last = ts
            if msg.get("t") == "exit":
                break
        proc.wait()
    listen.close()
    out = {k: round(v, 2) for k, v in gaps.items() if k not in ("start", "end")}
    print(json.dumps({"largest_gap_s": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
