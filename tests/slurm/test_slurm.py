"""Supervised multi-node runs on a real Slurm 22.05 (3 slurmd nodes in network namespaces, one
machine).

One cluster for the session (``slurm_cluster`` fixture); 1 rank per node, titan-tiny on CPU/gloo.
Every run is held by ``hold:`` faults until what the test waits for is observed, never raced against
the clock; several checks share one run. Each recovered run must end with the digest of the same
world size launched locally (the shared ``reference`` faulted run: 2 ranks, 16 steps).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_ptops
from faulted import STEPS

from ptops.diagnostics.stacks import node_sections

pytestmark = pytest.mark.slurm

TWO_NODES = [
    "--supervise",
    "--slurm",
    "--nodes",
    "2",
    "--set",
    "launch.nproc=1",
    *STEPS,
    "--no-mlflow",
    "--set",
    "supervisor.kill_timeout_s=3",
    "--set",
    "supervisor.restart.backoff_s=0.5",
]
WAIT_S = 420  # an upper bound that only a broken run reaches; every wait ends on an observed event


def events(run: Path, kind: str | None = None) -> list[dict]:
    p = run / "events.jsonl"
    if not p.exists():
        return []
    out = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    return [e for e in out if kind is None or e["kind"] == kind]


def submit(cluster, run: Path, *args: str, env: dict | None = None) -> str:
    out = run_ptops(
        "launch",
        "titan-tiny",
        "--run-dir",
        str(run),
        *TWO_NODES,
        *args,
        "--json",
        env={**cluster.env, **(env or {})},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["job_id"]


def job_output(run: Path) -> str:
    return "\n".join(
        p.read_text(errors="replace") for p in sorted((run / "slurm").glob("job-*.out"))
    )


def wait_for(cluster, run: Path, job: str, what, label: str) -> list[dict]:
    """Poll the run's events until ``what(events)`` is truthy; fail at once if the job left the
    queue."""
    deadline = time.monotonic() + WAIT_S
    while True:
        evs = events(run)
        got = what(evs)
        if got:
            return got
        q = cluster.run("squeue", "-h", "-j", job, "-o", "%T")
        if q.returncode == 0 and not q.stdout.strip() and not what(events(run)):
            raise AssertionError(
                f"job {job} left the queue before {label}:\n{job_output(run)[-4000:]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"no {label} within {WAIT_S} s:\n{job_output(run)[-4000:]}")
        time.sleep(0.2)


def wait_job_gone(cluster, job: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        q = cluster.run("squeue", "-h", "-j", job, "-o", "%T")
        if not q.stdout.strip():
            return
        time.sleep(0.3)
    raise AssertionError(f"job {job} still in the queue")


def held(evs: list[dict], attempt: int, n: int = 2) -> bool:
    return (
        len(
            [
                e
                for e in evs
                if e["kind"] == "fault_injected"
                and str(e.get("fault", "")).startswith("hold")
                and e.get("attempt") == attempt
            ]
        )
        >= n
    )


def status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


def release(cluster, run: Path) -> None:
    out = run_ptops("inject", str(run), "release", env=cluster.env)
    assert out.returncode == 0 and "injected release" in out.stdout, out.stdout + out.stderr


def digest(path: Path, cli: bool = False) -> str:
    """``ptops ckpt digest PATH``: the CLI once (the reference), in-process otherwise (the same
    function, without a torch start-up of ~5 s each)."""
    if not cli:
        from ptops.ckpt import digest as digest_of

        return digest_of(path)
    out = run_ptops("ckpt", "digest", str(path))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def run_pids(run: Path) -> list[int]:
    want = b"PTOPS_RUN_DIR=" + str(run.resolve()).encode()
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
                stat = Path(f"/proc/{name}/stat").read_bytes()
            except OSError:
                continue
            if want in env and stat[stat.rindex(b")") + 2 :][:1] not in (b"Z", b"X"):
                pids.append(int(name))
    return pids


def agent_pid(run: Path, attempt: int, node: str) -> int:
    want = [
        b"PTOPS_RUN_DIR=" + str(run.resolve()).encode(),
        f"PTOPS_ATTEMPT={attempt}".encode(),
        f"SLURMD_NODENAME={node}".encode(),
    ]
    for pid in run_pids(run):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ptops.ops.node.agent" in cmd and all(w in env for w in want):
            return pid
    raise AssertionError(f"no node agent of attempt {attempt} on {node}")


def gone(pid: int, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
            if stat[stat.rindex(b")") + 2 :][:1] in (b"Z", b"X"):
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def reference_digest(faulted_runs):
    ref = faulted_runs.get("reference")
    assert ref.proc.returncode == 0, ref.proc.stderr
    return digest(ref.run, cli=True)


def test_crash_on_node_2_restarts_in_job_and_ends_digest_equal(
    slurm_cluster, tmp_path, reference_digest
):
    """Through sbatch on 2 nodes: rank 1 (node n2) SIGKILLs itself at step 12 -> a new srun step in
    the same allocation (no requeue), completed, digest equal to the local 2-rank run; status shows
    the job. Both agents go through a relay on n1 (``[slurm] relay_every = 2``; the other tests
    here keep every agent straight to the supervisor): blame, restart and digest are the same."""
    run = tmp_path / "run"
    job = submit(
        slurm_cluster,
        run,
        "--fault",
        "crash:rank=1,step=12",
        "--fault",
        "hold:step=12,until=committed,seconds=120",
        "--set",
        "slurm.relay_every=2",
    )
    wait_for(slurm_cluster, run, job, lambda evs: held(evs, 1), "both ranks running")
    st = status(run)
    assert {r["host"] for r in st["ranks"]} == {"n1", "n2"}, st  # one rank per node, really on both
    shown = run_ptops("status", str(run), "--json", env=slurm_cluster.env)
    assert shown.returncode == 0, shown.stderr
    sj = json.loads(shown.stdout)
    assert sj["slurm"]["job_id"] == job and sj["slurm"]["nodes"] == ["n1", "n2"], sj.get("slurm")
    text = run_ptops("status", str(run), env=slurm_cluster.env)
    assert f"slurm job {job}" in text.stdout and "n1,n2" in text.stdout, text.stdout
    wait_job_gone(slurm_cluster, job)
    evs = events(run)
    kinds = [e["kind"] for e in evs]
    assert kinds[-1] == "completed", job_output(run)[-3000:]
    crash = events(run, "crash")
    assert len(crash) == 1 and crash[0]["rank"] == 1 and crash[0]["host"] == "n2", crash
    launches = events(run, "launch")
    assert [e["attempt"] for e in launches] == [1, 2] and {e["job_id"] for e in launches} == {job}
    assert (
        len(events(run, "slurm_allocation")) == 1
    )  # restarted inside the allocation, not requeued
    assert events(run, "node_blamed")[0]["node"] == "n2"  # one strike (limit 2): same nodes again
    assert not events(run, "node_replaced")
    assert digest(run) == reference_digest
    assert run_pids(run) == []
    # each attempt's agents went through a relay on n1 (the agents' log: the attempt's srun output)
    for attempt in (1, 2):
        log = (run / "logs" / f"attempt-{attempt}" / "torchrun.log").read_text(errors="replace")
        assert "[ptops.node n1] relaying the agents of n1's group" in log, log[-2000:]


def test_hang_on_node_2_stacks_from_its_agent_then_agent_killed_restarts(
    slurm_cluster, tmp_path, reference_digest
):
    """Attempt 1: rank 1 on n2 SIGSTOPped -> hang found, its stacks taken by n2's node agent (py-spy
    there). Attempt 2: n2's node agent SIGKILLed -> its rank dies with it, the attempt restarts.
    Attempt 3 completes digest-equal."""
    run = tmp_path / "run"
    # kill_timeout_s=10: the supervisor's own teardown (which would kill every rank of the run)
    # waits that long after the agent's connection drops, so a rank gone before then went with its
    # agent
    job = submit(
        slurm_cluster,
        run,
        "--set",
        "slurm.node_strikes=5",
        "--set",
        "supervisor.kill_timeout_s=10",
        "--fault",
        "hold:step=8",
        "--fault",
        "hold:step=8,attempt=2",
    )
    wait_for(slurm_cluster, run, job, lambda evs: held(evs, 1), "attempt 1 held")
    victim = next(r for r in status(run)["ranks"] if r["rank"] == 1)
    assert victim["host"] == "n2"
    os.kill(victim["pid"], signal.SIGSTOP)
    release(slurm_cluster, run)
    hang = wait_for(
        slurm_cluster, run, job, lambda evs: [e for e in evs if e["kind"] == "hang"], "the hang"
    )[0]
    assert hang["ranks"] == [1], hang
    # one file a node, a section a rank (the agent gathered them)
    node_file = (run / "stacks" / "attempt-1" / "node-n2.txt").read_text()
    stack = node_sections(node_file)[1]
    assert stack.startswith("# source: node agent n2: py-spy"), stack[:300]
    assert node_sections((run / "stacks" / "attempt-1" / "node-n1.txt").read_text())[0]
    assert not list((run / "stacks" / "attempt-1").glob("rank-*.txt"))
    assert "Thread" in stack or "File" in stack or "(" in stack
    assert hang["stack_sources"]["1"].startswith("node agent n2")

    wait_for(slurm_cluster, run, job, lambda evs: held(evs, 2), "attempt 2 held")
    ranks = {r["rank"]: r for r in status(run)["ranks"]}
    agent = agent_pid(run, 2, "n2")
    os.kill(agent, signal.SIGKILL)
    assert gone(ranks[1]["pid"]), "rank 1 outlived its node agent"
    rank1_gone = time.time()
    wait_job_gone(slurm_cluster, job)
    evs = events(run)
    assert evs[-1]["kind"] == "completed", job_output(run)[-3000:]
    crash = [e for e in events(run, "crash") if e["attempt"] == 2]
    assert crash and crash[0]["rank"] == 1, events(run, "crash")
    assert rank1_gone < crash[0]["ts"] - 5, (
        "rank 1 died in the supervisor's teardown, not with its agent"
    )
    assert [e["attempt"] for e in events(run, "launch")] == [1, 2, 3]
    assert digest(run) == reference_digest
    assert run_pids(run) == []


def test_link_down_blames_the_node_and_a_spare_replaces_it(
    slurm_cluster, tmp_path, reference_digest
):
    """3 nodes for 2 (--spare-nodes 1), one strike: n2's link set down while held -> its rank is
    silent (found within the hang budget), n2 blamed and replaced by n3; the run ends
    digest-equal."""
    run = tmp_path / "run"
    job = submit(
        slurm_cluster,
        run,
        "--spare-nodes",
        "1",
        "--set",
        "slurm.node_strikes=1",
        "--set",
        "slurm.upstream_timeout_s=6",
        "--fault",
        "hold:step=8",
    )
    wait_for(slurm_cluster, run, job, lambda evs: held(evs, 1), "attempt 1 held")
    alloc = events(run, "slurm_allocation")[0]
    assert alloc["nodes"] == ["n1", "n2", "n3"] and alloc["spares"] == ["n3"], alloc
    cut_at = time.time()
    slurm_cluster.link("n2", up=False)
    try:
        replaced = wait_for(
            slurm_cluster,
            run,
            job,
            lambda evs: [e for e in evs if e["kind"] == "node_replaced"],
            "the node replaced",
        )[0]
    finally:
        slurm_cluster.link("n2", up=True)
    assert replaced["node"] == "n2" and replaced["by"] == "n3", replaced
    hang = events(run, "hang")[0]
    assert hang["ranks"] == [1] and hang["found_ts"] - cut_at <= hang["timeout_s"] + 2.0, hang
    assert events(run, "node_blamed")[0]["node"] == "n2"
    second = wait_for(
        slurm_cluster,
        run,
        job,
        lambda evs: [e for e in evs if e["kind"] == "launch" and e["attempt"] == 2],
        "attempt 2",
    )
    assert second[0]["nodes"] == ["n1", "n3"], second
    wait_job_gone(slurm_cluster, job)
    assert events(run)[-1]["kind"] == "completed", job_output(run)[-3000:]
    assert digest(run) == reference_digest
    slurm_cluster.resume("n2")


def test_a_node_failing_its_health_checks_is_replaced_before_any_rank_starts(
    slurm_cluster, tmp_path, reference_digest
):
    """3 nodes for 2 (--spare-nodes 1). On n2 alone the checkpoint directory is a 1 MiB tmpfs (its
    mount namespace: a node whose mount went wrong) and its clock reads 30 s ahead (clock-skew):
    the check step before attempt 1 runs on all three, n2 fails both checks, n3 passed and takes
    its place; no rank ever starts on n2; the run ends digest-equal; diagnose names n2 and the
    checks."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    slurm_cluster.mount_tmpfs("n2", run / "checkpoints", "1m")
    try:
        job = submit(slurm_cluster, run, "--spare-nodes", "1", "--fault", "clock-skew:node=n2")
        wait_job_gone(slurm_cluster, job)
    finally:
        slurm_cluster.umount("n2", run / "checkpoints")
    assert events(run)[-1]["kind"] == "completed", job_output(run)[-3000:]
    hc = events(run, "health_check")
    assert hc[0]["attempt"] == 1 and hc[0]["nodes"] == ["n1", "n2", "n3"], hc[0]
    assert hc[0]["failed_nodes"] == {"n2": ["checkpoint_space", "clock_skew"]}, hc[0]
    space = next(
        c for c in hc[0]["checks"] if c["node"] == "n2" and c["name"] == "checkpoint_space"
    )
    assert space["detail"].split(" MB free")[0] in ("0", "1"), space  # the 1 MiB tmpfs, not /tmp
    replaced = events(run, "node_replaced")
    assert [(e["attempt"], e["node"], e["by"]) for e in replaced] == [(1, "n2", "n3")]
    assert [e["nodes"] for e in events(run, "launch")] == [["n1", "n3"]]
    assert all(e["ok"] for e in hc[1:])  # later attempts, if any, on healthy nodes
    assert digest(run) == reference_digest
    diag = run_ptops("diagnose", str(run), "--json")
    inc = [i for i in json.loads(diag.stdout)["incidents"] if i["kind"] == "health"]
    assert len(inc) == 1 and inc[0]["host"] == "n2", inc
    assert inc[0]["action"] == "replaced by spare n3 before attempt 1"
    assert inc[0]["runbook"] == "NodeUnhealthy" and "clock_skew" in inc[0]["title"]


