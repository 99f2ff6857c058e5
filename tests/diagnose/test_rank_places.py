"""Where each rank is at a hang (``diagnostics/stacks.py``: ``classify``), from its stacks in the
forms ptops stores them (the rank's own dump, ``py-spy dump --locals``, py-spy's ``--native``
and ``--json``, faulthandler), and ``ptops diagnose`` of a hang: every rank's place in the text,
JSON and HTML; "wait in a collective" said only of ranks whose stacks are in one; a
flight-recorder analysis that fails (torch <= 2.11's ``gloo != 'nccl'`` assertion) and a py-spy
that fails are notes about the collection, not evidence, a title or a finding.

The stacks are written here the way ``ops/rank/probe.py`` (``dump_stacks``) and py-spy write them,
paths as on this machine's venv; the DDP one is the shape of a real false hang seen under ptops
(rank 0 in its forward, rank 1 in backward waiting for rank 0's gradients).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from ptops.diagnostics import stacks

SP = "/home/u/venv/lib/python3.11/site-packages"
PY = "/usr/lib/python3.11"
TRAIN = "/home/u/proj/train.py"

# the rank's own dump (traceback.format_stack of each thread), under ptops' script engine
_ENTRY = f"""\
# source: channel (the rank's own dump)
# pid 5478 host vm at 2026-12-07T16:24:55

