"""Install tells the truth (issue 47, point 4): what ``--help`` and ``ptops launch`` say about the
engines and the torch they need, the index report of ``scripts/matrix.py``, and a launch from a
directory that holds a folder named ``ptops`` with ptops installed from its wheel (not editable).

A missing engine is simulated by ``sys.modules[name] = None``: ``importlib.util.find_spec`` then
answers None, as it does where the package is not installed (the project venv has them all).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from conftest import REPO
from helpers import source_tree
from packaging.requirements import Requirement

from ptops.ops.cli import installcheck

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PTOPS_MLFLOW": "0"}


def _cli(args: list[str], hide: tuple[str, ...] = (), cwd: Path | None = None):
    """``ptops ARGS`` in a subprocess with the modules ``hide`` not installed."""
    code = (
        "import sys\n"
        f"for m in {list(hide)!r}: sys.modules[m] = None\n"
        f"sys.argv = ['ptops', *{args!r}]\n"
        "from ptops.ops.cli.app import main\n"
        "main()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
        cwd=cwd or REPO,
    )


# ------------------------------------------------------------------ engines installed
def test_help_names_only_the_engines_whose_packages_import():
    got = _cli(["--help"], hide=("torchtitan",))
    assert got.returncode == 0, got.stderr
    text = " ".join(got.stdout.split())
    assert "titan (not installed: pip install 'ptops[titan]')" in text, text[-400:]
    assert "script, titan (not installed" in text and "trl (ptops)" in text  # trl is there
    # and where everything is installed, nothing is flagged
    full = " ".join(_cli(["--help"]).stdout.split())
    assert "Engines installed: script, titan, trl (ptops)" in full and "not installed" not in full


def test_help_stays_light():
    """``--help`` decides from find_spec and metadata: torch, trl and torchtitan stay unimported."""
    code = (
        "import sys\nsys.argv = ['ptops', '--help']\nfrom ptops.ops.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print([m for m in ('torch', 'trl', 'torchtitan', 'transformers') if m in sys.modules])"
    )
    got = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=REPO
    )
    assert got.stdout.strip().splitlines()[-1] == "[]", got.stdout[-500:] + got.stderr[-500:]


def test_launch_without_the_engine_fails_at_once_with_one_line(tmp_path):
    run = tmp_path / "run"
    got = _cli(["launch", "titan-tiny", "--run-dir", str(run)], hide=("torchtitan",))
    assert got.returncode == 4, got.stdout[-1000:] + got.stderr[-1000:]  # misconfigured
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1, got.stderr
    line = lines[0]
    assert line.startswith("error: recipe titan-tiny runs on TorchTitan, which is not installed")
    assert "pip install 'ptops[titan]'" in line
    torch_range = installcheck.torch_range("titan")
    assert torch_range == ">=2.13.0,<2.16"  # pyproject.toml's [titan] torch, lower bound first
    assert f"[titan] needs torch{torch_range}" in line
    assert f"this environment has torch {installcheck.installed_version('torch')}" in line
    assert not run.exists(), "nothing of the run may start"
    # the dry run refuses the same way (it would build TorchTitan's model)
    dry = _cli(["launch", "titan-tiny", "--dry-run"], hide=("torchtitan",))
    assert dry.returncode == 4 and "pip install 'ptops[titan]'" in dry.stderr


def test_a_torch_outside_the_extras_range_is_said_in_one_line(monkeypatch):
    real = installcheck.installed_version
    monkeypatch.setattr(
        installcheck,
        "installed_version",
        lambda d: "2.11.0+cu130" if d == "torch" else real(d),
    )
    warn = installcheck.range_warning("titan")
    assert warn is not None and "\n" not in warn
    assert "torch 2.11.0+cu130 (needs torch>=2.13.0,<2.16)" in warn
    assert installcheck.range_warning("trl") is None  # [trl] admits 2.11
    assert installcheck.range_warning("script") is None
    # with the engine missing too: what pip would do to that torch
    monkeypatch.setitem(sys.modules, "torchtitan", None)
    line = installcheck.not_installed_line("titan", "titan-tiny")
    assert "this environment has torch 2.11.0+cu130 (pip would replace it" in line
    # the real environment (the lock's torch) lies inside both ranges: no warning
    monkeypatch.setattr(installcheck, "installed_version", real)
    assert installcheck.range_warning("titan") is None and installcheck.range_warning("trl") is None


def test_the_ranges_said_are_pyprojects():
    """What ptops says comes from the installed metadata; it must be pyproject.toml's extras
    (a stale editable install, or a wheel of another checkout, would say other ranges)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra in ("titan", "trl"):
        declared = {
            (r.name.lower(), str(r.specifier))
            for r in map(Requirement, extras[extra])
            if r.name != "ptops"
        }
        said = {(r.name.lower(), str(r.specifier)) for r in installcheck.extra_requirements(extra)}
        assert said == declared, f"[{extra}]: pip install -e . --no-deps to refresh the metadata"
    for engine, (extra, _, modules) in installcheck.ENGINE_EXTRAS.items():
        names = {r.name.lower() for r in installcheck.extra_requirements(extra)}
        assert set(modules) <= names, f"{engine}: {modules} not all in [{extra}]"


