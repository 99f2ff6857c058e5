"""Scale load test: simulated node agents on loopback against the real supervisor.

    .venv/bin/python bench/scale_load.py \\
        --sizes 64,1024,8192 [--per-node 8] [--steady 30] [--gen-procs 2]

Real (unchanged ptops code, in this process): :class:`ptops.ops.supervisor.core.Supervisor` -
``run_all`` (run lock, status, events), one attempt (``attempt.py``'s watch loop), the channel
server (``ops/supervisor/channel.py``: selector thread, token check, node relay frames turned into
virtual rank peers), every message handler (``messages.py``), the hang monitor and the metric
monitors of the ``titan-tiny`` recipe's ``[monitors]`` defaults (``monitorfeed.py``),
``metrics.jsonl``, ``events.jsonl`` and ``status.json`` in a real run directory, stack collection at
the hang (``hangs.py``: ``dump`` to every node agent, which gathers its ranks' stacks, one file a
node) and the teardown.

Simulated: the attempt's process. ``attempt_command`` (the launch backend's hook, as Slurm fills it)
starts this file's ``generate`` mode instead of torchrun/srun: ``--gen-procs`` processes of asyncio
simulated node agents, each node ONE token-authenticated ``role: "node"`` connection carrying its
ranks' lines in batch frames made by the agent's own ``ops/rank/channel.py::Batcher`` (``--relay
batch``, the default: a node's lines of one tick in one frame, step records as differences;
``line``: a relay frame a line, ``relay_frame``, the design before issue 24; ``both``: side by
side), as ``ops/node/agent.py`` sends them. Each simulated rank sends its hello, the start-up beats
(import, rendezvous, build, load) and ``world``, then per step a ``begin`` beat and a ``metrics``
record (the keys of a real titan record), ``--step-s`` (1 s) a step in lockstep (data-parallel ranks
finish a step together), and a liveness ``ping`` every ``--ping-s`` (the probe's default heartbeat,
1 s) half a second out of phase with the steps (``--liveness node``, the default: as the agent does
since issue 24, each node sends one ``a`` frame for its ranks' pings instead; ``rank``: every ping
relayed, the design before; ``both``: each size run both ways, side by side); each node sends its
keepalive every 2 s and answers ``dump``. After ``--victim-step`` one rank goes
silent (no steps, no pings: SIGSTOPped), or with ``--silent node`` its whole node (a frozen host or
a cut link: nothing from its agent any more, no keepalive, no liveness frame, no answer to
``dump``, the connection left open); the others go on stepping (``--peers continue``, the load
stays on while the hang is detected) or stop stepping and keep pinging (``--peers block``, as ranks
waiting in a collective). With ``--set supervisor.node_summaries=true`` (and node lines, K > 1) the
simulated agents sum up their routine ranks between samples, as the supervisor's environment tells
them (``PTOPS_NODE_SUMMARY``: the agent's own ``Batcher``).

``--relay-tier N``: a real relay process (``ops/node/relay.py``) per N simulated nodes, between
their agents and the supervisor; it sums up, its agents do not. At 131,072 ranks that is 256
relays, ~8 cores: in production each runs on its own node, here they do not fit beside the
supervisor. ``--template`` (the load of 131,072 ranks from a fraction of a core): the generators
make one frame a tick for every node agent but those of rank 0 and the victim, of stand-in ranks
with the agent's own ``Batcher``, and put each node's ranks in (``_Template``). With both, only the
relays of rank 0's and the victim's groups are real processes, their simulated agents behind
them; every other group is a templated relay: ONE connection of the generator straight to the
supervisor that sends the bytes the real relay sends: its hello, its ranks' hellos under its
numbers, the start-up burst, then a tick's ONE frame, made once a tick for all templated relays
by the relay's own code (``relay.py::rebatch`` into its ``Batcher``, summing up) from its
agents' frames of stand-in ranks, each group's ranks put in (tests/supervisor/
test_scale_load.py); its liveness frame and keepalive, its agents' answers to ``dump``. So the
supervisor is real and sees every relay link (256 at 131,072 ranks); the relays of rank 0 and
the victim (2) are real processes (``relays_cpu_pct`` is theirs; ``relays_real``,
``relay_templated``); the others' bytes are the relay's code's, made once a tick, not a relay's.

One size per process (CPU and RSS are this process's): ``--sizes`` runs each size in a child of this
file and merges the results into ``bench/results/scale_load.json``.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import cProfile
import gc
import json
import os
import pstats
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ptops import envnames

REPO = Path(__file__).resolve().parent.parent
CLK = os.sysconf("SC_CLK_TCK")
STACK_TEXT = "".join(  # ~2 KB, the size of a rank's own dump of a few threads (its format)
    f'Thread 0x7f00000{i:03d} "{"MainThread" if i == 0 else f"Thread-{i}"}" (most recent call '
    f'last):\n  File "/opt/train/step.py", line {100 + i}, in step\n'
    f'  File "/opt/torch/distributed/c10d.py", line {2000 + i}, in all_reduce\n'
    for i in range(16)
)
# the keys of a real titan-tiny metrics record (measured: 705 bytes a line in metrics.jsonl)
_TITAN_KEYS = (
    "max_loss",
    "titan_tps",
    "tflops",
    "time_metrics_end_to_end_s",
    "time_metrics_data_loading_s",
    "time_metrics_data_loading_pct",
    "memory_max_active_gib",
    "memory_max_active_pct",
    "memory_max_reserved_gib",
    "memory_max_reserved_pct",
    "memory_num_alloc_retries",
    "memory_num_ooms",
    "mfu",
    "n_tokens_seen",
)


_GLOBAL = {"max_loss", "memory_num_alloc_retries", "memory_num_ooms", "n_tokens_seen"}


# ================================================================ the load generator (simulated
# node agents)


class _Node:
    """A simulated node agent's link to the supervisor or its relay, or (``relay``) a templated
    relay's link to the supervisor: ``index`` then the group's, ``ranks`` the group's."""

    def __init__(self, index: int, ranks: list[int], relay: bool = False):
        self.index = index
        self.ranks = ranks  # global rank of local connection c = i + 1
        self.relay = relay
        self.writer: asyncio.StreamWriter | None = None
        self.reader: asyncio.StreamReader | None = None
        self.stepped: set[int] = set()  # local c with a beat or record sent since the last a


def _metrics_msg(
    rank: int, attempt: int, step: int, step_s: float, now: float, vary: int | None = None
) -> dict:
    """A rank's step record message, as a real titan-tiny record (tests/data/obs-titan/
    metrics.jsonl): the loss, grad norm, lr, max loss, allocation retries, OOMs and tokens seen are
    the run's (the same on every rank); throughput, times and memory are the rank's own (they vary
    with ``vary``, the rank by default; ``--template``: its place on its node)."""
    v = rank if vary is None else vary
    rec = {
        "step": step,
        "rank": rank,
        "attempt": attempt,
        "loss": 6.5 - 0.0001 * step,
        "grad_norm": 0.48 + (step % 13) * 0.001,
        "lr": 0.0003,
        "step_s": step_s,
        "tokens_per_s": 11597.0 + v % 11,
    }
    for k in _TITAN_KEYS:
        rec[k] = 0.5 + (0 if k in _GLOBAL else (v % 5) * 0.01) + step * 1e-6
    rec["ts"] = now
    return {"t": "metrics", "rec": rec, "ts": now}


