"""The TRL catalogue recipes train for real on CPU (2 gloo ranks) and recover exactly from a crash.

Per recipe: one uninterrupted reference run and one run whose rank 0 is SIGKILLed as step 3
begins (checkpoint-2 committed), rerun on the same directory. The resumed run must end with the
same ``ptops ckpt digest`` as the reference (bit-identical weights and optimizer moments) and log
the same per-step losses. Runs are shared through module fixtures (each launch costs ~15-30 s).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import NPROC, assert_launched, is_finite, launch, trl_checkpoints

from ptops.ops.runrecord.rundir import final_metrics_by_step, read_jsonl

STEPS = 4
OVERRIDES = [f"train.steps={STEPS}", "checkpoint.interval=2", "checkpoint.keep=3"]
CRASH_STEP = 3  # rank 0 SIGKILLed as step 3 begins: checkpoint-2 is the newest committed


def _rows(run_dir: Path, rank: int = 0) -> dict[int, dict]:
    return final_metrics_by_step(list(read_jsonl(run_dir / "metrics.jsonl")), rank)


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("kind") == kind]


def _digest(path: Path) -> str:
    from ptops.ckpt import digest

    return digest(path)


def _crash_and_resume(recipe: str, d: Path, overrides: list[str]) -> str:
    proc, logs = launch(recipe, d, overrides, faults=[f"crash:rank=0,step={CRASH_STEP}"])
    assert proc.returncode != 0, f"the killed run exited 0\n{logs}"
    assert trl_checkpoints(d) == [CRASH_STEP - 1], logs
    proc, logs = launch(recipe, d, overrides, attempt=2)
    assert_launched(proc, logs)
    log0 = (d / "logs" / "attempt-2" / "rank-0.log").read_text(errors="replace")
    assert f"resuming from {d / 'checkpoints' / f'checkpoint-{CRASH_STEP - 1}'}" in log0, logs
    return logs


def _assert_exact(resumed: Path, reference: Path) -> None:
    for rank in range(NPROC):
        got, want = _rows(resumed, rank), _rows(reference, rank)
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), (sorted(got), sorted(want))
        for step in range(1, STEPS + 1):
            assert got[step]["attempt"] == (2 if step >= CRASH_STEP else 1)
            assert got[step]["loss"] == want[step]["loss"], (rank, step)
            assert got[step]["grad_norm"] == want[step]["grad_norm"], (rank, step)
    assert _digest(resumed) == _digest(reference)
    assert _digest(resumed / "checkpoints" / f"checkpoint-{STEPS}") != _digest(
        resumed / "checkpoints" / "checkpoint-2"
    )


class _Pair:
    def __init__(self, reference: Path, resumed: Path, logs: str):
        self.reference, self.resumed, self.logs = reference, resumed, logs


def _pair(tmp_path_factory, recipe: str, overrides: list[str]) -> _Pair:
    ref = tmp_path_factory.mktemp(recipe + "-ref")
    assert_launched(*launch(recipe, ref, overrides))
    killed = tmp_path_factory.mktemp(recipe + "-killed")
    logs = _crash_and_resume(recipe, killed, overrides)
    return _Pair(ref, killed, logs)


# ---------------------------------------------------------------- LoRA SFT


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return _pair(tmp_path_factory, "trl-lora-sft-tiny", OVERRIDES)


def test_lora_sft_trains_adapters_and_resumes_exactly(lora):
    ck = lora.reference / "checkpoints" / f"checkpoint-{STEPS}"
    names = {p.name for p in ck.iterdir()}
    # only the adapters are checkpointed (and digested): no base weights
    assert "adapter_model.safetensors" in names and "model.safetensors" not in names
    from ptops.ckpt._util import read_safetensors_header

    header, _ = read_safetensors_header(ck / "adapter_model.safetensors")
    keys = [k for k in header if k != "__metadata__"]
    assert keys and all("lora_" in k for k in keys), keys[:4]
    cfg = json.loads((ck / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and sorted(cfg["target_modules"]) == [
        "k_proj",
        "o_proj",
        "q_proj",
        "v_proj",
    ]
    rows = _rows(lora.reference)
    assert rows[STEPS]["loss"] < rows[1]["loss"], "LoRA SFT loss did not go down"
    _assert_exact(lora.resumed, lora.reference)


# ---------------------------------------------------------------- reward model


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    return _pair(tmp_path_factory, "trl-reward-tiny", OVERRIDES)


def test_reward_model_trains_and_resumes_exactly(reward):
    ck = reward.reference / "checkpoints" / f"checkpoint-{STEPS}"
    cfg = json.loads((ck / "config.json").read_text())
    assert (
        cfg["architectures"] == ["Qwen2ForSequenceClassification"] and cfg.get("num_labels", 1) == 1
    )
    for rank in range(NPROC):
        for step, row in _rows(reward.reference, rank).items():
            assert 0.0 <= row["accuracy"] <= 1.0, (rank, step)
            assert is_finite(row["margin"]) and is_finite(row["loss"]), (rank, step)
    _assert_exact(reward.resumed, reward.reference)


# ---------------------------------------------------------------- RLOO


@pytest.fixture(scope="module")
def rloo(tmp_path_factory):
    return _pair(tmp_path_factory, "trl-rloo-tiny", OVERRIDES)


def test_rloo_trains_with_the_verifiable_reward_and_resumes_exactly(rloo):
    for rank in range(NPROC):
        for step, row in _rows(rloo.reference, rank).items():
            for key in (
                "reward",
                "rewards_correct_mean",
                "rewards_format_mean",
                "kl",
                "completions_mean_length",
            ):
                assert is_finite(row.get(key)), (rank, step, key)
            assert 0.0 <= row["rewards_correct_mean"] <= 1.0
    _assert_exact(rloo.resumed, rloo.reference)


# ---------------------------------------------------------------- GKD


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("gkd-teacher")
    assert_launched(*launch("trl-sft-tiny", d, ["train.steps=2", "checkpoint.interval=2"]))
    return d


@pytest.fixture(scope="module")
def gkd(tmp_path_factory, teacher_run):
    return _pair(tmp_path_factory, "trl-gkd-tiny", [*OVERRIDES, f'trl.teacher="{teacher_run}"'])


def test_gkd_distils_from_the_teacher_run_and_resumes_exactly(gkd, teacher_run):
    want = teacher_run / "checkpoints" / "checkpoint-2"
    want_digest = _digest(want)
    ev = _events(gkd.reference, "teacher")
    assert (
        len(ev) == 1
        and ev[0]["path"] == str(want)
        and ev[0]["digest"] == want_digest
        and ev[0]["step"] == 2
    )
    assert ev[0]["pinned"] is False
    # the resumed attempt reads the pinned teacher again and says so
    ev = _events(gkd.resumed, "teacher")
    assert [e["attempt"] for e in ev] == [1, 2] and [e["pinned"] for e in ev] == [False, True]
    assert {e["digest"] for e in ev} == {want_digest}
    pin = json.loads((gkd.resumed / "teacher.json").read_text())
    assert pin["path"] == str(want) and pin["digest"] == want_digest
    for step, row in _rows(gkd.reference).items():
        assert is_finite(row["loss"]) and row["loss"] >= 0, step
    _assert_exact(gkd.resumed, gkd.reference)


# ---------------------------------------------------------------- cheap checks (no launch)


def test_teacher_resolution_and_pinning(teacher_run, tmp_path):
    """A run directory resolves to its newest verified checkpoint; a changed pinned teacher is
    refused; a reward model is not a teacher."""
    import shutil

    from ptops.recipes.trl.catalogue import TeacherError, pin_teacher, resolve_teacher

    ck = teacher_run / "checkpoints" / "checkpoint-2"
    assert resolve_teacher(str(teacher_run)) == ck
    assert resolve_teacher(str(teacher_run / "checkpoints")) == ck
    assert resolve_teacher(str(ck)) == ck
    with pytest.raises(TeacherError, match="not found"):
        resolve_teacher(str(tmp_path / "nope"))
    # a damaged copy fails verification
    bad = tmp_path / "runs" / "checkpoint-2"
    shutil.copytree(ck, bad)
    (bad / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(TeacherError, match="verification"):
        resolve_teacher(str(bad))
    # pin on a copy, then change the copy's weights: the next attempt refuses it
    src = tmp_path / "teacher" / "checkpoint-2"
    shutil.copytree(ck, src)
    run = tmp_path / "student"
    run.mkdir()
    first = pin_teacher(str(src), run)
    assert first["pinned"] is False and first["step"] == 2
    again = pin_teacher(str(src), run)
    assert again["pinned"] is True and again["digest"] == first["digest"]
    weights = (
        src / "model.safetensors"
    )  # one weight's last byte changed: still readable, other weights
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0x01
    weights.write_bytes(bytes(raw))
    with pytest.raises(TeacherError, match="changed"):
        pin_teacher(str(src), run)
    (src / "optimizer.pt").write_bytes(b"not a torch file")
    with pytest.raises(TeacherError, match="cannot be read"):
        pin_teacher(str(src), run)


def test_recipe_rules_for_the_catalogue():
    from ptops.recipes.schema import RecipeError, load

    rec, _ = load("trl-rloo-tiny")
    assert rec.trl.trainer == "rloo" and rec.trl.vllm is None
    with pytest.raises(RecipeError, match="num_generations"):
        load("trl-rloo-tiny", ["trl.num_generations=3"])
    with pytest.raises(RecipeError, match="trl.vllm"):
        load("trl-reward-tiny", ['trl.vllm.mode="colocate"'])
    with pytest.raises(RecipeError, match="server_gpus"):
        load("trl-rloo-tiny", ['trl.vllm.mode="server"', "trl.vllm.server_gpus=[1]"])
    rec, _ = load("trl-grpo-tiny", ['trl.vllm.mode="server"', "trl.vllm.server_gpus=[2]"])
    assert rec.trl.vllm.mode == "server"


def test_vllm_config_kwargs_fall_back_without_a_gpu(capsys, monkeypatch):
    """No vLLM here: use_vllm is off, one line on rank 0 and one event; with vLLM available the TRL
    options are the recipe's."""
    from ptops.recipes.schema import load
    from ptops.recipes.trl import vllm

    class P:
        def __init__(self):
            self.events = []

        def event(self, kind, **f):
            self.events.append((kind, f))

    monkeypatch.setenv("RANK", "0")
    rec, _ = load("trl-grpo-tiny", ['trl.vllm.mode="colocate"'])
    probe = P()
    assert vllm.config_kwargs(rec.trl, probe) == {"use_vllm": False}
    out = capsys.readouterr().err.strip().splitlines()  # the rank's log line (ranklog: stderr)
    assert len(out) == 1 and out[0].startswith("[ptops.trl rank 0] vLLM colocate mode unavailable")
    assert "generate path" in out[0]
    assert [k for k, _ in probe.events] == ["vllm_fallback"] and probe.events[0][1][
        "mode"
    ] == "colocate"
    monkeypatch.setenv("RANK", "1")
    assert vllm.config_kwargs(rec.trl, P()) == {"use_vllm": False} and capsys.readouterr().err == ""
    assert (
        vllm.sidecar_specs(load("trl-grpo-tiny", ['trl.vllm.mode="server"'])[0]) == []
    )  # no GPU: no server
    # as on a GPU node with vllm installed
    monkeypatch.setattr(vllm, "unavailable", lambda in_rank=True: None)
    kw = vllm.config_kwargs(rec.trl, probe)
    assert (
        kw["use_vllm"] is True
        and kw["vllm_mode"] == "colocate"
        and kw["vllm_gpu_memory_utilization"] == 0.3
    )
    srv, _ = load(
        "trl-grpo-tiny",
        ['trl.vllm.mode="server"', "trl.vllm.port=8123", "trl.vllm.server_gpus=[2]"],
    )
    kw = vllm.config_kwargs(srv.trl, probe)
    assert (kw["vllm_mode"], kw["vllm_server_port"], kw["vllm_server_host"]) == (
        "server",
        8123,
        "127.0.0.1",
    )
    (spec,) = vllm.sidecar_specs(srv)
    assert spec["argv"][1:3] == ["vllm-serve", "--model"] and "8123" in spec["argv"]
    assert (
        spec["env"] == {"CUDA_VISIBLE_DEVICES": "2"}
        and spec["health_url"] == "http://127.0.0.1:8123/health"
    )
    # the GRPOConfig accepts exactly these options (TRL's own integration)
    from trl import GRPOConfig

    cfg = GRPOConfig(
        output_dir="/tmp/unused",
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        report_to=[],
        **vllm.config_kwargs(srv.trl, probe),
    )
    assert cfg.use_vllm and cfg.vllm_mode == "server" and cfg.vllm_server_port == 8123


if __name__ == "__main__":
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", __file__, "-x", "-q"]))