# ------------------------------------------------------------------ the matrix's index report
def _matrix():
    spec = importlib.util.spec_from_file_location("matrix", REPO / "scripts" / "matrix.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_index_report_names_a_torch_beyond_the_ranges():
    matrix = _matrix()
    newest = {"torch": "2.16.0", "trl": "1.16.0", "torchtitan": "0.3.0"}  # one beyond the ranges
    lines, rows = matrix.index_report(newest=newest.__getitem__)
    assert len(lines) == 3
    assert "torch 2.16.0" in lines[0] and "OUTSIDE" in lines[0]
    assert "[titan] torch>=2.13.0,<2.16" in lines[0] and "[trl] torch>=2.11.0,<2.16" in lines[0]
    assert "would replace its torch" in lines[0]
    assert "OUTSIDE" not in lines[1] and "OUTSIDE" not in lines[2]
    assert rows[0]["outside"] and not rows[1]["outside"]
    inside = {"torch": "2.14.1", "trl": "1.16.0", "torchtitan": "0.3.0"}
    lines, _ = matrix.index_report(newest=inside.__getitem__)
    assert not any("OUTSIDE" in ln for ln in lines)


def test_index_report_without_network_is_one_line():
    matrix = _matrix()

    def offline(name: str) -> str:
        raise OSError("[Errno -3] Temporary failure in name resolution")

    lines, rows = matrix.index_report(newest=offline)
    assert rows == [] and len(lines) == 1
    assert lines[0].startswith("index: cannot read https://pypi.org/pypi/torch/json")
    # and the command itself exits 0 with that line (a report, not a CI failure)
    got = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "matrix.py"), "--check-index"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**ENV, "https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"},
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip().splitlines() == [got.stdout.strip()], got.stdout
    assert "cannot read" in got.stdout


def test_the_matrix_records_the_next_end():
    """The matrix has the index's newest torch as an end, and the ranges admit it only because it
    ran there: torch 2.15.0 kept as the image had it, TorchTitan imported, the tests passed."""
    results = json.loads((REPO / "bench" / "results" / "matrix.json").read_text())
    nxt = results["next"]
    assert nxt["ok"] is True and nxt["torch_untouched"] and not nxt["dry_run_installs_torch"]
    assert nxt["versions"]["torch"].startswith("2.15") and nxt["titan_imports"]
    assert nxt["counts"]["failed"] == 0 and nxt["counts"]["passed"] > 300
    from packaging.specifiers import SpecifierSet

    for extra in ("titan", "trl"):
        assert nxt["versions"]["torch"] in SpecifierSet(installcheck.torch_range(extra)), extra
    assert "| next |" in (REPO / "bench" / "README.md").read_text()


# ------------------------------------------------------------------ a launch from any directory
@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """ptops from its wheel in a venv of its own, the project venv's other packages (torch, ...)
    reached through a ``.pth`` line (a path only: the editable install's finder there is not run).
    Seconds, not the minutes of tests/install/test_install.py's image (a registry torch)."""
    root = tmp_path_factory.mktemp("truth")
    src = source_tree(root / "src")
    got = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(root / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stdout + got.stderr
    (whl,) = (root / "dist").glob("ptops-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "project-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    got = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps"]
        + ["--no-compile", str(whl)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stdout + got.stderr
    where = subprocess.run(
        [str(py), "-c", "import ptops.ops, pathlib; print(pathlib.Path(ptops.ops.__file__))"],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert where.stdout.strip().startswith(site), where.stdout + where.stderr  # not the checkout
    return py


def test_launch_from_a_directory_holding_a_ptops_folder(installed, tmp_path):
    py = installed
    work = tmp_path / "work"
    (work / "ptops").mkdir(parents=True)
    (work / "ptops" / "__init__.py").write_text("")  # as the project's checkout has it
    (work / "helper.py").write_text("VALUE = 'sibling import ok'\n")
    (work / "train.py").write_text(
        "import sys, helper\n"
        "print(helper.VALUE, sys.path[0])\n"  # the script's own folder is importable
    )
    # the trap is real: a plain interpreter started here imports the folder, not the package
    trap = subprocess.run(
        [str(py), "-c", "import ptops.ops"], capture_output=True, text=True, cwd=work
    )
    assert trap.returncode != 0 and "No module named 'ptops.ops'" in trap.stderr
    run = tmp_path / "run"
    got = subprocess.run(
        [str(py.parent / "ptops"), "launch", "--run-dir", str(run), "--no-mlflow"]
        + ["--set", "launch.nproc=1", "--", "python", "train.py"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=work,
        env=ENV,
    )
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    logs = "".join(p.read_text(errors="replace") for p in run.rglob("*.log"))
    assert "sibling import ok" in logs, logs[-3000:]
    assert "No module named 'ptops.ops'" not in logs


def test_every_rank_interpreter_drops_the_cwd():
    """The command lines themselves: the supervisor's torchrun, torchrun's workers (through
    --no-python), the node agent and the warm pool all run ``python -P``."""
    from ptops.ops.runrecord.rundir import RunDir
    from ptops.ops.supervisor import launcher
    from ptops.recipes.schema import load

    rec, _ = load("trl-sft-tiny", [])
    cmd = launcher.rank_command(rec, RunDir(Path("/tmp/x")), 1)
    assert cmd.argv[:4] == [sys.executable, "-P", "-m", "torch.distributed.run"]
    i = cmd.argv.index("--no-python")
    assert cmd.argv[i + 1 :] == [sys.executable, "-P", "-u", "-m", "ptops.ops.rank.entry"]
    agent = launcher.node_agent_command(cmd, 1, Path("/tmp/x.log"))
    assert agent.argv == [sys.executable, "-P", "-m", "ptops.ops.node.agent"]
    from ptops.ops.node import agent as node_agent

    # the node agent's torchrun starts its ranks with the same interpreter line (one constant)
    assert node_agent.RANK_PYTHON is launcher.RANK_PYTHON
    src = (REPO / "ops" / "node" / "agent.py").read_text()
    assert '"--no-python", *RANK_PYTHON' in src
    pool = (REPO / "ops" / "supervisor" / "warmpool.py").read_text()
    assert '[sys.executable, "-P", "-m", "ptops.ops.rank.warm"' in pool
