"""``pip install ptops[trl]`` beside a torch that is already there leaves that torch as it was.

A cluster's image has its own torch, often a CUDA build; installing ptops must not replace it. The
module's venv is such an image: the registry's torch 2.14.1 (newer than the lock's 2.13.0, and
another build: CUDA where the lock's is +cpu) installed first, then this checkout's ``ptops[trl]``
as a user installs it (its wheel, built once for the module; no lock), with the registry's current
pip (``_venv``). The older end (torch
2.11.0, a 3 GB download) is installed the same way by ``scripts/matrix.py``, whose results
``tests/install/test_packaging.py`` checks; the resolution for it is checked here with pip's own
resolver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import source_tree

NEWER_TORCH = "2.14.1"


def _pip_argv(py: Path, *args: str) -> list[str]:
    return [str(py), "-m", "pip", "--disable-pip-version-check", *args]


def _pip_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}  # a user's pip: no lock


def _pip(py: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        _pip_argv(py, *args), capture_output=True, text=True, timeout=timeout, env=_pip_env()
    )


def _venv(dest: Path) -> Path:
    """A fresh venv whose pip is the registry's current one, as ``pip install -U pip`` leaves a
    user's: Python 3.11's bundled pip 23.2 resolves ``ptops[trl]`` to the same set in about twice
    the time (its candidate evaluation; ~40 s more a resolve on 2 cores)."""
    subprocess.run([sys.executable, "-m", "venv", str(dest)], check=True)
    py = dest / "bin" / "python"
    got = _pip(py, "install", "-q", "--upgrade", "pip")
    assert got.returncode == 0, got.stdout + got.stderr
    return py


def _torch_identity(py: Path) -> dict:
    code = (
        "import importlib.metadata as m, hashlib, pathlib, json; d = m.distribution('torch'); "
        "print(json.dumps({'version': d.version, "
        "'record': hashlib.sha256(pathlib.Path(d._path, 'RECORD').read_bytes()).hexdigest()}))"
    )
    return json.loads(
        subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True).stdout
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """This checkout built once into a wheel, as a user gets ptops from a registry."""
    root = tmp_path_factory.mktemp("wheel")
    src = source_tree(root / "ptops-src")
    # no build isolation: the project venv's setuptools builds the same wheel (file for file)
    # without a temporary build env fetched from the registry first (~8 s)
    got = _pip(
        Path(sys.executable),
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(root / "dist"),
        str(src),
    )
    assert got.returncode == 0, got.stdout + got.stderr
    (whl,) = (root / "dist").glob("ptops-*.whl")
    return whl


@pytest.fixture(scope="module")
def resolving(tmp_path_factory, wheel):
    """``test_resolver_keeps_an_older_torch_for_the_trl_extra``'s dry run, started in the
    background before the image's installs: its resolve (one core, much of it waiting on the
    registry) and the torch install (one core, unpacking) overlap on a 2-core box instead of
    taking turns; the test waits for it. The venv's torch 2.11.0+cu130 is its dist-info alone
    (the 3 GB of libraries do not change pip's decision)."""
    root = tmp_path_factory.mktemp("resolver")
    py = _venv(root / "venv")
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    info = site / "torch-2.11.0+cu130.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+cu130\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
    out, err = root / "report.json", root / "stderr.txt"
    with out.open("w") as o, err.open("w") as e:  # files, not pipes: nothing waits on a reader
        proc = subprocess.Popen(
            _pip_argv(py, "install", "--dry-run", "--quiet", "--report", "-", f"{wheel}[trl]"),
            stdout=o,
            stderr=e,
            env=_pip_env(),
        )
    yield proc, out, err
    if proc.poll() is None:  # only the image's tests ran
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def image(tmp_path_factory, wheel, resolving):
    """A venv that already holds torch 2.14.1, then ptops[trl] installed into it (the resolver
    test's dry run, ``resolving``, runs meanwhile)."""
    root = tmp_path_factory.mktemp("image")
    py = _venv(root / "venv")
    got = _pip(
        py, "install", "-q", "--no-compile", f"torch=={NEWER_TORCH}"
    )  # no .pyc: minutes on 2 cores
    assert got.returncode == 0, got.stdout + got.stderr
    before = _torch_identity(py)
    got = _pip(py, "install", "-q", "--no-compile", f"{wheel}[trl]")
    assert got.returncode == 0, got.stdout + got.stderr
    return py, before


def test_installing_ptops_trl_leaves_the_images_torch_untouched(image):
    py, before = image
    assert before["version"] == NEWER_TORCH  # the registry's build, not the lock's 2.13.0+cpu
    assert _torch_identity(py) == before  # same version, same files: the same build


def test_a_supervised_trl_recipe_completes_on_the_images_torch(image, tmp_path):
    py, _ = image
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            str(py.parent / "ptops"),
            "launch",
            "trl-sft-tiny",
            "--supervise",
            "--no-mlflow",
            "--run-dir",
            str(run),
            "--set",
            "train.steps=3",
            "--set",
            "checkpoint.interval=2",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "completed"] == [3]
    manifests = sorted((run / "checkpoints").glob("*/ptops-manifest.json"))
    assert manifests, "no committed checkpoint"
    # the ranks trained on the image's torch, not on one pip brought along
    assert json.loads(manifests[-1].read_text())["versions"]["torch"].startswith(NEWER_TORCH)


def test_resolver_keeps_an_older_torch_for_the_trl_extra(resolving):
    """pip's resolver decides from installed metadata: a venv whose torch 2.11.0+cu130 is known to
    pip (``resolving``) gets no torch from ``ptops[trl]``. (The titan extra's torch bound, 2.13,
    is the lock's: tests/install/test_packaging.py.)"""
    proc, out, err = resolving
    assert proc.wait(timeout=900) == 0, err.read_text()[-3000:]
    wanted = {
        i["metadata"]["name"].lower(): i["metadata"]["version"]
        for i in json.loads(out.read_text())["install"]
    }
    assert "trl" in wanted and "transformers" in wanted  # the extra did resolve
    assert "torch" not in wanted, f"ptops[trl] would replace torch 2.11: {wanted.get('torch')}"
    cuda = [
        n for n in wanted if n.startswith(("nvidia-", "cuda-", "triton")) and n != "nvidia-ml-py"
    ]
    assert cuda == [], f"ptops[trl] would bring CUDA libraries: {cuda}"
