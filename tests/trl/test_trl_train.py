"""TRL SFT, DPO and GRPO really train on CPU: 2 torchrun ranks (gloo DDP), tiny Qwen2 model.

No mocks; every run goes through ``ptops launch`` (plain, unsupervised) and the real rank probe,
fault injection included. Each launch costs ~10-20 s (``import trl`` in every rank), so runs are
shared through module-scoped fixtures: one SFT run (also the uninterrupted reference for resume),
one DPO run, one GRPO run, and one SFT run killed after a checkpoint and rerun on the same
directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import NPROC, assert_launched, is_finite, launch, records_by_rank, trl_checkpoints

from ptops.ops.runrecord.rundir import final_metrics_by_step, read_jsonl

BIN = Path(sys.executable).parent
STEPS = 6
INTERVAL = 2  # saves 2, 4, 6
KEEP = 2  # retention leaves 4 and 6
KILL_AFTER = 4
SFT_OVERRIDES = [
    f"train.steps={STEPS}",
    f"checkpoint.interval={INTERVAL}",
    f"checkpoint.keep={KEEP}",
]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft")
    assert_launched(*launch("trl-sft-tiny", d, SFT_OVERRIDES))
    return d


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo")
    assert_launched(*launch("trl-dpo-tiny", d, ["train.steps=4"]))
    return d


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo")
    assert_launched(*launch("trl-grpo-tiny", d, ["train.steps=4"]))
    return d


def _check_common(run_dir: Path, steps: int) -> dict[int, dict[int, dict]]:
    by_rank = records_by_rank(run_dir)
    for rank in range(NPROC):
        rows = by_rank[rank]
        assert sorted(rows) == list(range(1, steps + 1)), f"rank {rank}: steps {sorted(rows)}"
        for step, row in rows.items():
            assert row["rank"] == rank
            for key in ("loss", "grad_norm", "lr", "step_s", "tokens_per_s"):
                assert key in row, f"rank {rank} step {step}: no {key}"
            assert is_finite(row["loss"]), f"rank {rank} step {step}: loss {row['loss']!r}"
            assert is_finite(row["grad_norm"]) and is_finite(row["lr"]) and row["step_s"] > 0
            assert row["tokens_per_s"] > 0
    # a run always checkpoints its final step
    assert steps in trl_checkpoints(run_dir)
    return by_rank


def test_sft_trains_on_two_ranks(sft_run):
    by_rank = _check_common(sft_run, STEPS)
    assert by_rank[0][STEPS]["loss"] < by_rank[0][1]["loss"], "SFT loss did not go down"
    # keep=2: checkpoint-2 pruned after checkpoint-6 was committed
    assert trl_checkpoints(sft_run) == [4, 6]
    root = sft_run / "checkpoints"
    assert (root / "LATEST").read_text().strip() == "checkpoint-6"
    from ptops.ckpt import verify

    for step in (4, 6):
        res = verify(root / f"checkpoint-{step}", deep=True)
        assert res.ok and res.has_manifest, res.reason
    assert "entropy" in by_rank[0][1] and "mean_token_accuracy" in by_rank[0][1]


def test_dpo_trains_on_two_ranks(dpo_run):
    by_rank = _check_common(dpo_run, 4)
    row = by_rank[1][4]
    for key in ("rewards_chosen", "rewards_rejected", "rewards_margins", "logps_chosen"):
        assert is_finite(row[key]), key


def test_grpo_trains_on_two_ranks(grpo_run):
    by_rank = _check_common(grpo_run, 4)
    for rank in range(NPROC):
        for step, row in by_rank[rank].items():
            for key in (
                "reward",
                "reward_std",
                "kl",
                "entropy",
                "frac_reward_zero_std",
                "completions_mean_length",
            ):
                assert key in row, f"rank {rank} step {step}: no {key}"
            assert is_finite(row["reward"]) and is_finite(row["entropy"]) and is_finite(row["kl"])
            assert 0 < row["completions_mean_length"] <= 16
            assert "rewards_correct_mean" in row and "clip_ratio_region_mean" in row


def test_sft_kill_and_resume_is_bit_identical(sft_run, tmp_path_factory):
    d = tmp_path_factory.mktemp("sft-killed")
    overrides = SFT_OVERRIDES
    # rank 0 is SIGKILLed as step 5 begins: checkpoint-4 is committed, step 5 never finishes
    proc, logs = launch(
        "trl-sft-tiny", d, overrides, faults=[f"crash:rank=0,step={KILL_AFTER + 1}"]
    )
    assert proc.returncode != 0, f"the killed run exited 0\n{logs}"
    assert trl_checkpoints(d) == [2, KILL_AFTER], logs
    assert max(records_by_rank(d)[0]) == KILL_AFTER

    proc, logs = launch("trl-sft-tiny", d, overrides, attempt=2)
    assert_launched(proc, logs)
    assert f"resuming from {d / 'checkpoints' / f'checkpoint-{KILL_AFTER}'}" in logs
    resumed = _check_common(d, STEPS)
    reference = records_by_rank(sft_run)
    for rank in range(NPROC):
        for step in range(1, STEPS + 1):
            expected = step > KILL_AFTER and 2 or 1
            assert resumed[rank][step]["attempt"] == expected
            assert resumed[rank][step]["loss"] == reference[rank][step]["loss"], (rank, step)
            assert resumed[rank][step]["rank_loss"] == reference[rank][step]["rank_loss"], (
                rank,
                step,
            )
            assert resumed[rank][step]["grad_norm"] == reference[rank][step]["grad_norm"], (
                rank,
                step,
            )


# ---- cheap checks of the adapter's helpers (no torch import)


def test_resume_picks_newest_good_checkpoint(sft_run, tmp_path):
    """Real checkpoints of the SFT run, damaged the ways a kill or a bad disk damages them;
    the adapter resumes from ``ptops.ckpt.resume_point`` with the run's world size."""
    import json
    import shutil

    from ptops.ckpt import resume_point

    def pick(root):
        entry = resume_point(root, world_size=NPROC, trust_env=False)
        return Path(entry.path) if entry is not None else None

    root = tmp_path / "checkpoints"
    shutil.copytree(sft_run / "checkpoints", root)
    assert pick(tmp_path / "nothing") is None
    assert pick(root) == root / "checkpoint-6"
    # a truncated file (corrupt-ckpt) fails the manifest's size/hash
    opt = root / "checkpoint-6" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])
    assert pick(root) == root / "checkpoint-4"
    # killed between the save and the commit: no manifest, rank 1's RNG state not written yet
    late = root / "checkpoint-8"
    shutil.copytree(root / "checkpoint-4", late)
    (late / "ptops-manifest.json").unlink()
    state = json.loads((late / "trainer_state.json").read_text())
    (late / "trainer_state.json").write_text(json.dumps({**state, "global_step": 8}))
    (late / "rng_state_1.pth").unlink()
    assert pick(root) == root / "checkpoint-4"
    # ... with every rank's part it is good (structure and every tensor record read back): adopted
    shutil.copy2(root / "checkpoint-4" / "rng_state_1.pth", late)
    assert pick(root) == late and (late / "ptops-manifest.json").is_file()
    # killed before trainer_state.json (written last)
    (late / "trainer_state.json").unlink()
    assert pick(root) == root / "checkpoint-4"