def _records(lines: list[tuple]) -> int:
    """The step records among a node's lines ``(c, line[, its message])``: those made with their
    message (``lines_of``)."""
    return sum(1 for x in lines if len(x) > 2)


def _line(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def _frame(cid: int, msg: dict) -> bytes:
    from ptops.ops.rank.channel import relay_frame

    return relay_frame(cid, _line(msg))


def _frames(relay: str, lines: list[tuple]) -> list[bytes]:
    """A node's rank lines ``(c, line[, its message])`` as its agent sends them: one ``b`` frame
    (``Batcher``, the agent's own code, since issue 24; handed the message the line was made from,
    so the generator does not parse what it wrote) or a relay frame a line (``line``: the design
    before)."""
    from ptops.ops.rank.channel import SUMMARY_ENV, Batcher, relay_frame, summary_settings

    if relay == "line":
        return [relay_frame(c, raw) for c, raw, *_ in lines]
    # ``supervisor.node_summaries=true``: what the supervisor told its agents (the env)
    b = Batcher(*summary_settings(os.environ.get(SUMMARY_ENV)))
    for c, raw, *msg in lines:
        b.add(c, raw, 0.0, msg[0] if msg else None)
    frame = b.frame()
    return [frame] if frame is not None else []


# ``--template``: stand-ins for the ranks of a node (or of a relay's group of nodes) in a frame made
# once a tick for all ordinary ones (negative, so no value of a record can hold one; increasing with
# the place, as real ranks are, so the summary's order by (value, rank) is the same; -999 and six
# digits up to a million places, which ``_STAND_IN_AT`` finds)
_STAND_IN = -999_999_999
# a stand-in where the template is split: a whole number (not in a longer one, an exponent, a float)
_STAND_IN_AT = re.compile(rb"(?<![\w.])(-999\d+)(?![\w.])")


def _stand_ins(places: int) -> list[int]:
    return [_STAND_IN + j for j in range(places)]


class _Template:
    """A frame made of stand-in ranks, split once at them: ``put(ranks)`` is that frame with the
    rank at each stand-in's place put in, the bytes the agent's or the relay's ``Batcher`` makes of
    those ranks' records (tests/supervisor/test_scale_load.py). One ``%`` format a frame, not a
    ``replace`` a rank: a relay's frame holds ~1,000 stand-ins in ~50 KB, and ~250 are filled a
    tick at 131,072 ranks."""

    def __init__(self, frame: bytes, places: int) -> None:
        own = {b"%d" % n: j for j, n in enumerate(_stand_ins(places))}
        parts = _STAND_IN_AT.split(frame)
        lits, self.order = [parts[0]], []
        for num, lit in zip(parts[1::2], parts[2::2]):
            j = own.get(num)
            if j is None:  # a number that only looks like one: kept as it is
                lits[-1] += num + lit
            else:
                self.order.append(j)
                lits.append(lit)
        self.fmt = b"%d".join(x.replace(b"%", b"%%") for x in lits)

    def put(self, ranks) -> bytes:
        return self.fmt % tuple(map(ranks.__getitem__, self.order))


def _placed(frame: bytes, ranks: list[int]) -> bytes:
    """The template frame with each stand-in replaced by the rank at its place."""
    return _Template(frame, len(ranks)).put(ranks)


def _relay_frame(
    node_frames: list[list[bytes]], per_node: int, batch
) -> tuple[bytes | None, set[int]]:
    """What a relay sends of its agents' frames (``node_frames[j]``: node j's, each line with its
    newline), made by the relay's own code (``ops/node/relay.py::rebatch`` into its ``Batcher``,
    then ``frame``), and the relay's numbers of the ranks that stepped (beat or record: not in its
    next liveness frame). The relay's numbers: node j's connection c is j * per_node + c, as a
    relay numbers them when its agents' hellos come node by node."""
    from ptops.ops.node.relay import rebatch
    from ptops.ops.rank.channel import STEP_KINDS

    stepped: set[int] = set()
    for j, frames in enumerate(node_frames):
        mine = {c: j * per_node + c for c in range(1, per_node + 1)}
        for f in frames:
            for c, m in rebatch(batch, json.loads(f), len(f) - 1, 0.0, mine):
                if m.get("t") in STEP_KINDS:
                    stepped.add(c)
    return batch.frame(), stepped


def _rank_hello(rank: int, index: int, pid: int, attempt: int, world: int) -> dict:
    """A simulated rank's hello (node ``index``'s agent relays it, its token checked)."""
    return {
        "t": "hello",
        "role": "rank",
        "rank": rank,
        "pid": pid,
        "host": f"sim{index:05d}",
        "attempt": attempt,
        "world_size": world,
        "node": f"sim{index:05d}",
    }


def _relay_hellos(
    g: int, token: str, pid: int, attempt: int, group: list[tuple[int, list[int]]], world: int
) -> list[bytes]:
    """A templated relay's first lines: its own hello as ``Relay`` sends it (``ChannelClient``:
    the token first, then ``upstream_hello``), then each rank's as the relay passes it on under its
    own number, node by node (``group``: (node index, its ranks))."""
    from ptops.ops.node.relay import upstream_hello
    from ptops.ops.rank.channel import RELAY, encode

    name = f"relay{g:05d}"
    out = [encode({"t": "hello", "token": token, **upstream_hello(name, os.environ)})]
    for index, ranks in group:
        for rank in ranks:
            m = _rank_hello(rank, index, pid, attempt, world)
            out.append(encode({"t": RELAY, "c": len(out), "m": m}))
    return out


def _startup_lines(index: int, ranks: list[int], world: int) -> list[tuple]:
    """A node's start-up burst: each rank's start-up beats (import, rendezvous, build, load) and
    its ``world``."""
    lines = []
    for section in ("import", "rendezvous", "build", "load"):
        for c in range(1, len(ranks) + 1):
            msg = {"t": "beat", "step": 0, "phase": "startup", "section": section}
            lines.append((c, _line({**msg, "ts": time.time()})))
    for c, rank in enumerate(ranks, 1):
        msg = {"t": "world", "world_size": world, "rank": rank, "host": f"sim{index:05d}"}
        lines.append((c, _line({**msg, "ts": time.time()})))
    return lines


async def _generate(args: argparse.Namespace, part: int) -> None:
    from ptops.ops.rank.channel import (
        ENV_ADDRESS,
        ENV_TOKEN,
        KEEPALIVE_S,
        STEP_PREFIXES,
        Batcher,
        split_address,
        summary_settings,
    )

    # a real relay's address for each group of --relay-tier nodes ("": a templated one)
    relays = [split_address(a) if a else None for a in args.relay_addrs.split(",")]
    host, port = split_address(os.environ[ENV_ADDRESS])
    token = os.environ[ENV_TOKEN]
    attempt = int(os.environ.get(envnames.ATTEMPT, "1"))
    world = args.nodes * args.per_node
    pid = os.getpid()
    tier, per = args.relay_tier, args.per_node
    real = set(_real_groups(args)) if tier else set()
    nodes = [
        _Node(i, list(range(i * per, (i + 1) * per)))
        for i in range(part, args.nodes, args.gen_procs)
        if not tier or i // tier in real
    ]
    if tier:  # --template: one link a group without a real relay, its bytes the relay's
        nodes += [
            _Node(g, list(range(g * tier * per, min(args.nodes, (g + 1) * tier) * per)), True)
            for g in range(part, _groups(args), args.gen_procs)
            if g not in real
        ]
    # the summing up is the relays' (``_start_relays``): their settings, for the templated ones
    relay_batch = summary_settings(os.environ.get(_RELAY_SUMMARY))
    counters = {
        "part": part,
        "sent_metrics": 0,
        "sent_msgs": 0,
        "late_max_s": 0.0,
        "buffered_max": 0,
        "victim_silent_ts": None,
        "replies": 0,
    }
    victim_here = any(args.victim in n.ranks for n in nodes)
    frozen: set[_Node] = set()  # --silent node: the victim's node, once silent (nothing from it)

    async def connect(node: _Node) -> None:
        to = relays[node.index // tier] if tier and not node.relay else (host, port)
        for _ in range(200):  # the listen backlog is 256: a burst of 1,024 connects, some refused
            try:
                node.reader, node.writer = await asyncio.open_connection(*to, limit=1 << 20)
                break
            except OSError:
                await asyncio.sleep(0.05)
        if node.relay:  # the hellos, then the start-up burst in one frame, as the relay's code
            group = [
                (node.index * tier + j, node.ranks[j * per : (j + 1) * per])
                for j in range(len(node.ranks) // per)
            ]
            head = _relay_hellos(node.index, token, pid, attempt, group, world)
            lines = [_startup_lines(i, ranks, world) for i, ranks in group]
            frames = [_frames(args.relay, x) for x in lines]
            frame, _ = _relay_frame(frames, per, Batcher(*relay_batch))
            node.writer.write(b"".join(head) + (frame or b""))
            counters["sent_msgs"] += len(head) + sum(map(len, lines))
            return
        head = [
            json.dumps(
                {
                    "t": "hello",
                    "token": token,
                    "role": "node",
                    "node": f"sim{node.index:05d}",
                    "node_rank": node.index,
                    "pid": pid,
                    "host": f"sim{node.index:05d}",
                    "attempt": attempt,
                }
            ).encode()
            + b"\n"
        ]
        for c, rank in enumerate(node.ranks, 1):  # hellos leave one by one (the agent's check)
            head.append(_frame(c, _rank_hello(rank, node.index, pid, attempt, world)))
        lines = _startup_lines(node.index, node.ranks, world)
        node.writer.write(b"".join(head + _frames(args.relay, lines)))
        counters["sent_msgs"] += len(head) + len(lines)

    async def serve(node: _Node) -> None:
        """The agent's downstream side: commands for its ranks, stack requests, keepalives."""
        while True:
            try:
                raw = await node.reader.readline()
            except (OSError, ValueError):
                return
            if not raw:
                return
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if msg.get("cmd") != "dump" or node in frozen:
                continue
            if not node.relay:  # one reply: its stacks
                asyncio.ensure_future(dump(node, msg))
                continue
            by_node: dict[int, dict] = {}  # a relay splits it by agent, each answers for its own
            for r, v in (msg.get("ranks") or {}).items():
                by_node.setdefault(int(r) // per, {})[r] = v
            for ranks in by_node.values():
                asyncio.ensure_future(dump(node, {**msg, "ranks": ranks}))

    async def dump(node: _Node, msg: dict) -> None:
        stacks, wait = {}, False
        for r, v in (msg.get("ranks") or {}).items():
            silent = int(r) == args.victim and counters["victim_silent_ts"] is not None
            if v.get("ask") and not silent:
                stacks[r] = {"text": STACK_TEXT, "note": "channel", "pid": v.get("pid")}
                continue
            wait = wait or bool(v.get("ask"))  # asked, SIGSTOPped: the agent waits it out
            stacks[r] = {
                "text": f"Process {v.get('pid')}: simulated py-spy dump\n{STACK_TEXT}",
                "note": "py-spy (simulated)",
                "pid": v.get("pid"),
            }
        if wait:
            await asyncio.sleep(float(msg.get("timeout_s") or 5.0))
        node.writer.write(
            json.dumps({"t": "node_stacks", "id": msg.get("id"), "stacks": stacks}).encode() + b"\n"
        )
        counters["replies"] += 1

    for i in range(0, len(nodes), 128):
        await asyncio.gather(*(connect(n) for n in nodes[i : i + 128]))
    for n in nodes:
        asyncio.ensure_future(serve(n))

    stop_file = Path(args.stop_file) if args.stop_file else None
    counters_file = Path(args.counters_dir) / f"gen-{part}.json" if args.counters_dir else None
    t0 = time.time() + 0.5
    t0 -= t0 % 1.0  # every process ticks on the same wall-clock grid: the ranks step in lockstep
    t0 += 1.0
    tick_s = 0.5  # the grid: step boundaries every step_s (a multiple of 0.5 s), pings every ping_s
    per_step = max(1, round(args.step_s / tick_s))
    per_ping = max(1, round(args.ping_s / tick_s))
    tick = 0
    spread, rng = min(400, max(0, args.spread_ms)) / 1000.0, random.Random()
    next_ka = time.monotonic()
    next_counters = time.monotonic()
    victim_silent = False
    while True:
        due = t0 + tick * tick_s
        delay = due - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        now = time.time()
        counters["late_max_s"] = max(counters["late_max_s"], now - due) if tick > 2 else 0.0
        k = tick // per_step + 1  # step k begins at tick per_step * (k - 1)
        boundary = tick % per_step == 0
        ping = tick % per_ping == per_ping // 2  # half a heartbeat out of phase with the steps

        def lines_of(ranks: list[int]) -> list[tuple]:
            lines = []
            for c, rank in enumerate(ranks, 1):
                if rank == args.victim and victim_silent:
                    continue
                stepping = (args.steps == 0 or k - 1 <= args.steps) and not (
                    args.peers == "block" and victim_silent
                )
                if boundary and stepping:
                    if k > 1:
                        msg = _metrics_msg(
                            rank, attempt, k - 1, args.step_s, now, c if args.template else None
                        )
                        lines.append((c, _line(msg), msg))
                    if (args.steps == 0 or k <= args.steps) and not (
                        rank == args.victim and k - 1 >= args.victim_step
                    ):
                        lines.append(
                            (
                                c,
                                b'{"t":"beat","step":%d,"phase":"step","stage":"begin","ts":%r}'
                                % (k, now),
                            )
                        )
                if ping and args.liveness == "rank":  # (the design before: relayed one by one)
                    lines.append((c, b'{"t":"ping","step":%d,"phase":"step","ts":%r}' % (k, now)))
            return lines

        if args.template:  # one frame for every ordinary node, its ranks put in (``_Template``)
            t_lines = lines_of(_stand_ins(per))
            t_frames = [_Template(f, per) for f in _frames(args.relay, t_lines)]
            t_metrics = _records(t_lines)
            t_stepped = {x[0] for x in t_lines if x[1].startswith(STEP_PREFIXES)}
        t_relays: dict[int, tuple] = {}  # a templated relay's nodes -> this tick's frame, ...

        def relay_tick(n: int) -> tuple:
            """This tick's frame of a templated relay of ``n`` nodes, once for all of them: its
            agents' frames made of stand-in ranks as every agent makes its own, through the relay's
            own batching (``_relay_frame``); and what it stepped, sent, of which records."""
            if n not in t_relays:
                stand = _stand_ins(n * per)
                lines = [lines_of(stand[j * per : (j + 1) * per]) for j in range(n)]
                frames = [_frames(args.relay, x) for x in lines]
                frame, stepped = _relay_frame(frames, per, Batcher(*relay_batch))
                metrics = sum(map(_records, lines))
                t = _Template(frame, n * per) if frame is not None else None
                t_relays[n] = (t, stepped, sum(map(len, lines)), metrics)
            return t_relays[n]

        for node in nodes:
            if node in frozen:
                continue
            if node.relay:
                t, stepped, msgs, metrics = relay_tick(len(node.ranks) // per)
                parts = [t.put(node.ranks)] if t is not None else []
                counters["sent_msgs"] += msgs
                counters["sent_metrics"] += metrics
                node.stepped |= stepped
            elif args.template and 0 not in node.ranks and args.victim not in node.ranks:
                parts = [t.put(node.ranks) for t in t_frames]
                counters["sent_msgs"] += len(t_lines)
                counters["sent_metrics"] += t_metrics
                node.stepped |= t_stepped
            else:
                lines = lines_of(node.ranks)
                counters["sent_msgs"] += len(lines)
                counters["sent_metrics"] += _records(lines)
                parts = _frames(args.relay, lines)
                node.stepped.update(x[0] for x in lines if x[1].startswith(STEP_PREFIXES))
            if ping and (args.liveness == "node" or node.relay):  # one frame for the pings
                # (as the agent's ``alive_frame`` and the relay's ``_alive``: not the ranks whose
                # beat or record went up since; a relay's frame follows its agents' at once)
                heard = [
                    c for c, rank in enumerate(node.ranks, 1)
                    if not (rank == args.victim and victim_silent) and c not in node.stepped
                ]  # fmt: skip
                node.stepped.clear()
                if heard:
                    parts.append(
                        b'{"t":"a","c":[%s],"ms":[%s]}\n'
                        % (",".join(map(str, heard)).encode(), b",".join([b"0"] * len(heard)))
                    )
                    counters["sent_msgs"] += 1
            if parts and spread and boundary and not node.relay:  # (its own writes keep order)
                rng.seed(node.index * 1_000_003 + k)
                asyncio.get_running_loop().call_later(
                    rng.random() * spread, node.writer.write, b"".join(parts)
                )
            elif parts:
                node.writer.write(b"".join(parts))
        if (
            boundary
            and not victim_silent
            and args.victim >= 0
            and k - 1 >= args.victim_step
            and victim_here
        ):
            victim_silent = True  # its last message (step victim_step's record) went out just now
            counters["victim_silent_ts"] = now
            if args.silent == "node":
                frozen.update(n for n in nodes if args.victim in n.ranks)
            if stop_file is not None:
                stop_file.write_text(
                    json.dumps(
                        {
                            "rank": args.victim,
                            "after_step": args.victim_step,
                            "ts": now,
                            "silent": args.silent,
                        }
                    )
                )
        if time.monotonic() >= next_ka:
            next_ka = time.monotonic() + KEEPALIVE_S
            for node in nodes:  # (a templated relay's own, as a relay's)
                if node not in frozen:
                    node.writer.write(b'{"t":"ka"}\n')
        buffered = sum(n.writer.transport.get_write_buffer_size() for n in nodes)
        counters["buffered_max"] = max(counters["buffered_max"], buffered)
        if counters_file is not None and time.monotonic() >= next_counters:
            next_counters = time.monotonic() + 1.0
            tmp = counters_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({**counters, "t": time.time(), "buffered": buffered}))
            os.replace(tmp, counters_file)
        tick += 1


# the supervisor's summary settings, kept for the templated relays (``_start_relays``)
_RELAY_SUMMARY = "SCALE_LOAD_RELAY_SUMMARY"


def _groups(args: argparse.Namespace) -> int:
    """How many groups of ``--relay-tier`` nodes (the last may be short)."""
    return -(-args.nodes // args.relay_tier)


def _real_groups(args: argparse.Namespace) -> list[int]:
    """The groups of ``--relay-tier`` nodes that get a real relay process: all, or with
    ``--template`` those of rank 0 and of the victim (the others' links are templated)."""
    groups = _groups(args)
    if not args.template:
        return list(range(groups))
    return sorted({0, args.victim // args.per_node // args.relay_tier})


def _start_relays(args: argparse.Namespace) -> tuple[list[subprocess.Popen], str]:
    """One real relay (``python -m ptops.ops.node.relay``) per ``--relay-tier`` nodes (with
    ``--template``: per ``_real_groups``), on this machine's loopback; the addresses in group order,
    "" for a templated one. They sum up (``PTOPS_NODE_SUMMARY``), so the simulated agents behind
    them do not (the variable leaves this process's environment, kept as ``_RELAY_SUMMARY`` for the
    templated relays). Their pids go into the counters folder, for their CPU."""
    from ptops.ops.rank.channel import SUMMARY_ENV
    from ptops.ops.supervisor.procs import die_with_parent

    env = {**os.environ, envnames.RELAY_LISTEN: "127.0.0.1:0"}
    os.environ[_RELAY_SUMMARY] = os.environ.pop(SUMMARY_ENV, "")
    real = _real_groups(args)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ptops.ops.node.relay"],
            env=env,
            stdout=subprocess.PIPE,
            preexec_fn=die_with_parent,
        )
        for _ in real
    ]
    addrs = [""] * _groups(args)
    for g, p in zip(real, procs):
        line = p.stdout.readline()
        try:
            addrs[g] = json.loads(line)["relay"]
        except (ValueError, KeyError, TypeError):
            raise SystemExit(f"relay {p.pid} did not start (its output: {line[:200]!r})") from None
    if args.counters_dir:
        (Path(args.counters_dir) / "relays.json").write_text(json.dumps([p.pid for p in procs]))
    return procs, ",".join(addrs)


def _relay_counts(args: argparse.Namespace) -> dict:
    """With relays: how many are real processes (``relays_cpu_pct`` is theirs) and how many links
    are templated (``--template``: one connection of the generator's a group, the bytes the relay's
    code makes, made once a tick for all of them)."""
    if not args.relay_tier:
        return {}
    real = len(_real_groups(args))
    return {"relays_real": real, "relay_templated": _groups(args) - real}


def _relays_cpu(d: Path) -> tuple[int, float]:
    """(relays, their CPU seconds so far) from /proc (0, 0.0 without relays)."""
    try:
        pids = json.loads((d / "relays.json").read_text())
    except (OSError, ValueError):
        return 0, 0.0
    return len(pids), sum(_stat_cpu(f"/proc/{int(pid)}/stat") for pid in pids)


def generate_main(args: argparse.Namespace) -> None:
    from ptops.ops.supervisor.procs import die_with_parent

    die_with_parent()
    if args.cpus:  # off the starved supervisor's CPU (the parts inherit it)
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    children = []
    if args.part < 0 and args.relay_tier > 0:  # the relays first: their addresses for the parts
        children, args.relay_addrs = _start_relays(args)
    if args.part < 0:  # the spawned one: start the other parts, run part 0
        for p in range(1, args.gen_procs):
            argv = [sys.executable, __file__, "generate", *sys.argv[2:], "--part", str(p)]
            argv += ["--relay-addrs", args.relay_addrs]
            children.append(subprocess.Popen(argv, preexec_fn=die_with_parent))
        part = 0
    else:
        part = args.part
    try:
        asyncio.run(_generate(args, part))
    finally:
        for c in children:
            c.kill()


# ================================================================ the real supervisor, measured


def _stat_cpu(path: str) -> float:
    """utime + stime in seconds of a /proc ``stat`` file (0.0 when it is gone)."""
    try:
        with open(path, "rb") as f:
            s = f.read()
        fields = s[s.rindex(b")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / CLK
    except (OSError, ValueError, IndexError):
        return 0.0


def _thread_cpu(tid: int | None) -> float:
    return 0.0 if tid is None else _stat_cpu(f"/proc/self/task/{tid}/stat")


def _proc_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _gen_counters(d: Path) -> dict:
    total: dict = {
        "sent_metrics": 0,
        "sent_msgs": 0,
        "late_max_s": 0.0,
        "buffered": 0,
        "replies": 0,
    }
    for f in d.glob("gen-*.json"):
        try:
            c = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for k in ("sent_metrics", "sent_msgs", "buffered", "replies"):
            total[k] += c.get(k) or 0
        total["late_max_s"] = max(total["late_max_s"], c.get("late_max_s") or 0.0)
    return total


def _starve() -> tuple[subprocess.Popen, str]:
    """Pin this process (the supervisor: its threads start later and inherit it) to one CPU and a
    busy loop beside it, so the supervisor gets about half a core; returns the loop and the other
    CPUs, for the load generators. Why pinning: a competitor anywhere else on the machine starves
    the generators as much as the supervisor, and a starved generator's ranks really do go silent
    (docs/scale.md, 2026-12-02)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--starve needs two CPUs: the supervisor's and the generators'")
    mine, rest = cpus[0], cpus[1:]
    from ptops.ops.supervisor.procs import die_with_parent

    def pinned() -> None:  # before the loop starts: on that CPU from its first instruction
        die_with_parent()
        os.sched_setaffinity(0, {mine})

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pinned)
    os.sched_setaffinity(0, {mine})
    return busy, ",".join(str(c) for c in rest)


def _gc_timer(pauses: list) -> object:
    """A ``gc.callbacks`` entry appending (generation, seconds, its end's wall time, objects it
    freed) of each collection to ``pauses``."""
    began = [0.0]

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append(
                (info["generation"], time.perf_counter() - began[0], time.time(), info["collected"])
            )

    return timer


def run_one(args: argparse.Namespace) -> dict:
    from ptops.ops.runrecord.events import EventKind
    from ptops.ops.supervisor import launcher
    from ptops.ops.supervisor.core import Supervisor
    from ptops.recipes.schema import load

    world = args.nodes * args.per_node
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="ptops-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    counters_dir = work / "gen"
    counters_dir.mkdir(exist_ok=True)
    stop_file = work / "victim.json"
    rec, path = load(
        args.recipe,
        [f"train.steps={args.total_steps}", f"supervisor.heartbeat_s={args.ping_s}", *args.set],
    )
    run = launcher.prepare_run(rec, path, work / "run")
    busy, gen_cpus = _starve() if args.starve else (None, "")
    handled = [0]
    lat = array.array("d")
    pauses: list[tuple] = []  # the supervisor process's collections (``_gc_timer``)
    gc.callbacks.append(_gc_timer(pauses))

    class LoadSupervisor(Supervisor):
        """The real supervisor; only the attempt's process is the load generator (the launch backend
        hook)."""

        def attempt_command(self, attempt: int, extra: dict[str, str]) -> launcher.RankCommand:
            env = launcher.rank_command(self.recipe, self.run, attempt, extra_env=extra).env
            argv = [
                sys.executable,
                __file__,
                "generate",
                "--nodes",
                str(args.nodes),
                "--per-node",
                str(args.per_node),
                "--gen-procs",
                str(args.gen_procs),
                "--step-s",
                str(args.step_s),
                "--ping-s",
                str(args.ping_s),
                "--steps",
                str(args.steps),
                "--victim",
                str(args.victim),
                "--victim-step",
                str(args.victim_step),
                "--peers",
                args.peers,
                "--spread-ms",
                str(args.spread_ms),
                "--silent",
                args.silent,
                "--liveness",
                args.liveness,
                "--relay",
                args.relay,
                *(["--template"] if args.template else []),
                "--relay-tier",
                str(args.relay_tier),
                "--stop-file",
                str(stop_file),
                "--counters-dir",
                str(counters_dir),
            ]
            if gen_cpus:
                argv += ["--cpus", gen_cpus]
            return launcher.RankCommand(argv, env)

        def launch_fields(self, attempt: int) -> dict:
            return {
                "simulated": {
                    "nodes": args.nodes,
                    "per_node": args.per_node,
                    "gen_procs": args.gen_procs,
                }
            }

        def _on_metrics(self, peer, msg, ts, like=None):  # counted, then the real handler
            handled[0] += 1
            r = msg.get("rec") or {}
            t = r.get("ts")
            if isinstance(t, float):
                lat.append(time.time() - t)
            super()._on_metrics(peer, msg, ts, like if args.certify == "on" else None)

        STEP_GROUPS = args.groups == "on"

        def _on_step_group(self, items, ts):  # a node's step group: its records counted too
            if items[0][1].get("t") == "metrics":
                handled[0] += len(items)
                now = time.time()
                for _, m, _ in items:
                    t = m["rec"].get("ts")
                    if isinstance(t, float):
                        lat.append(now - t)
                if args.certify != "on":
                    items = [(vp, m, None) for vp, m, _ in items]
            super()._on_step_group(items, ts)

    log = open(work / "supervisor.log", "w")
    sup = LoadSupervisor(rec, run, [], out=log, strategy="temporary")
    sup.world = world

    samples: list[dict] = []
    done = threading.Event()
    main_tid = threading.get_native_id()

    def sampler() -> None:
        while not done.wait(1.0):
            server = sup.server
            ch_tid = server._thread.native_id if server is not None else None
            samples.append(
                {
                    "t": time.time(),
                    "handled": handled[0],
                    "cpu_s": _proc_cpu(),
                    "main_cpu_s": _thread_cpu(main_tid),
                    "channel_cpu_s": _thread_cpu(ch_tid),
                    "rss_mb": _rss_mb(),
                    # messages waiting (a node's batch counts its messages; before issue 24's
                    # batches this was the queue's length)
                    "inbox": server.received - server.handled if server is not None else 0,
                    "inbox_entries": server.inbox.qsize() if server is not None else 0,
                    "connections": len(server._peers) if server is not None else 0,
                    "nodes": len(server.nodes()) if server is not None else 0,
                    "ranks": len(sup.ranks),
                    "gen": _gen_counters(counters_dir),
                    "relays": _relays_cpu(counters_dir),
                    "lat_n": len(lat),
                    "load1": os.getloadavg()[0],
                }
            )

    def watchdog() -> None:
        if not done.wait(args.timeout):
            sup.stop_signal = signal.SIGTERM  # the supervisor's own stop path

    threading.Thread(target=sampler, daemon=True).start()
    threading.Thread(target=watchdog, daemon=True).start()
    prof = cProfile.Profile() if args.profile else None
    t_start = time.time()
    if prof is not None:
        prof.enable()
    try:
        rc = sup.run_all()
    finally:
        if prof is not None:
            prof.disable()
        done.set()
        log.close()
        if busy is not None:
            busy.kill()
            busy.wait()
    t_end = time.time()
    if prof is not None:
        prof.dump_stats(args.profile)
        st = pstats.Stats(args.profile, stream=sys.stderr)
        st.sort_stats("tottime").print_stats(25)

    events = run.read_events()
    hang = next((e for e in events if e["kind"] == EventKind.HANG), None)
    victim = json.loads(stop_file.read_text()) if stop_file.exists() else None
    # the silent rank's last message as the hang monitor stamped its arrival (wall clock): what
    # the budget counts from; detect_s less budget_s is its way there plus the judging's delay
    last = sup.monitor.ranks.get(victim["rank"]) if victim and sup.monitor else None
    seen = last.last_seen if last is not None else None
    arrived = None if seen is None else seen + time.time() - time.monotonic()
    mbytes = run.metrics.stat().st_size if run.metrics.exists() else 0
    mlines = sum(1 for _ in open(run.metrics, "rb")) if mbytes else 0

    # steady state: every rank stepping (full rate reached) until the victim goes silent
    stop_ts = victim["ts"] if victim else t_end
    full = [s for s in samples if s["ranks"] >= world and s["handled"] > 0 and s["t"] <= stop_ts]
    steady = full[3:] if len(full) > 6 else full  # skip the ramp (first steps, queue fill)
    out: dict = {
        "ranks": world,
        "nodes": args.nodes,
        "per_node": args.per_node,
        "gen_procs": args.gen_procs,
        "step_s": args.step_s,
        "peers": args.peers,
        "spread_ms": args.spread_ms,
        "silent": args.silent,
        "starved": bool(args.starve),
        "relay_tier": args.relay_tier,
        **_relay_counts(args),
        "exit_code": rc,
        "wall_s": round(t_end - t_start, 1),
    }
    if len(steady) >= 2:
        a, b = steady[0], steady[-1]
        dt = b["t"] - a["t"]
        out["steady_s"] = round(dt, 1)
        out["offered_records_per_s"] = round(
            (b["gen"]["sent_metrics"] - a["gen"]["sent_metrics"]) / dt, 1
        )
        out["offered_msgs_per_s"] = round((b["gen"]["sent_msgs"] - a["gen"]["sent_msgs"]) / dt, 1)
        out["handled_records_per_s"] = round((b["handled"] - a["handled"]) / dt, 1)
        out["nominal_records_per_s"] = round(world / args.step_s, 1)
        out["cpu_pct_of_one_core"] = round(100 * (b["cpu_s"] - a["cpu_s"]) / dt, 1)
        out["main_thread_cpu_pct"] = round(100 * (b["main_cpu_s"] - a["main_cpu_s"]) / dt, 1)
        out["channel_thread_cpu_pct"] = round(
            100 * (b["channel_cpu_s"] - a["channel_cpu_s"]) / dt, 1
        )
        out["inbox_max"] = max(s["inbox"] for s in steady)
        out["inbox_last"] = b["inbox"]
        if b["relays"][0]:  # the relays' CPU, all of them, and one's on average
            out["relays"] = b["relays"][0]
            out["relays_cpu_pct"] = round(100 * (b["relays"][1] - a["relays"][1]) / dt, 1)
            out["relay_cpu_pct_mean"] = round(out["relays_cpu_pct"] / out["relays"], 1)
        window = sorted(lat[a["lat_n"] : b["lat_n"]])
        if window:
            out["record_latency_s"] = {
                "p50": round(window[len(window) // 2], 4),
                "p99": round(window[int(len(window) * 0.99)], 4),
                "max": round(window[-1], 4),
            }
        out["generator_late_max_s"] = round(b["gen"]["late_max_s"], 3)
        out["generator_buffered_bytes_max"] = max(s["gen"]["buffered"] for s in steady)
        out["load1"] = round(sum(s["load1"] for s in steady) / len(steady), 2)
    elif (
        len(samples) >= 2
    ):  # never all ranks handled and stepping before the end: the whole run, as it went
        a, b = samples[0], samples[-1]
        dt = b["t"] - a["t"]
        out["no_steady_state"] = True
        out["whole_run_s"] = round(dt, 1)
        out["offered_records_per_s"] = round(
            (b["gen"]["sent_metrics"] - a["gen"]["sent_metrics"]) / dt, 1
        )
        out["handled_records_per_s"] = round((b["handled"] - a["handled"]) / dt, 1)
        out["nominal_records_per_s"] = round(world / args.step_s, 1)
        out["cpu_pct_of_one_core"] = round(100 * (b["cpu_s"] - a["cpu_s"]) / dt, 1)
        out["main_thread_cpu_pct"] = round(100 * (b["main_cpu_s"] - a["main_cpu_s"]) / dt, 1)
        out["channel_thread_cpu_pct"] = round(
            100 * (b["channel_cpu_s"] - a["channel_cpu_s"]) / dt, 1
        )
        out["inbox_max"] = max(s["inbox"] for s in samples)
        out["ranks_handled_max"] = max(s["ranks"] for s in samples)
        out["load1"] = round(sum(s["load1"] for s in samples) / len(samples), 2)
    out["rss_mb_max"] = round(max((s["rss_mb"] for s in samples), default=_rss_mb()), 1)
    # the cyclic collector's pauses (a full one walks every object: at 131,072 ranks, seconds)
    passes = [(s, t) for g, s, t, _ in pauses if g == 2]
    out["gc_pause_max_s"] = round(max((s for _, s, _, _ in pauses), default=0.0), 3)
    out["gc_full_count"], out["gc_full_s"] = len(passes), round(sum(s for s, _ in passes), 3)
    if len(steady) >= 2:  # in the steady window and after it (the silent rank's budget)
        late = [s for s, t in passes if t >= steady[0]["t"]]
        out["gc_full_steady_count"] = len(late)
        out["gc_full_steady_max_s"] = round(max(late, default=0.0), 3)
        # the long ones: (seconds into the steady window, pause s), the silent rank's time at end
        out["gc_full_steady_long"] = [
            (round(t - steady[0]["t"], 1), round(s, 3))
            for s, t in passes
            if t >= steady[0]["t"] and s >= 0.05
        ]
        out["victim_silent_at_s"] = round(stop_ts - steady[0]["t"], 1)
        # garbage in cycles the collector freed from then on (what a frozen object would keep)
        out["gc_collected"] = sum(n for _, _, t, n in pauses if t >= steady[0]["t"])
    # a relay's step groups (16 ranks or more) the hang monitor moved as one cohort, of all
    moves = sup.monitor.group_moves if sup.monitor else [0, 0]
    out["cohort_moves"], out["groups_rank_by_rank"] = moves
    out["cohort_share"] = round(moves[0] / sum(moves), 3) if sum(moves) else None
    out["connections"] = max((s["connections"] for s in samples), default=0)
    out["node_agents"] = max((s["nodes"] for s in samples), default=0)
    out["metrics_records"] = mlines
    out["metrics_bytes_per_record"] = round(mbytes / mlines, 1) if mlines else None  # a line
    # the file's growth a rank-step, whatever its lines hold (node lines, sampled rank detail)
    handled = samples[-1]["handled"] if samples else 0
    out["metrics_bytes"] = mbytes
    out["metrics_bytes_per_handled_record"] = round(mbytes / handled, 1) if handled else None
    out["events_bytes"] = run.events.stat().st_size if run.events.exists() else 0
    if hang is not None and victim is not None:
        out["hang"] = {
            "victim": victim["rank"],
            "why": hang.get("why"),
            "found_count": len(hang.get("ranks") or []),
            "found_ranks": (hang.get("ranks") or [])[:16],
            # quiet past ping_stale_s when the budget ran out but silent for less: listed, not named
            "also_quiet_count": len(hang.get("also_quiet") or []),
            "silent": victim.get("silent", "rank"),
            # --silent node: every rank of the victim's node named, and no other
            "found_exactly_the_silent": sorted(hang.get("ranks") or [])
            == (
                list(
                    range(
                        victim["rank"] // args.per_node * args.per_node,
                        (victim["rank"] // args.per_node + 1) * args.per_node,
                    )
                )
                if victim.get("silent") == "node"
                else [victim["rank"]]
            ),
            "detect_s": round(
                hang["found_ts"] - victim["ts"], 2
            ),  # victim's last message -> the hang decision
            "budget_s": hang.get("timeout_s"),
            # its last message: sent -> stamped on arrival at the supervisor
            "arrival_s": round(arrived - victim["ts"], 3) if arrived is not None else None,
            "event_s": round(
                hang["ts"] - victim["ts"], 2
            ),  # -> the hang event written (after the stacks)
            "stacks_s": hang.get("stacks_s"),
            "teardown_s": hang.get("teardown_s"),
            # the generators' lateness to the end (the steady window's figure stops before the
            # hang): a starved generator's ranks go quiet and are named with the silent one
            "generator_late_max_s": round(samples[-1]["gen"]["late_max_s"], 3) if samples else None,
            "stack_files": len(list((run.path / "stacks" / "attempt-1").glob("*.txt"))),
        }
    # how the run ended, in its own words (a --sizes child's run directory is gone after it)
    out["last_events"] = [
        {k: str(e[k])[:200] for k in ("kind", "reason", "why", "rank", "how") if k in e}
        for e in events[-4:]
    ]
    out["run_dir"] = str(run.path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode")
    g = sub.add_parser("generate", help="(internal) the simulated node agents of one attempt")
    for p in (ap, g):
        p.add_argument("--per-node", type=int, default=8)
        p.add_argument("--gen-procs", type=int, default=1, help="load generator processes")
        p.add_argument(
            "--step-s", type=float, default=1.0, help="seconds a step (a multiple of 0.5)"
        )
        p.add_argument(
            "--ping-s",
            type=float,
            default=1.0,
            help="liveness ping interval (the probe's PTOPS_HEARTBEAT_S)",
        )
        p.add_argument(
            "--steps",
            type=int,
            default=0,
            help="steps each rank runs, then it waits pinging (0: no end)",
        )
        p.add_argument(
            "--victim", type=int, default=-1, help="the rank that goes silent (-1: the last rank)"
        )
        p.add_argument(
            "--victim-step", type=int, default=30, help="... after sending this step's record"
        )
        p.add_argument("--peers", choices=("continue", "block"), default="continue")
        p.add_argument(
            "--spread-ms",
            type=int,
            default=0,
            help="each simulated node agent's step frame leaves a random 0..N ms after the step "
            "boundary, anew each step (max 400): a real job's agents, whose frames reach their "
            "relay over tens of ms, not all at once (0: all at the boundary)",
        )
        p.add_argument(
            "--silent",
            choices=("rank", "node"),
            default="rank",
            help="rank: the victim alone goes silent (SIGSTOPped); node: its whole node (nothing "
            "from its agent: a frozen host or a cut link)",
        )
    for p in (ap, g):
        p.add_argument(
            "--template",
            action="store_true",
            help="the generators make one frame a tick for every node but the one of rank 0 and "
            "the victim's, and put each node's ranks in it (bytes the agent's Batcher makes of "
            "records that vary with a rank's place on its node): the load of 131,072 ranks from "
            "a fraction of a core. With --relay-tier: only the relays of rank 0's and the "
            "victim's groups are real processes; every other group is one link of the generator "
            "to the supervisor sending the bytes the real relay's code makes of its agents' "
            "frames (made once a tick for all, each group's ranks put in). Without it every "
            "node's records are made and batched",
        )
    for p, choices in ((ap, ("node", "rank", "both")), (g, ("node", "rank"))):
        p.add_argument(
            "--liveness",
            choices=choices,
            default="node",
            help="node: each node agent keeps its ranks' pings and sends one liveness frame a "
            "second naming the ranks whose beat or record did not go up since the last "
            "(ops/node/agent.py since issue 24); rank: every rank's ping relayed (the design "
            "before); both: each size twice, side by side",
        )
    ap.add_argument(
        "--certify",
        choices=("on", "off", "both"),
        default="on",
        help="on: a record the batch certifies equal to its node's first of the step but for "
        "some keys moves the shared monitors on unread (MonitorFeed.feed's like, since issue 24); "
        "off: every record read by every monitor (the design before); both: side by side",
    )
    ap.add_argument(
        "--groups",
        choices=("on", "off", "both"),
        default="on",
        help="on: a node's step group (its ranks' records of a step, their beats that begin the "
        "next) handled as one unit by the supervisor (_on_step_group, since issue 24); off: "
        "message by message (the design before); both: each size both ways, side by side",
    )
    for p, choices in ((ap, ("batch", "line", "both")), (g, ("batch", "line"))):
        p.add_argument(
            "--relay",
            choices=choices,
            default="batch",
            help="batch: each node agent sends its ranks' lines of a few ms as one frame, step "
            "records as differences (ops/rank/channel.py::Batcher, since issue 24); line: a "
            "relay frame a line (the design before); both: each size both ways",
        )
    ap.add_argument(
        "--starve",
        action="store_true",
        help="the supervisor pinned to one CPU with a busy loop pinned beside it (about half a "
        "core: issue 24 point 6), the load generators on the other CPUs",
    )
    g.add_argument("--cpus", default="", help="(internal) the CPUs the generators run on")
    g.add_argument("--relay-tier", type=int, default=0)
    g.add_argument("--relay-addrs", default="", help="(internal) the relays' addresses")
    g.add_argument("--nodes", type=int, required=True)
    g.add_argument("--part", type=int, default=-1)
    g.add_argument("--stop-file", default="")
    g.add_argument("--counters-dir", default="")
    ap.add_argument(
        "--relay-tier",
        default="0",
        help="N: a real relay (ops/node/relay.py) per N nodes between the simulated agents and "
        "the supervisor, summing up over its nodes' ranks (since issue 24); 0: the agents "
        "straight to the supervisor; with --sizes a list (0,64: each size both ways, side by "
        "side)",
    )
    ap.add_argument("--ranks", type=int, default=0, help="one size, in this process")
    ap.add_argument(
        "--sizes", default="64,1024,8192", help="several sizes, each in a child process"
    )
    ap.add_argument("--recipe", default="titan-tiny")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for the supervisor, e.g. supervisor.metrics_lines=node",
    )
    ap.add_argument("--total-steps", type=int, default=1_000_000)
    ap.add_argument(
        "--steady", type=int, default=30, help="seconds of full load before the victim goes silent"
    )
    ap.add_argument(
        "--timeout", type=float, default=900, help="stop the supervisor after this many seconds"
    )
    ap.add_argument(
        "--work", default="", help="folder for the run directory (default: a new temporary one)"
    )
    ap.add_argument(
        "--profile", default="", help="cProfile the supervisor's main thread into this file"
    )
    ap.add_argument("--json", default="", help="write this size's result here")
    ap.add_argument(
        "--label", default="default", help="key of this set of sizes in --out (other keys are kept)"
    )
    ap.add_argument(
        "--note", default="", help="a line stored with the results (e.g. which code ran)"
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "scale_load.json")
    a = ap.parse_args()
    if a.mode == "generate":
        if a.victim < 0:
            a.victim = a.nodes * a.per_node - 1
        generate_main(a)
        return
    tiers = [int(t) for t in a.relay_tier.split(",") if t]
    if a.ranks:
        if "both" in (a.liveness, a.relay, a.certify, a.groups) or len(tiers) != 1:
            ap.error("both runs each of --sizes twice; with --ranks give one design")
        a.relay_tier = tiers[0]
        if a.template and a.relay_tier and a.relay != "batch":
            ap.error("--template with --relay-tier: the templated relays take batch frames")
        a.nodes = max(1, a.ranks // a.per_node)
        if a.victim < 0:
            a.victim = a.nodes * a.per_node - 1
        if a.steps == 0:
            a.victim_step = int(a.steady / a.step_s) + 3  # the first steps are the ramp
        res = run_one(a)
        res["groups"] = a.groups
        print(json.dumps(res, indent=2))
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
        return
    results = []
    # the design before first: (liveness, relay)
    designs = [
        (live, relay, cert)
        for live in (("rank", "node") if a.liveness == "both" else (a.liveness,))
        for relay in (("line", "batch") if a.relay == "both" else (a.relay,))
        for cert in (("off", "on") if a.certify == "both" and relay == "batch" else (a.certify,))
        if not (live == "rank" and relay == "batch" and a.liveness == a.relay == "both")
    ]
    groupings = ("off", "on") if a.groups == "both" else (a.groups,)
    for size, (liveness, relay, cert), groups, tier in [
        (int(s), d, g, t)
        for s in a.sizes.split(",")
        if s
        for d in designs
        for g in groupings
        for t in tiers
    ]:
        with tempfile.TemporaryDirectory(prefix=f"ptops-scale-{size}-") as d:
            argv = [
                sys.executable,
                __file__,
                "--ranks",
                str(size),
                "--per-node",
                str(a.per_node),
                "--gen-procs",
                str(a.gen_procs),
                "--step-s",
                str(a.step_s),
                "--ping-s",
                str(a.ping_s),
                "--steady",
                str(a.steady),
                "--peers",
                a.peers,
                "--spread-ms",
                str(a.spread_ms),
                "--silent",
                a.silent,
                "--liveness",
                liveness,
                "--relay",
                relay,
                "--certify",
                "off" if cert == "both" else cert,
                "--groups",
                groups,
                "--relay-tier",
                str(tier),
                "--timeout",
                str(a.timeout),
                *(["--starve"] if a.starve else []),
                *(["--template"] if a.template else []),
                *[x for kv in a.set for x in ("--set", kv)],
                "--work",
                d,
                "--json",
                f"{d}/r.json",
            ]
            print(
                f"== {size} ranks ({size // a.per_node} nodes x {a.per_node}), liveness "
                f"{liveness}, relay {relay}, certify {cert}, groups {groups}, relay tier "
                f"{tier}, load "
                f"{os.getloadavg()}",
                flush=True,
            )
            subprocess.run(argv, check=False, stdout=sys.stderr)
            try:
                res = json.loads(Path(f"{d}/r.json").read_text())
            except (OSError, ValueError):
                res = {"ranks": size, "error": "no result (see the output above)"}
            res["liveness"] = liveness
            res["relay"] = relay
            res["certify"] = cert
            res["groups"] = groups
            res.pop("run_dir", None)
            results.append(res)
            print(json.dumps(res), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        doc = json.loads(a.out.read_text())
    except (OSError, ValueError):
        doc = {}
    doc.setdefault("runs", {})[a.label] = {
        "command": "bench/scale_load.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "note": a.note,
        "results": results,
    }
    a.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
