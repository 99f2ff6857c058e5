"""TRL engine adapter: SFT, DPO and GRPO on a tiny local model, one call per torchrun rank.

``main(recipe, probe)`` runs inside every rank (torchrun sets RANK, WORLD_SIZE,
LOCAL_RANK; the launcher sets PTOPS_RUN_DIR and PTOPS_ATTEMPT). transformers'
Trainer runs the ranks as gloo DDP on CPU.

What the adapter guarantees:

- per-step records through the probe on every rank (``loss`` is TRL's logged
  value, which transformers averages over ranks; ``rank_loss`` is this rank's own);
- ``probe.before_step`` before each step, ``probe.should_poison`` turns that
  step's loss into NaN, ``probe.phase("checkpoint")`` before a save and
  ``probe.phase("step")`` after it;
- checkpoints every ``checkpoint.interval`` steps and always at the final step,
  newest ``checkpoint.keep`` kept, under ``RUN_DIR/checkpoints/checkpoint-N``;
- rerunning on the same run directory resumes from the newest *complete*
  checkpoint (explicit ``resume_from_checkpoint=path``), bit-identical to an
  uninterrupted run.

Test hook: ``PTOPS_TRL_KILL_AFTER_SAVE=N`` makes every rank SIGKILL itself right
after the checkpoint of step N is written (all ranks pass a barrier first), to
emulate a job killed between two steps.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ptops.ops.rundir import RunDir

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_ESSENTIAL = ("trainer_state.json", "optimizer.pt", "scheduler.pt")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_KEY_RE = re.compile(r"[^A-Za-z0-9_.]+")
# transformers' names -> the probe's names
_RENAME = {"learning_rate": "lr"}
# end-of-training summary keys: not a step record
_SUMMARY_KEYS = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"}


def _log(msg: str) -> None:
    print(f"[ptops.trl rank {os.environ.get('RANK', '0')}] {msg}", flush=True)


# ---------------------------------------------------------------- checkpoints


def _missing(path: Path, world_size: int, with_rng: bool) -> list[str]:
    missing = [name for name in _ESSENTIAL if not (path / name).is_file()]
    if not any((path / name).is_file() for name in _WEIGHTS):
        missing.append("model.safetensors")
    if with_rng:
        rng = ["rng_state.pth"] if world_size <= 1 else [f"rng_state_{r}.pth" for r in range(world_size)]
        missing += [name for name in rng if not (path / name).is_file()]
    if "trainer_state.json" not in missing:
        try:
            step = json.loads((path / "trainer_state.json").read_text()).get("global_step")
        except (OSError, ValueError):
            missing.append("trainer_state.json (unreadable)")
        else:
            m = CHECKPOINT_RE.match(path.name)
            if m and step != int(m.group(1)):
                missing.append(f"trainer_state.json (global_step {step} != {m.group(1)})")
    return missing


def latest_checkpoint(ckpt_dir: Path, world_size: int) -> Path | None:
    """Newest complete ``checkpoint-N``; never trusts the highest N blindly.

    Complete means model weights, optimizer, scheduler, a readable
    ``trainer_state.json`` for step N, and the RNG state of every rank. When no
    checkpoint has every rank's RNG state (the world size changed), the newest
    one complete otherwise is used and transformers reseeds the missing ranks.
    """
    if not ckpt_dir.is_dir():
        return None
    found = sorted(
        (int(m.group(1)), p) for p in ckpt_dir.iterdir() if p.is_dir() and (m := CHECKPOINT_RE.match(p.name))
    )
    found.reverse()
    for _, path in found:
        missing = _missing(path, world_size, with_rng=True)
        if not missing:
            return path
        _log(f"skipping incomplete checkpoint {path}: missing {', '.join(missing)}")
    for _, path in found:
        if not _missing(path, world_size, with_rng=False):
            _log(f"no checkpoint has RNG state for all {world_size} ranks; resuming from {path} anyway")
            return path
    return None


# ---------------------------------------------------------------- metrics


def sanitise_key(key: str) -> str:
    """``rewards/correct/mean`` -> ``rewards_correct_mean``; ``learning_rate`` -> ``lr``."""
    key = _RENAME.get(key, key)
    return _KEY_RE.sub("_", key.replace("/", "_")).strip("_")


def _count_tokens(inputs: Any) -> int:
    if not isinstance(inputs, dict):
        return 0
    try:
        if "attention_mask" in inputs:
            return int(inputs["attention_mask"].sum())
        if "prompt_mask" in inputs and "completion_mask" in inputs:
            return int(inputs["prompt_mask"].sum()) + int(inputs["completion_mask"].sum())
        if "input_ids" in inputs:
            return int(inputs["input_ids"].numel())
    except (AttributeError, TypeError):
        return 0
    return 0


class _StepTally:
    """What compute_loss saw during the current optimizer step on this rank."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.losses: list[float] = []
        self.tokens = 0

    def add(self, loss: Any, tokens: int) -> None:
        try:
            self.losses.append(float(loss.detach().float().mean()))
        except (AttributeError, RuntimeError, TypeError, ValueError):
            pass
        self.tokens += tokens

    def rank_loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None