def test_metric_names_are_sanitised():
    from ptops.recipes.trl.run import sanitise_key

    assert sanitise_key("learning_rate") == "lr"
    assert sanitise_key("rewards/correct/mean") == "rewards_correct_mean"
    assert sanitise_key("completions/mean_length") == "completions_mean_length"
    assert sanitise_key("clip_ratio/low_mean") == "clip_ratio_low_mean"
    assert sanitise_key("kl") == "kl"


def test_grpo_reward_is_verifiable():
    from ptops.recipes.trl.rewards import correct, format

    completions = [
        [{"role": "assistant", "content": "The answer is 12."}],
        [{"role": "assistant", "content": "no"}],
    ]
    assert correct(completions, answer=["12", "3"]) == [1.0, 0.0]
    assert correct(["it is 7 or 9"], answer=["9"]) == [1.0]
    assert format(completions) == [1.0, 0.0]


def test_probe_hooks_and_nan_poison_in_process(tmp_path, monkeypatch):
    """One rank, in this process: before_step/phase order, forced final save, a ``nan`` fault
    (``probe.faults.should_poison``) -> NaN loss."""
    from ptops.ops.rank.probe import Probe
    from ptops.recipes.schema import load as load_recipe

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("DISABLE_MLFLOW_INTEGRATION", "TRUE")
    monkeypatch.setenv("PTOPS_RUN_DIR", str(tmp_path))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PTOPS_FAULTS"):
        monkeypatch.delenv(key, raising=False)

    calls: list[tuple] = []

    class SpyProbe(Probe):
        def before_step(self, step):
            calls.append(("before", step))

        def phase(self, phase, step):
            calls.append((phase, step))

    from ptops.recipes.trl.run import main

    recipe, _ = load_recipe(
        "trl-sft-tiny", ["train.steps=3", "checkpoint.interval=5", "launch.nproc=1"]
    )
    from ptops.faultinject.spec import parse, to_env

    nan2 = to_env([parse("nan:step=2")])
    main(recipe, SpyProbe(tmp_path, rank=0, attempt=1, world_size=1, faults=nan2))

    rows = final_metrics_by_step(list(read_jsonl(tmp_path / "metrics.jsonl")), 0)
    assert is_finite(rows[1]["loss"])
    assert rows[2]["loss"] == "nan" and rows[2]["rank_loss"] == "nan"  # the probe keeps NaN visible
    assert [c for c in calls if c[0] == "before"] == [("before", 1), ("before", 2), ("before", 3)]
    # checkpoint only at the final step (3 < interval 5), announced before the save and closed after
    assert calls.index(("checkpoint", 3)) < len(calls) - 1 and calls[-1] == ("step", 3)
    assert trl_checkpoints(tmp_path) == [3]