def test_a_node_that_cannot_reach_the_batch_node_is_replaced_before_any_rank_starts(
    slurm_cluster, tmp_path, reference_digest
):
    """n2 has no route to n1 (the batch node: the supervisor, the rendezvous): the check step
    cannot even start on n2, so n2 has no report and fails ``report``; the spare n3 takes its
    place and the run ends digest-equal."""
    run = tmp_path / "run"
    slurm_cluster.unreachable("n2", "n1")
    try:
        job = submit(slurm_cluster, run, "--spare-nodes", "1")
        wait_job_gone(slurm_cluster, job)
    finally:
        slurm_cluster.unreachable("n2", "n1", cut=False)
    assert events(run)[-1]["kind"] == "completed", job_output(run)[-3000:]
    hc = events(run, "health_check")[0]
    assert hc["failed_nodes"] == {"n2": ["report"]}, hc
    (miss,) = [c for c in hc["checks"] if c["node"] == "n2"]
    assert miss["detail"].startswith("no report from n2"), miss
    assert [e["nodes"] for e in events(run, "launch")] == [["n1", "n3"]]
    assert digest(run) == reference_digest


def test_preemption_saves_requeues_and_resumes_exactly(slurm_cluster, tmp_path, reference_digest):
    """Slurm's warning signal (what --signal=B:USR1@S sends, here at once with scancel --batch):
    every rank saves at the next step boundary, the job requeues itself, the rerun resumes from that
    save."""
    run = tmp_path / "run"
    job = submit(slurm_cluster, run, "--fault", "hold:step=7")
    wait_for(slurm_cluster, run, job, lambda evs: held(evs, 1), "attempt 1 held")
    out = slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)
    assert out.returncode == 0, out.stderr
    wait_for(
        slurm_cluster,
        run,
        job,
        lambda evs: [e for e in evs if e["kind"] == "completed"],
        "completion",
    )
    wait_job_gone(slurm_cluster, job)
    pre = events(run, "preempted")
    assert len(pre) == 1 and pre[0]["saved_step"] == 7, pre  # the step boundary after the hold
    rq = events(run, "slurm_requeue")
    assert rq and rq[0]["how"] == "requeue" and rq[0]["job_id"] == job
    allocs = events(run, "slurm_allocation")
    assert [a["restart_count"] for a in allocs] == [0, 1], (
        allocs
    )  # SLURM_RESTART_COUNT in the rerun
    launches = events(run, "launch")
    assert [e["attempt"] for e in launches] == [1, 2] and launches[1]["from_step"] == 7, launches
    assert not events(run, "crash") and not events(run, "restart")
    assert digest(run) == reference_digest