def _make_trainer_class(base: type, probe, tally: _StepTally) -> type:
    """``base`` with a compute_loss that counts tokens, keeps the rank's loss and poisons on request."""

    class PtopsTrainer(base):  # type: ignore[misc, valid-type]
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
            if not model.training:
                return out
            loss = out[0] if isinstance(out, tuple) else out
            if probe.should_poison(self.state.global_step + 1):
                loss = loss * float("nan")
                out = (loss, *out[1:]) if isinstance(out, tuple) else loss
            tally.add(loss, _count_tokens(inputs))
            return out

    PtopsTrainer.__name__ = PtopsTrainer.__qualname__ = f"Ptops{base.__name__}"
    return PtopsTrainer


def _make_callback(probe, tally: _StepTally):
    from transformers import TrainerCallback

    class ProbeCallback(TrainerCallback):
        def __init__(self) -> None:
            self._t0 = time.monotonic()
            self._step_s: float | None = None
            self._recorded: set[int] = set()
            kill = os.environ.get("PTOPS_TRL_KILL_AFTER_SAVE", "")
            self._kill_after = int(kill) if kill.strip() else None

        def on_step_begin(self, args, state, control, **kwargs):
            tally.reset()
            self._step_s = None
            probe.before_step(state.global_step + 1)
            self._t0 = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            self._step_s = time.monotonic() - self._t0
            if state.global_step >= state.max_steps:
                control.should_save = True  # always checkpoint the final step
            if control.should_save and not control.should_log:
                probe.phase("checkpoint", state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            step = state.global_step
            if not logs or _SUMMARY_KEYS & logs.keys() or any(k.startswith("eval_") for k in logs):
                return
            if step in self._recorded or step < 1:
                return
            self._recorded.add(step)
            step_s = self._step_s if self._step_s is not None else time.monotonic() - self._t0
            metrics: dict[str, Any] = {}
            for key, value in logs.items():
                metrics[sanitise_key(key)] = value
            metrics.setdefault("loss", None)
            metrics.setdefault("grad_norm", None)
            metrics.setdefault("lr", None)
            metrics["step_s"] = step_s
            metrics["tokens"] = tally.tokens
            metrics["tokens_per_s"] = tally.tokens / step_s if step_s and step_s > 0 else None
            metrics["rank_loss"] = tally.rank_loss()
            probe.step(step, metrics)
            if control.should_save:
                probe.phase("checkpoint", step)

        def on_save(self, args, state, control, **kwargs):
            step = state.global_step
            probe.phase("step", step)
            if self._kill_after is not None and step == self._kill_after:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    dist.barrier()
                _log(f"PTOPS_TRL_KILL_AFTER_SAVE={step}: killing myself after checkpoint-{step}")
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    return ProbeCallback()


# ---------------------------------------------------------------- trainers


def _common_args(recipe, out_dir: Path) -> dict[str, Any]:
    sec = recipe.trl
    return dict(
        output_dir=str(out_dir),
        max_steps=recipe.train.steps,
        seed=recipe.train.seed,
        learning_rate=sec.lr,
        per_device_train_batch_size=sec.per_device_batch_size,
        gradient_accumulation_steps=sec.grad_accum,
        max_grad_norm=sec.max_grad_norm,
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=1,
        logging_nan_inf_filter=False,  # a NaN loss must reach the monitors, not be averaged away
        report_to=[],
        save_strategy="steps",
        save_steps=recipe.checkpoint.interval,
        save_total_limit=recipe.checkpoint.keep,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
        ddp_backend="gloo",
    )


def build_trainer(recipe, probe, run: RunDir):
    from datasets import Dataset

    from ptops.recipes import assets
    from ptops.recipes.trl.model import load_model, load_tokenizer, model_dir

    sec = recipe.trl
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mdir = model_dir(sec.model, seed=sec.model.seed)
    tokenizer = load_tokenizer(mdir)
    model = load_model(mdir)
    args = _common_args(recipe, run.checkpoints)
    tally = _StepTally()
    callbacks = [_make_callback(probe, tally)]

    if sec.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**args, max_length=sec.max_length, packing=False, assistant_only_loss=True)
        data = Dataset.from_list(assets.chat_dataset(sec.dataset_size))
        cls = _make_trainer_class(SFTTrainer, probe, tally)
        return cls(model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=callbacks)

    if sec.trainer == "dpo":
        from trl import DPOConfig, DPOTrainer

        config = DPOConfig(**args, max_length=sec.max_length, beta=sec.beta, precompute_ref_log_probs=False)
        data = Dataset.from_list(assets.preference_dataset(sec.dataset_size))
        ref_model = load_model(mdir)
        cls = _make_trainer_class(DPOTrainer, probe, tally)
        return cls(
            model=model,
            ref_model=ref_model,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=callbacks,
        )

    if sec.trainer == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        from ptops.recipes.trl.rewards import REWARD_FUNCS, REWARD_WEIGHTS

        batch = sec.per_device_batch_size * world * sec.grad_accum
        if batch % sec.num_generations:
            raise ValueError(
                f"[trl].num_generations={sec.num_generations} must divide the generation batch "
                f"per_device_batch_size*nproc*grad_accum = {sec.per_device_batch_size}*{world}*{sec.grad_accum} = {batch}"
            )
        config = GRPOConfig(
            **args,
            num_generations=sec.num_generations,
            max_completion_length=sec.max_completion_length,
            beta=sec.beta,
            temperature=sec.temperature,
            use_vllm=False,
            reward_weights=REWARD_WEIGHTS,
            log_completions=False,
        )
        data = Dataset.from_list(assets.prompt_dataset(sec.dataset_size))
        cls = _make_trainer_class(GRPOTrainer, probe, tally)
        return cls(
            model=model,
            reward_funcs=REWARD_FUNCS,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=callbacks,
        )

    raise ValueError(f"[trl].trainer: unknown trainer {sec.trainer!r}")


def main(recipe, probe) -> None:
    for key, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("HF_DATASETS_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
        ("HF_HUB_DISABLE_TELEMETRY", "1"),
    ):
        os.environ.setdefault(key, value)
    run = RunDir(Path(os.environ["PTOPS_RUN_DIR"]))
    run.checkpoints.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    t0 = time.monotonic()
    trainer = build_trainer(recipe, probe, run)
    resume = latest_checkpoint(run.checkpoints, world)
    _log(
        f"{recipe.trl.trainer} trainer ready in {time.monotonic() - t0:.1f}s; "
        + (f"resuming from {resume}" if resume else "starting fresh")
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    final = trainer.state.global_step
    if final >= recipe.train.steps and not (run.checkpoints / f"checkpoint-{final}").is_dir():
        # belt and braces: the callback asks for a save at max_steps; make sure it exists
        probe.phase("checkpoint", final)
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        probe.phase("step", final)
    _log(f"finished at step {final}")