Thread 0x7f99c3655b80 "MainThread" (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/home/u/ptops/ops/rank/entry.py", line 117, in run_rank
    entry_point(recipe.engine)(recipe, probe)
  File "/home/u/ptops/recipes/script/run.py", line 104, in _run_python
    runpy.run_path(path, run_name="__main__")
  File "<frozen runpy>", line 291, in run_path
  File "{TRAIN}", line 80, in <module>
    main()
"""
_PROBE_THREAD = f"""
Thread 0x7f99bbfff6c0 "ptops-probe-ping" (most recent call last):
  File "{PY}/threading.py", line 1002, in _bootstrap
    self._bootstrap_inner()
  File "/home/u/ptops/ops/rank/probe.py", line 336, in _ping_loop
    time.sleep(every)
"""


def _tb(*frames: tuple[str, int, str, str]) -> str:
    """A channel dump: the entry frames, then (file, line, function, source line) outermost
    first, then a probe thread."""
    body = "".join(f'  File "{f}", line {n}, in {fn}\n    {code}\n' for f, n, fn, code in frames)
    return _ENTRY + body + _PROBE_THREAD


FORWARD_DDP = _tb(
    (TRAIN, 70, "main", "train_step(model, opt, batch)"),
    (TRAIN, 42, "train_step", "loss = model(x).pow(2).mean()"),
    (f"{SP}/torch/nn/modules/module.py", 1778, "_wrapped_call_impl", "return self._call_impl()"),
    (f"{SP}/torch/nn/modules/module.py", 1789, "_call_impl", "return forward_call()"),
    (f"{SP}/torch/nn/parallel/distributed.py", 1890, "forward", "self._run_ddp_forward()"),
    (f"{SP}/torch/nn/parallel/distributed.py", 1715, "_run_ddp_forward", "return self.module()"),
    (f"{SP}/torch/nn/modules/module.py", 1778, "_wrapped_call_impl", "return self._call_impl()"),
    (f"{SP}/torch/nn/modules/module.py", 1789, "_call_impl", "return forward_call()"),
    (TRAIN, 21, "forward", "h = self.block(x)"),
    (f"{SP}/torch/nn/modules/module.py", 1778, "_wrapped_call_impl", "return self._call_impl()"),
    (f"{SP}/torch/nn/modules/module.py", 1789, "_call_impl", "return forward_call()"),
    (f"{SP}/torch/nn/modules/linear.py", 134, "forward", "return F.linear(input, self.weight)"),
)

# backward as the rank's own dump shows it when DDP's all-reduce runs in C++: backward
BACKWARD_PLAIN = _tb(
    (TRAIN, 70, "main", "train_step(model, opt, batch)"),
    (TRAIN, 43, "train_step", "loss.backward()"),
    (f"{SP}/torch/_tensor.py", 623, "backward", "torch.autograd.backward("),
    (f"{SP}/torch/autograd/__init__.py", 395, "backward", "_engine_run_backward("),
    (f"{SP}/torch/autograd/graph.py", 979, "_engine_run_backward", "return Variable._exec()"),
)

# py-spy --locals of a rank whose DDP communication hook (allreduce_hook) waits in all_reduce
BACKWARD_DDP_HOOK_PYSPY = textwrap.dedent("""\
    # source: node agent vm: py-spy dump --nonblocking
    Process 5479: python -m ptops.ops.rank.entry
    Python v3.11.7 (/usr/bin/python3.11)

    Thread 5479 (idle): "MainThread"
        all_reduce (torch/distributed/distributed_c10d.py:2940)
            Arguments:
                tensor: <Tensor at 0x7f1b0e8dead0>
        wrapper (torch/distributed/c10d_logger.py:81)
        _allreduce_fut (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py:26)
        allreduce_hook (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py:59)
        _engine_run_backward (torch/autograd/graph.py:979)
        backward (torch/autograd/__init__.py:395)
        Tensor.backward (torch/_tensor.py:623)
        train_step (train.py:43)
            Locals:
                loss: <Tensor at 0x7f1b0e8de000>
        main (train.py:70)
        <module> (train.py:80)
        _run_code (<frozen runpy>:88)
        run_path (<frozen runpy>:291)
        _run_python (recipes/script/run.py:104)
        run_rank (ops/rank/entry.py:117)
    Thread 5490 (idle): "ptops-probe-ping"
        _ping_loop (ops/rank/probe.py:336)
        run (threading.py:982)
    """)

# py-spy --native (blocking): the gradient all-reduce in C++ under the autograd engine
BACKWARD_NATIVE_PYSPY = textwrap.dedent("""\
    # source: node agent vm: py-spy dump --native
    Thread 5479 (idle): "MainThread"
        __futex_abstimed_wait_common (libc.so.6)
        std::condition_variable::wait (libstdc++.so.6)
        c10d::ProcessGroupGloo::AsyncWork::wait (libtorch_cpu.so)
        c10d::Reducer::finalize_backward (libtorch_cpu.so)
        torch::autograd::Engine::execute (libtorch_cpu.so)
        _engine_run_backward (torch/autograd/graph.py:979)
        backward (torch/autograd/__init__.py:395)
        Tensor.backward (torch/_tensor.py:623)
        train_step (train.py:43)
        main (train.py:70)
        <module> (train.py:80)
    """)

# the main process waits for a DataLoader worker's batch
DATA_WAIT = _tb(
    (TRAIN, 66, "main", "for batch in loader:"),
    (f"{SP}/torch/utils/data/dataloader.py", 741, "__next__", "data = self._next_data()"),
    (f"{SP}/torch/utils/data/dataloader.py", 1456, "_next_data", "idx, data = self._get_data()"),
    (f"{SP}/torch/utils/data/dataloader.py", 1412, "_get_data", "success, data = self._try()"),
    (f"{SP}/torch/utils/data/dataloader.py", 1256, "_try_get_data", "data = self._q.get()"),
    (f"{PY}/multiprocessing/queues.py", 113, "get", "if not self._poll(timeout):"),
    (f"{PY}/multiprocessing/connection.py", 257, "poll", "return self._poll(timeout)"),
    (f"{PY}/selectors.py", 415, "select", "fd_event_list = self._selector.poll(timeout)"),
)

# a Dataset's __getitem__ in the main process (num_workers=0)
DATA_GETITEM = _tb(
    (TRAIN, 66, "main", "for batch in loader:"),
    (f"{SP}/torch/utils/data/dataloader.py", 741, "__next__", "data = self._next_data()"),
    (f"{SP}/torch/utils/data/dataloader.py", 801, "_next_data", "data = self._fetcher.fetch()"),
    (f"{SP}/torch/utils/data/_utils/fetch.py", 52, "fetch", "data = [self.dataset[i] for i]"),
    (TRAIN, 30, "__getitem__", "tokens = self.tok(self.rows[i])"),
)

OPTIMIZER = _tb(
    (TRAIN, 70, "main", "train_step(model, opt, batch)"),
    (TRAIN, 47, "train_step", "opt.step()"),
    (f"{SP}/torch/optim/optimizer.py", 526, "wrapper", "out = func(*args, **kwargs)"),
    (f"{SP}/torch/optim/optimizer.py", 81, "_use_grad", "ret = func(self, *args, **kwargs)"),
    (f"{SP}/torch/optim/adamw.py", 231, "step", "adamw("),
    (f"{SP}/torch/optim/adamw.py", 780, "_multi_tensor_adamw", "torch._foreach_lerp_()"),
)

TORCH_SAVE = _tb(
    (TRAIN, 74, "main", "save_snapshot(model, opt, epoch)"),
    (TRAIN, 55, "save_snapshot", "torch.save(snapshot, path)"),
    (f"{SP}/torch/serialization.py", 967, "save", "_save("),
    (f"{SP}/torch/serialization.py", 1213, "_save", "zip_file.write_record(name, storage)"),
)

SLEEP = _tb(
    (TRAIN, 77, "main", "time.sleep(30)"),
)

# a forward in a @torch.no_grad() evaluation function
EVAL = _tb(
    (TRAIN, 78, "main", "evaluate(model, val_loader)"),
    (f"{SP}/torch/utils/_contextlib.py", 120, "decorate_context", "return func(*args, **kwargs)"),
    (TRAIN, 60, "evaluate", "out = model(x)"),
    (f"{SP}/torch/nn/modules/module.py", 1778, "_wrapped_call_impl", "return self._call_impl()"),
    (f"{SP}/torch/nn/modules/module.py", 1789, "_call_impl", "return forward_call()"),
    (TRAIN, 21, "forward", "h = self.block(x)"),
)

# faulthandler's dump (SIGUSR1 file): innermost first, no thread names
FAULTHANDLER = textwrap.dedent(f"""\
    Thread 0x00007f99bbfff6c0 (most recent call first):
      File "{PY}/threading.py", line 331 in wait
      File "/home/u/ptops/ops/rank/probe.py", line 336 in _ping_loop
      File "{PY}/threading.py", line 1002 in _bootstrap

    Current thread 0x00007f99c3655b80 (most recent call first):
      File "{SP}/torch/optim/adamw.py", line 780 in _multi_tensor_adamw
      File "{SP}/torch/optim/adamw.py", line 231 in step
      File "{SP}/torch/optim/optimizer.py", line 526 in wrapper
      File "{TRAIN}", line 47 in train_step
      File "{TRAIN}", line 70 in main
      File "{TRAIN}", line 80 in <module>
    """)


@pytest.mark.parametrize(
    "text, place, within, user",
    [
        (FORWARD_DDP, "forward", None, "proj/train.py:21 in forward"),
        (BACKWARD_PLAIN, "backward", None, "proj/train.py:43 in train_step"),
        (BACKWARD_DDP_HOOK_PYSPY, "collective", "backward", "train.py:43 in train_step"),
        (BACKWARD_NATIVE_PYSPY, "collective", "backward", "train.py:43 in train_step"),
        (DATA_WAIT, "data", None, "proj/train.py:66 in main"),
        (DATA_GETITEM, "data", None, "proj/train.py:30 in __getitem__"),
        (OPTIMIZER, "optimizer", None, "proj/train.py:47 in train_step"),
        (TORCH_SAVE, "checkpoint", None, "proj/train.py:55 in save_snapshot"),
        (SLEEP, "sleep", None, "proj/train.py:77 in main"),
        (EVAL, "eval", None, "proj/train.py:21 in forward"),
        (FAULTHANDLER, "optimizer", None, "proj/train.py:47 in train_step"),
    ],
    ids=[
        "forward-ddp",
        "backward",
        "ddp-hook-allreduce",
        "native-reducer",
        "dataloader-wait",
        "getitem",
        "optimizer",
        "torch-save",
        "sleep",
        "eval-no-grad",
        "faulthandler",
    ],
)
def test_place_and_user_frame(text, place, within, user):
    s = stacks.parse(text, 1)
    p = s.place
    assert p is not None and (p.place, p.within) == (place, within), (p, s.frames)
    assert p.user is not None and p.user.where == user, p
    assert s.in_collective == (place == "collective")
    words = str(p)
    assert words.startswith(place + (f" in {within}" if within else "")) and user in words


def test_plain_python_and_the_probe_thread_is_not_the_rank():
    """A loop in user code is "python"; the probe's own thread (sleeping in its ping loop) never
    stands for the rank: the main thread is read."""
    s = stacks.parse(_tb((TRAIN, 90, "main", "while not done(): x += 1")), 0)
    assert s.place.place == "python" and s.place.user.where == "proj/train.py:90 in main"


def test_py_spy_json_form_reads_as_the_text_form():
    threads = [
        {"thread_name": "ptops-probe-ping", "active": False, "frames": []},
        {
            "thread_name": "MainThread",
            "active": False,
            "frames": [
                {"name": "M.forward", "filename": TRAIN, "short_filename": "train.py", "line": 21},
                {
                    "name": "Module._call_impl",
                    "filename": f"{SP}/torch/nn/modules/module.py",
                    "short_filename": "torch/nn/modules/module.py",
                    "line": 1789,
                },
                {"name": "train_step", "filename": TRAIN, "short_filename": "train.py", "line": 42},
            ],
        },
    ]
    s = stacks.parse("# source: node agent vm: py-spy dump --json\n" + json.dumps(threads), 0)
    assert s.place.place == "forward" and s.place.user.where == "proj/train.py:21 in forward"
    assert s.state == "idle"


# --- ptops diagnose of a hang's run directory -----------------------------------------------------

T0 = 1_800_000_000.0
GLOO_ASSERT = "name formatting error? gloo != 'nccl' or 'xccl'"
PYSPY_ERR = "py-spy failed (1): Error: Failed to find python version from target process"


def _hang_run(tmp_path: Path) -> Path:
    """A run directory as the supervisor leaves it after a false hang of a plain DDP script:
    events.jsonl (launch, hang with its stack_sources, failed), one node file of stacks (rank 0
    in its forward, rank 1 in backward, rank 2 whose py-spy failed) and the ranks' gloo
    flight-recorder dumps."""
    import pickle

    run = tmp_path / "run"
    sd = run / "stacks" / "attempt-1"
    sd.mkdir(parents=True)
    sources = {"0": "channel", "1": "channel", "2": f"node agent vm: {PYSPY_ERR}"}
    events = [
        {"ts": T0, "kind": "launch", "attempt": 1, "nproc": 3, "from_step": 0},
        {
            "ts": T0 + 30,
            "kind": "hang",
            "attempt": 1,
            "ranks": [0, 1, 2],
            "step": 5,
            "silent_s": 12.0,
            "phase": "step",
            "timeout_s": 12.0,
            "stacks": str(sd),
            "stack_sources": sources,
        },
        {"ts": T0 + 31, "kind": "failed", "reason": "gave up after 0 restarts", "attempt": 1},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    node = (
        "#### rank 0 ####\n"
        + FORWARD_DDP
        + "\n#### rank 1 ####\n"
        + BACKWARD_PLAIN
        + f"\n#### rank 2 ####\n# no stack: node agent vm: {PYSPY_ERR}\n"
    )
    (sd / "node-vm.txt").write_text(node)
    for r, seq in ((0, 10), (1, 11)):
        entry = {
            "process_group": ("0", "default_pg"),
            "pg_id": 0,
            "collective_seq_id": seq,
            "profiling_name": "gloo:all_reduce",
            "state": "scheduled",
        }
        dump = {"entries": [entry], "version": "2.10", "pg_config": {"": {"ranks": "[]"}}}
        (sd / f"rank-{r}.flight_recorder").write_bytes(pickle.dumps(dump))
    return run


@pytest.fixture
def torch_2_11_analyser(monkeypatch):
    """torch <= 2.11's flight-recorder analyser: gloo dumps fail its assertion that the backend
    is NCCL (``Op.__init__``), raised out of ``build_db``."""
    from torch.distributed.flight_recorder.components import builder

    def build_db(*a, **k):
        raise AssertionError(GLOO_ASSERT)

    monkeypatch.setattr(builder, "build_db", build_db)


def _report(run: Path, capsys, *args: str) -> str:
    from ptops.ops.cli.diagnose import main

    assert main([str(run), *args]) == 0
    return capsys.readouterr().out


def test_diagnose_says_each_ranks_place(tmp_path, capsys, torch_2_11_analyser):
    run = _hang_run(tmp_path)
    rep = json.loads(_report(run, capsys, "--json"))
    (inc,) = [i for i in rep["incidents"] if i["kind"] == "hang"]
    groups = {tuple(g["ranks"]): g for g in inc["details"]["stacks"]["groups"]}
    assert groups[(0,)]["place"] == "forward" and groups[(1,)]["place"] == "backward"
    assert groups[(0,)]["user_frame"] == "proj/train.py:21 in forward"
    assert groups[(1,)]["user_frame"] == "proj/train.py:43 in train_step"
    assert groups[(2,)]["place"] is None
    # nobody's stack is in a collective: the title does not say the others wait in one
    assert inc["rank"] == 0, inc["title"]
    assert "wait in a collective" not in inc["title"]
    assert "forward (proj/train.py:21 in forward)" in inc["title"]
    assert "rank(s) 1: backward (proj/train.py:43 in train_step)" in inc["title"]
    assert "rank(s) 0: forward (proj/train.py:21 in forward) [channel" in "\n".join(inc["evidence"])
    text = _report(run, capsys)
    assert "rank(s) 1: backward (proj/train.py:43 in train_step)" in text
    out = tmp_path / "report.html"
    _report(run, capsys, "--html", str(out))
    page = out.read_text()
    assert "rank(s) 1: backward (proj/train.py:43 in train_step)" in page


def test_collection_errors_are_notes_not_findings(tmp_path, capsys, torch_2_11_analyser):
    run = _hang_run(tmp_path)
    rep = json.loads(_report(run, capsys, "--json"))
    (inc,) = [i for i in rep["incidents"] if i["kind"] == "hang"]
    said = [inc["title"], *inc["evidence"]] + [f["detail"] for f in rep["findings"]]
    assert not [x for x in said if "gloo != 'nccl'" in x or "AssertionError" in x], said
    assert not [x for x in [inc["title"], *inc["evidence"]] if "py-spy failed" in x], said
    # the flight recorder's error stays in its details, and is told as a note on the collection
    assert GLOO_ASSERT in inc["details"]["flight_recorder"]["error"]
    notes = inc["details"]["collection_notes"]
    assert any(n.startswith("flight recorder: not available with gloo") for n in notes), notes
    assert any(n.startswith("stacks of rank(s) 2: ") and "py-spy failed" in n for n in notes)
    assert any("rank(s) 2: no stack (its dump failed" in e for e in inc["evidence"])
    text = _report(run, capsys)
    assert "note: flight recorder: not available with gloo" in text
    assert "gloo != 'nccl'" not in text
    out = tmp_path / "report.html"
    _report(run, capsys, "--html", str(out))
    page = out.read_text()
    assert "note: flight recorder: not available with gloo" in page
    assert "gloo != &#x27;nccl&#x27;" not in page and "gloo != 'nccl'" not in page


def test_others_in_a_collective_are_said_to_wait_in_one(tmp_path, capsys):
    """The title keeps "while the others wait in a collective" where it is true: rank 0 in its
    forward, ranks 1-2 in DDP's gradient all-reduce (py-spy and native stacks)."""
    run = _hang_run(tmp_path)
    node = (
        "#### rank 0 ####\n"
        + FORWARD_DDP
        + "\n#### rank 1 ####\n"
        + BACKWARD_DDP_HOOK_PYSPY
        + "\n#### rank 2 ####\n"
        + BACKWARD_NATIVE_PYSPY
    )
    sd = run / "stacks" / "attempt-1"
    (sd / "node-vm.txt").write_text(node)
    for p in sd.glob("*.flight_recorder"):
        p.unlink()
    rep = json.loads(_report(run, capsys, "--json"))
    (inc,) = [i for i in rep["incidents"] if i["kind"] == "hang"]
    assert inc["rank"] == 0
    assert inc["title"].endswith(
        "rank 0 stuck in forward (proj/train.py:21 in forward) while the others wait in a "
        "collective (in backward)"
    ), inc["title"]
    assert inc["details"]["collection_notes"] == []


def test_a_rank_in_backward_is_not_named_before_one_in_its_forward(tmp_path, capsys):
    """Both ranks silent (the hang event names both): rank 1 in its forward is the one rank 0,
    in backward (DDP's gradient all-reduce), waits for."""
    run = _hang_run(tmp_path)
    sd = run / "stacks" / "attempt-1"
    (sd / "node-vm.txt").write_text(
        "#### rank 0 ####\n" + BACKWARD_PLAIN + "\n#### rank 1 ####\n" + FORWARD_DDP
    )
    for p in sd.glob("*.flight_recorder"):
        p.unlink()
    rep = json.loads(_report(run, capsys, "--json"))
    (inc,) = [i for i in rep["incidents"] if i["kind"] == "hang"]
    assert inc["rank"] == 1 and inc["details"]["stacks"]["odd"]["place"] == "forward"
    assert (
        "rank 1 stuck in forward (proj/train.py:21 in forward); rank(s) 0: backward"
        in (inc["title"])
    )
