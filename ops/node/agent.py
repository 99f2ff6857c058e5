"""The node agent: one per node and attempt (``srun --ntasks-per-node=1 python -m
ptops.ops.node.agent``).

Why it exists: the supervisor runs on one node; the ranks of the other nodes must still reach it,
be stopped with it, and have their stacks read where they live. The agent, per node:

1. connects ONE token-authenticated connection to the supervisor (``role: "node"``, wire format
   in :mod:`ptops.ops.rank.channel`);
2. listens on loopback with its own token and starts this node's ranks with torchrun
   (``--nnodes N --node-rank I``, static rendezvous at the attempt's first node: the rank -> node
   mapping is fixed, so "rank 1" is always on the second node and blame by rank names a node;
   torchrun also gives the ranks the environment the engines already expect);
3. relays its ranks' lines upstream in batches of a few ms (``b`` frames: one parse and one queue
   entry on the supervisor for many lines, a step's records as differences from the first) and
   every command downstream (with ``[supervisor] node_summaries``, a node's routine ranks
   between samples as one summary: ``Batcher``); its ranks' liveness ``ping`` lines it sums up
   in one ``a`` frame a second for the node (which ranks sent anything, how long ago); the wire
   format is in ``ops/rank/channel.py``;
4. at a hang gathers its ranks' stacks into one reply (``dump``: each rank's own dump, py-spy for
   a rank that does not answer: ptrace does not cross hosts); the supervisor writes one file a node;
5. kills its ranks when the supervisor goes away: EOF, or no keepalive for
   ``PTOPS_NODE_UPSTREAM_TIMEOUT_S`` (a cut link gives no EOF), or ``{"cmd": "kill"}``;
   and when the agent itself dies, the kernel kills torchrun (``PR_SET_PDEATHSIG``), whose
   ranks die with it the same way (``ops/rank/entry.py``). No orphan on any node.

A local run is a one-node run through the same agent (so the code every laptop run tests is the
code that runs at 16k nodes): the supervisor starts it directly with the launcher it chose
(torchrun, or ``warmlaunch`` on a warm restart) in ``PTOPS_NODE_ARGV`` and that launcher's log in
``PTOPS_NODE_LOG``; the agent then exits as the launcher did (its code, or its signal) and lets a
SIGTERM reach the launcher instead of dying first (the ranks' graceful stop).

Environment (set by the supervisor's Slurm attempt, ``ops/slurm/inside.py``): ``PTOPS_CHANNEL``,
``PTOPS_CHANNEL_TOKEN`` (upstream), ``PTOPS_NODE_NPROC``, ``PTOPS_NODE_MASTER``,
``PTOPS_NODE_PORT``, ``PTOPS_NODE_NNODES``; node rank from ``SLURM_NODEID`` (one task per node);
``PTOPS_RELAYS`` with ``[slurm] relay_every``: the first node of each group also runs the group's
relay (``ops/node/relay.py``, a thread of its agent, kept until the group's other agents are gone)
and every agent of the group connects to it instead of the supervisor.
Local (``ops/supervisor/attempt.py``): ``PTOPS_NODE_ARGV`` (JSON list), ``PTOPS_NODE_LOG``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from ptops import envnames
from ptops.ops.rank import RANK_PYTHON
from ptops.ops.rank.channel import (
    ALIVE_S,
    ENV_ADDRESS,
    ENV_TOKEN,
    KEEPALIVE,
    KEEPALIVE_S,
    MAX_LINE,
    PING_PREFIX,
    RELAY,
    RELAY_GONE,
    ROLE_NODE,
    STEP_PREFIXES,
    SUMMARY_ENV,
    Batcher,
    ChannelClient,
    alive_frame,
    encode,
    new_token,
    relay_group,
    summary_settings,
    take_lines,
)
from ptops.ops.supervisor import procs, stacks

STACKS_PREFIX = b'{"t":"stacks"'  # a rank's answer to ``stacks``, as ``encode`` writes it


def log(msg: str) -> None:
    sys.stderr.write(f"[ptops.node {socket.gethostname()}] {msg}\n")
    sys.stderr.flush()


class Agent:
    def __init__(self, env: dict[str, str]):
        self.env = env
        self.node = socket.gethostname()
        self.launcher = _launcher_argv(
            env.get(envnames.NODE_ARGV)
        )  # None: Slurm's torchrun, built here
        # local: one node whatever the environment (a run started inside an allocation)
        node_id = None if self.launcher is not None else env.get("SLURM_NODEID")
        self.node_rank = int(node_id or env.get(envnames.NODE_RANK) or 0)
        self.nnodes = int(env.get(envnames.NODE_NNODES) or env.get("SLURM_NNODES") or 1)
        self.attempt = int(env.get(envnames.ATTEMPT) or 0)
        self.upstream_timeout = float(env.get(envnames.NODE_UPSTREAM_TIMEOUT_S) or 10.0)
        self.local_token = new_token()
        self.proc: subprocess.Popen | None = None
        self.last_upstream = time.monotonic()
        self.done = threading.Event()
        self.why = ""
        self._conns: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._heard: dict[int, float] = {}  # cid -> its last line (monotonic), since the last a
        self._stepped: set[int] = set()  # cids with a beat or record relayed since the last a
        self._dumping: set[int] = set()  # connections asked for their stacks (``_dump``)
        self._dumps: dict[int, dict] = {}  # ... and their answers
        self._next = 0
        # local listener first: its address goes into the ranks' environment
        self._listen = socket.socket()
        self._listen.bind(("127.0.0.1", 0))
        self._listen.listen(256)
        self._listen.setblocking(False)
        # ``[slurm] relay_every``: the group's first node relays it; its agents go through it and
        # leave the summing-up to it (over all the group's ranks)
        upstream, self.relay = env[ENV_ADDRESS], None
        self.summary = summary_settings(env.get(SUMMARY_ENV))
        group = (
            relay_group(env.get(envnames.RELAYS), self.node_rank) if self.launcher is None else None
        )
        if group is not None:
            head, port, hosts = group
            if hosts:
                from ptops.ops.node.relay import Relay

                self.relay = Relay(
                    {**env, envnames.RELAY_LISTEN: f"0.0.0.0:{port}"}, name=self.node
                )
                threading.Thread(target=self.relay.loop, name="ptops-relay", daemon=True).start()
                log(f"relaying the agents of {head}'s group on port {port}")
            upstream, self.summary = f"{head}:{port}", (1, None)
        self.up = ChannelClient(
            upstream,
            env[ENV_TOKEN],
            {
                "role": ROLE_NODE,
                "node": self.node,
                "node_rank": self.node_rank,
                "pid": os.getpid(),
                "host": self.node,
                "attempt": self.attempt,
            },
            on_message=self._from_supervisor,
            on_eof=lambda: self.stop("the supervisor's connection closed"),
            connect_timeout=30.0,
        )

    @property
    def local_address(self) -> str:
        """Where this node's ranks connect (with ``local_token``)."""
        return f"127.0.0.1:{self._listen.getsockname()[1]}"

    # ------------------------------------------------------------ ranks
    def start_ranks(self) -> None:
        nproc = self.env.get(envnames.NODE_NPROC, "1")
        argv = self.launcher or [
            sys.executable, "-P", "-m", "torch.distributed.run",
            "--nnodes", str(self.nnodes),
            "--node-rank", str(self.node_rank),
            "--nproc-per-node", nproc,
            "--master-addr", self.env[envnames.NODE_MASTER],
            "--master-port", self.env[envnames.NODE_PORT],
            "--max-restarts", "0",
            "--monitor-interval", "0.5",
            "--no-python", *RANK_PYTHON,  # -P: a ``ptops`` folder in the cwd shadows nothing
        ]  # fmt: skip
        env = dict(self.env)
        env[ENV_ADDRESS] = self.local_address
        env[ENV_TOKEN] = self.local_token
        env[envnames.PTRACER_PID] = str(os.getpid())  # the agent runs py-spy here (PR_SET_PTRACER)
        env[envnames.NODE] = self.node
        log_dir = self.env.get(envnames.NODE_LOG_DIR)
        path = os.path.join(log_dir, f"torchrun-{self.node}.log") if log_dir else os.devnull
        from pathlib import Path

        self.proc = procs.spawn(argv, env, Path(self.env.get(envnames.NODE_LOG) or path))
        if self.launcher is not None:
            log(f"local node: launcher pid {self.proc.pid} ({nproc} rank(s)): {argv[2]}")
            return
        log(
            f"node rank {self.node_rank}/{self.nnodes}: torchrun pid {self.proc.pid} ({nproc} "
            "rank(s)), "
            f"rendezvous {self.env[envnames.NODE_MASTER]}:{self.env[envnames.NODE_PORT]}"
        )

    def _on_term(self, signum: int, _frame: Any) -> None:
        """Local: a graceful stop (the supervisor's teardown) is the launcher's to carry out; dying
        here first would SIGKILL it (``PR_SET_PDEATHSIG``) before the ranks could stop."""
        if self.proc is not None and self.proc.poll() is None:
            procs.killpg(self.proc.pid, signum)

    def kill_ranks(self) -> None:
        if self.proc is None:
            return
        pids = procs.descendants(self.proc.pid)
        procs.killpg(self.proc.pid, signal.SIGKILL)
        procs.signal_all(pids, signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, why: str) -> None:
        if not self.done.is_set():
            self.why = why
            self.done.set()

    # ------------------------------------------------------------ upstream
    def _from_supervisor(self, msg: dict[str, Any]) -> None:
        self.last_upstream = time.monotonic()
        t, cmd = msg.get("t"), msg.get("cmd")
        if t == RELAY:
            conn = self._conns.get(int(msg.get("c", -1)))
            if conn is not None and isinstance(msg.get("m"), dict):
                try:
                    with self._lock:
                        conn.sendall(encode(msg["m"]))
                except OSError:
                    pass
        elif t == KEEPALIVE:
            pass
        elif cmd == "dump":
            threading.Thread(target=self._dump, args=(msg,), daemon=True).start()
        elif cmd == "kill":
            self.stop("the supervisor asked")

    def _dump(self, msg: dict[str, Any]) -> None:
        """Every rank of the node's stacks at a hang, in ONE ``node_stacks`` reply (the supervisor
        writes one file a node): each rank asked for its own dump over its connection (``ask``),
        py-spy on the ranks that do not answer within ``timeout_s`` or were not asked (not even
        pinging). Why here: at thousands of nodes the supervisor asked and waited for every rank
        and wrote a file each (18.9 s at 8,192 ranks); the node's ranks are next to its agent."""
        want: dict[str, dict] = {}
        for r, v in (msg.get("ranks") or {}).items():
            try:
                want[str(int(r))] = {"c": int(v["c"]), "pid": int(v["pid"]), "ask": bool(v["ask"])}
            except (KeyError, TypeError, ValueError):
                continue
        timeout = min(max(float(msg.get("timeout_s") or 5.0), 0.0), 120.0)
        asked = {v["c"]: r for r, v in want.items() if v["ask"] and v["c"] in self._conns}
        with self._lock:
            self._dumps = {}
            self._dumping = set(asked)
        for c, r in asked.items():
            conn = self._conns.get(c)
            try:
                with self._lock:
                    conn.sendall(encode({"cmd": "stacks", "id": int(r)}))
            except (OSError, AttributeError):
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(self._dumps) < len(asked):
            time.sleep(0.05)
        with self._lock:
            got, self._dumps, self._dumping = self._dumps, {}, set()
        out: dict[str, dict] = {}
        spy = []
        for r, v in want.items():
            reply = got.get(v["c"])
            if reply is not None:
                out[r] = {"text": str(reply.get("text") or ""), "note": "channel", "pid": v["pid"]}
                if reply.get("flight_recorder_b64"):
                    out[r]["flight_recorder_b64"] = reply["flight_recorder_b64"]
            else:
                spy.append(r)
        with ThreadPoolExecutor(max_workers=8) as pool:  # py-spy takes ~1 s a process
            for r, (text, note) in zip(
                spy, pool.map(lambda r: stacks.with_py_spy(want[r]["pid"]), spy)
            ):
                out[r] = {"text": text, "note": note, "pid": want[r]["pid"]}
        self.up.send({"t": "node_stacks", "id": msg.get("id"), "stacks": out})

    def _dumped(self, cid: int, raw: bytes) -> bool:
        """A rank's answer to the dump under way (kept for the node's reply, not relayed)."""
        try:
            reply = json.loads(raw)
        except ValueError:
            return False
        if not isinstance(reply, dict) or reply.get("t") != "stacks":
            return False
        with self._lock:
            if cid not in self._dumping:
                return False
            self._dumps[cid] = reply
        return True

    # ------------------------------------------------------------ local relay (thread)
    def relay_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listen, selectors.EVENT_READ, None)
        bufs: dict[int, bytearray] = {}
        authed: set[int] = set()

        batch = Batcher(*self.summary)

        def flush() -> None:
            frame = batch.frame()
            if frame is not None and not self.up.send_raw(frame):
                self.stop("the supervisor's connection broke")

        def drop(cid: int, conn: socket.socket) -> None:
            try:
                sel.unregister(conn)
            except (KeyError, ValueError):
                pass
            conn.close()
            self._conns.pop(cid, None)
            bufs.pop(cid, None)
            if cid in authed:
                authed.discard(cid)
                flush()  # its last lines before the word that it is gone
                self.up.send({"t": RELAY_GONE, "c": cid})

        while not self.done.is_set():
            if batch.due(time.monotonic()):
                flush()
            for key, _ in sel.select(timeout=batch.wait_s(time.monotonic(), 0.5)):
                if key.data is None:
                    try:
                        conn, _ = self._listen.accept()
                    except OSError:
                        continue
                    conn.setblocking(True)
                    self._next += 1
                    bufs[self._next] = bytearray()
                    sel.register(conn, selectors.EVENT_READ, (self._next, conn))
                    continue
                cid, conn = key.data
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                if not data or len(bufs[cid]) > MAX_LINE:
                    drop(cid, conn)
                    continue
                buf = bufs[cid]
                buf += data
                for raw in take_lines(buf):
                    if cid in authed:
                        with self._lock:
                            self._heard[cid] = time.monotonic()
                        if raw.startswith(PING_PREFIX):
                            continue  # liveness only: in the node's next ``a`` frame
                        if self._dumping and raw.startswith(STACKS_PREFIX):
                            if self._dumped(cid, raw):  # for the node's one reply
                                continue
                        if batch.add(cid, raw, time.monotonic()) and raw.startswith(STEP_PREFIXES):
                            with self._lock:
                                self._stepped.add(cid)
                        continue
                    try:
                        hello = json.loads(raw)
                    except json.JSONDecodeError:
                        hello = None
                    tok = str((hello or {}).get("token", "")) if isinstance(hello, dict) else ""
                    if (
                        not isinstance(hello, dict)
                        or hello.get("t") != "hello"
                        or not hmac.compare_digest(tok.encode(), self.local_token.encode())
                    ):
                        drop(cid, conn)
                        break
                    hello.pop("token", None)
                    hello["node"] = self.node
                    authed.add(cid)
                    self._conns[cid] = conn
                    flush()
                    self.up.send({"t": RELAY, "c": cid, "m": hello})
        flush()

    def alive_frame(self) -> dict[str, Any] | None:
        """The node's liveness since the previous frame: the rank connections that sent a line,
        and that line's age in ms (None when none did), but those whose beat or step record went
        up since (the supervisor counted it as a sign of life: at 1 s steps the frame is empty)."""
        now = time.monotonic()
        with self._lock:
            heard, self._heard = self._heard, {}
            stepped, self._stepped = self._stepped, set()
            return alive_frame(heard, stepped, self._conns, now)

    # ------------------------------------------------------------ main
    def run(self) -> int:
        threading.Thread(target=self.relay_loop, name="ptops-node-relay", daemon=True).start()
        self.start_ranks()
        rc: int | None = None
        next_ka = next_alive = 0.0
        while not self.done.is_set():
            if (
                time.monotonic() >= next_ka
            ):  # the supervisor tells a cut link from a quiet node by these
                next_ka = time.monotonic() + KEEPALIVE_S
                self.up.send({"t": KEEPALIVE})
            if time.monotonic() >= next_alive:
                next_alive = time.monotonic() + ALIVE_S
                frame = self.alive_frame()
                if frame is not None:
                    self.up.send(frame)
            rc = self.proc.poll()
            if rc is not None:
                self.stop(f"torchrun exited {rc}")
                break
            if time.monotonic() - self.last_upstream > self.upstream_timeout:
                self.stop(f"no word from the supervisor for {self.upstream_timeout:g} s")
                break
            self.done.wait(0.2)
        if rc is None:
            log(f"killing this node's ranks: {self.why}")
            self.kill_ranks()
            rc = self.proc.returncode if self.proc.returncode is not None else 137
        else:
            time.sleep(0.3)  # the relay thread forwards the ranks' goodbyes first
        self.up.send({"t": "node_exit", "code": rc})
        self.up.close()
        if self.relay is not None:  # the group's other agents still go through it
            self.relay.serve_out()
        log(f"done ({self.why})")
        if self.launcher is not None:
            return rc  # the supervisor reads the launcher's own status (blame.root_cause)
        return 0 if rc == 0 else 1