def test_world_of_one_is_caught_at_startup_and_scancel_leaves_nothing(slurm_cluster, tmp_path):
    """A rank that formed a world of one (rendezvous fell back to localhost) stops the attempt with
    one line; then a held job scancelled leaves no process of its run on any node."""
    run = tmp_path / "one"
    job = submit(slurm_cluster, run, "--fault", "misrendezvous:rank=1")
    wait_job_gone(slurm_cluster, job)
    mis = events(run, "misconfigured")
    assert len(mis) == 1 and mis[0]["world_size"] == 1 and mis[0]["expected_world_size"] == 2, mis
    assert mis[0]["host"] == "n2"
    assert events(run)[-1]["kind"] == "failed" and len(events(run, "launch")) == 1
    assert "world of one" in job_output(run)

    run2 = tmp_path / "cancel"
    job2 = submit(slurm_cluster, run2, "--fault", "hold:step=3")
    wait_for(slurm_cluster, run2, job2, lambda evs: held(evs, 1), "attempt 1 held")
    assert len(run_pids(run2)) >= 4  # srun, agents, torchruns, ranks
    out = slurm_cluster.run("scancel", job2)
    assert out.returncode == 0, out.stderr
    wait_job_gone(slurm_cluster, job2)
    deadline = time.monotonic() + 30
    while run_pids(run2) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run_pids(run2) == []
    left = subprocess.run(
        ["pgrep", "-f", "ptops.ops.slurm.inside " + str(run2)], capture_output=True, text=True
    )
    assert left.stdout.strip() == ""