def test_stop_request_checkpoints_and_returns(tmp_path, monkeypatch):
    """Under a supervisor, Ctrl-C asks the ranks to save: the adapter saves at the step's end and
    returns."""
    from ptops.ops.rank.probe import Probe
    from ptops.recipes.schema import load as load_recipe

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "1")
    monkeypatch.setenv("DISABLE_MLFLOW_INTEGRATION", "TRUE")
    monkeypatch.setenv("PTOPS_RUN_DIR", str(tmp_path))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PTOPS_FAULTS"):
        monkeypatch.delenv(key, raising=False)

    from ptops.ops.rank.probe import StopProtocol

    class StoppedProbe(Probe):
        supervised = True  # as if a supervisor's channel were attached

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            probe = self

            class AskedAtStep2(StopProtocol):
                @property
                def requested(self):
                    return probe._step >= 2

            self.stop = AskedAtStep2()

    from ptops.recipes.trl.run import main

    recipe, _ = load_recipe(
        "trl-sft-tiny", ["train.steps=5", "checkpoint.interval=4", "launch.nproc=1"]
    )
    main(recipe, StoppedProbe(tmp_path, rank=0, attempt=1, world_size=1))
    rows = final_metrics_by_step(list(read_jsonl(tmp_path / "metrics.jsonl")), 0)
    assert sorted(rows) == [1, 2]
    assert trl_checkpoints(tmp_path) == [2]
    assert (tmp_path / "checkpoints" / "LATEST").read_text().strip() == "checkpoint-2"