@contextlib.contextmanager
def relay_in_thread(address: str, token: str) -> Iterator[Agent]:
    """An agent relaying in this process, with no launcher: tests and benches connect their own
    ranks (``Probe``, ``ChannelClient``) to ``agent.local_address`` with ``agent.local_token``,
    as torchrun's ranks do; the supervisor accepts no rank any other way."""
    agent = Agent({ENV_ADDRESS: address, ENV_TOKEN: token, envnames.NODE_RANK: "0"})
    thread = threading.Thread(target=agent.relay_loop, name="ptops-node-relay", daemon=True)
    thread.start()
    try:
        yield agent
    finally:
        agent.stop("over")
        agent.up.close()
        thread.join(timeout=3)
        for conn in list(agent._conns.values()):  # what the agent's exit does to its ranks
            try:
                conn.close()
            except OSError:
                pass
        agent._listen.close()


def _launcher_argv(raw: str | None) -> list[str] | None:
    if not raw:
        return None
    argv = json.loads(raw)
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ValueError(f"{envnames.NODE_ARGV}: expected a JSON list of strings, got {raw[:80]!r}")
    return argv


def _exit_as(rc: int) -> None:
    """Exit with the launcher's status: its code, or death by its signal."""
    if rc < 0:
        if -rc != signal.SIGKILL:  # its disposition cannot be set (nor needs to be)
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
        time.sleep(1)  # a signal whose default is not to die (none torchrun dies of): exit below
    sys.exit(rc if rc >= 0 else 128 - rc)


def main() -> None:
    procs.die_with_parent()  # srun's task (slurmstepd) gone -> this agent gone -> torchrun gone
    try:
        agent = Agent(dict(os.environ))
    except (ConnectionError, ValueError) as e:
        log(str(e))
        sys.exit(1)
    if agent.launcher is not None:
        signal.signal(signal.SIGTERM, agent._on_term)
    _exit_as(agent.run())


if __name__ == "__main__":
    main()
