"""TRL engine adapter: SFT, DPO and GRPO on a tiny local model, one call per torchrun rank
(LoRA SFT, reward model, RLOO and GKD: ``catalogue.py``, built through the same trainer class).

``main(recipe, probe)`` runs inside every rank (torchrun sets RANK, WORLD_SIZE,
LOCAL_RANK; the launcher sets PTOPS_RUN_DIR and PTOPS_ATTEMPT). transformers'
Trainer runs the ranks as gloo DDP on CPU.

What the adapter guarantees:

- per-step records through the probe on every rank (``loss`` is TRL's logged
  value, which transformers averages over ranks; ``rank_loss`` is this rank's own);
- at each step's begin ``probe.profile.at_step``, ``probe.faults.before_step`` and
  ``probe.before_step``; ``probe.faults.should_poison`` turns that step's loss into NaN;
  ``probe.phase("checkpoint")`` and ``probe.faults.on_checkpoint`` before a save,
  ``probe.phase("step")`` and ``probe.faults.after_checkpoint`` after it;
- a failed save (ENOSPC, EACCES, EIO, ... including the ``enospc`` fault raised
  at ``faults.on_checkpoint``) does not end training: all ranks agree it failed,
  nothing is committed (the partial ``checkpoint-N`` never gets a manifest nor
  LATEST), rank 0 emits ``checkpoint_failed {step, path, error}`` and the next
  interval tries again; a failed *final* (or on-request) save raises on every
  rank, so the run ends non-zero rather than losing its last steps silently;
- every committed save emits one ``checkpoint {step, path, blocking_s, total_s}``
  event from rank 0 (the save is synchronous: blocking_s == total_s);
- checkpoints every ``checkpoint.interval`` steps and always at the final step,
  newest ``checkpoint.keep`` kept, under ``RUN_DIR/checkpoints/checkpoint-N``;
- every save is one :class:`ptops.ckpt.SaveTransaction`: rank 0 marks the folder,
  transformers writes it, all ranks agree they wrote their part, rank 0 writes
  ``ptops-manifest.json`` (sizes + sha256), moves ``checkpoints/LATEST`` and prunes
  to the newest ``checkpoint.keep`` good ones (transformers' own rotation is off: it
  could delete the last good checkpoint before the new one is committed); the
  probe's checkpoint phase spans all of it, and ``probe.faults.in_save`` marks the middle
  (``crash:phase=save`` fires there);
- rerunning on the same run directory resumes from :func:`ptops.ckpt.resume_point`
  (the supervisor's verified choice, or the newest *good* checkpoint, chosen on rank
  0 and broadcast; explicit ``resume_from_checkpoint=path``), bit-identical to an
  uninterrupted run; newer invalid checkpoints are quarantined
  (``checkpoints/invalid/``) and reported as ``checkpoint_invalid {path, reason}``;
- under a supervisor, a stop request (Ctrl-C / SIGTERM of the supervisor) is
  agreed on by all ranks at the end of a step, which then checkpoints and returns;
- silent data corruption (``recipes/sdc.py``): every ``[monitors.sdc] every`` steps each rank
  fingerprints its parameters and optimizer state in ``on_step_end`` and again in the next
  ``on_step_begin`` (``sdc_rest``), and, DDP replicas being equal, records the fingerprint
  (``sdc_fp``) for the ``sdc`` monitor to compare; ``on_step_begin`` is also where the
  ``bitflip`` fault flips (``probe.faults.flip_bits``).

Faults (crash, hang, nan, enospc, corrupt-ckpt, ...) come through the probe's
hooks; the adapter has no fault code of its own.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

from ptops.ckpt import versions
from ptops.ops.runrecord import ranklog
from ptops.ops.runrecord.rundir import RunDir
from ptops.recipes.trl.device import cuda as _cuda
from ptops.recipes.trl.device import dist as _dist

_KEY_RE = re.compile(r"[^A-Za-z0-9_.]+")
# transformers' names -> the probe's names
_RENAME = {"learning_rate": "lr"}
# end-of-training summary keys: not a step record
_SUMMARY_KEYS = {
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "total_flos",
    "train_loss",
}


def _log(msg: str) -> None:
    ranklog.get("trl").info("%s", msg)


VERSIONED = ("torch", "transformers", "trl", "accelerate")  # in each checkpoint's manifest


# ---------------------------------------------------------------- checkpoints


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


class _SaveState:
    """The save in progress on this rank, shared by the trainer's ``_save_checkpoint`` and the
    callback."""

    def __init__(self, keep: int = 3, sdc_every: int = 0) -> None:
        self.keep = keep
        self.sdc_every = sdc_every  # retention also keeps an sdc rollback's target
        self.step: int | None = None
        self.t0 = 0.0
        self.txn: Any = None  # ptops.ckpt.SaveTransaction of ``step``
        self.failures: list[dict[str, Any]] = []


def _failed_ranks(failed: bool, device: Any = None) -> list[int]:
    """Every rank learns which ranks failed (all-reduce of a one-hot vector)."""
    dist = _dist()
    if dist is None:
        return [0] if failed else []
    import torch

    t = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    if failed:
        t[dist.get_rank()] = 1
    dist.all_reduce(t)
    return [r for r, v in enumerate(t.tolist()) if v]


def _make_trainer_class(base: type, probe, tally: _StepTally, saves: _SaveState) -> type:
    """``base`` with a compute_loss that counts tokens, keeps the rank's loss and poisons on
    request, and a guarded ``_save_checkpoint``: a failing save (ENOSPC, EACCES, EIO, ...)
    is recorded for the callback to report instead of ending training."""

    class PtopsTrainer(base):  # type: ignore[misc, valid-type]
        def _save_checkpoint(self, model, trial):
            """One ``ptops.ckpt.SaveTransaction``: begin (rank 0 marks the folder, all agree),
            transformers writes, commit (all agree, rank 0: manifest, LATEST, prune)."""
            from ptops.ckpt import SaveTransaction

            step = self.state.global_step
            device = self.args.device
            txn = SaveTransaction(
                Path(self.args.output_dir),
                step,
                name=f"checkpoint-{step}",
                leader=self.is_world_process_zero(),
                agree=lambda failed: bool(_failed_ranks(failed, device)),
                world_size=self.args.world_size,
                versions=versions(*VERSIONED),
                keep=saves.keep,
                sdc_every=saves.sdc_every,
            )
            saves.step, saves.t0, saves.txn = step, time.monotonic(), txn

            def write(_path: Path) -> None:  # transformers names the folder checkpoint-N itself
                try:
                    super(PtopsTrainer, self)._save_checkpoint(model, trial)
                except Exception as e:  # OSError, torch.save's RuntimeError, safetensors errors
                    _log(f"checkpoint-{step}: save failed on this rank: {type(e).__name__}: {e}")
                    raise

            txn.run(write, probe)  # the probe's save hooks, begin, write, commit: every engine's

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            from ptops.recipes.trl import (
                rollback,
            )  # PTOPS_ROLLBACK: drop the skipped window's batches

            probe.phase("data", self.state.global_step + 1)
            with probe.profile.mark("data"):  # `ptops profile`: a ptops/data range (or a no-op)
                rollback.skip(self, epoch_iterator, num_batches, probe)
                return super().get_batch_samples(epoch_iterator, num_batches, device)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
            if not model.training:
                return out
            loss = out[0] if isinstance(out, tuple) else out
            if probe.faults.should_poison(self.state.global_step + 1):
                loss = loss * float("nan")
                out = (loss, *out[1:]) if isinstance(out, tuple) else loss
            tally.add(loss, _count_tokens(inputs))
            return out

    PtopsTrainer.__name__ = PtopsTrainer.__qualname__ = f"Ptops{base.__name__}"
    return PtopsTrainer


def _make_callback(
    probe,
    tally: _StepTally,
    keep: int,
    saves: _SaveState,
    heldout=None,
    sdc_every: int = 0,
    more=None,
):
    """``more()``: further keys for each step's record (the engine and grader seams')."""
    from transformers import TrainerCallback

    from ptops.recipes import sdc

    class ProbeCallback(TrainerCallback):
        def __init__(self) -> None:
            self._t0 = time.monotonic()
            self._step_s: float | None = None
            self._recorded: set[int] = set()
            self.stopped_at: int | None = None
            self._model: Any = None
            self._optimizer: Any = None
            # silent data corruption (recipes/sdc.py): DDP ranks hold the same state, so their
            # fingerprints must agree (FSDP shards do not)
            self.sdc: Any = None
            self._sdc_keys: dict[str, Any] = {}

        def _params(self) -> sdc.Named:
            model = self._model
            return [] if model is None else [(n, p) for n, p in model.named_parameters()]

        def _optims(self) -> sdc.Named:
            opt = self._optimizer
            return [] if opt is None else sdc.optim_tensors([getattr(opt, "optimizer", opt)])

        def on_step_begin(self, args, state, control, **kwargs):
            tally.reset()
            self._step_s = None
            step = state.global_step + 1
            probe.profile.at_step(step)  # a capture's boundary comes before the fault hooks
            probe.faults.before_step(step)
            probe.before_step(step)
            self._model = kwargs.get("model", self._model)
            self._optimizer = kwargs.get("optimizer", self._optimizer)
            if self.sdc is None:
                self.sdc = sdc.StateChecks(
                    sdc_every,
                    probe,
                    self._params,
                    self._optims,
                    replicated=not getattr(args, "fsdp", None),
                )
            self.sdc.before_step(step)  # bitflip faults, then the at-rest check
            self._t0 = time.monotonic()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            # gradient bit flips (no recheck here: DDP replicas compare their state after it)
            if self.sdc is not None and self._model is not None:
                self.sdc.before_optimizer(
                    state.global_step + 1, lambda: sdc.grad_tensors([self._model])
                )

        def _stop_agreed(self, args) -> bool:
            """All ranks stop at the same step or none does (a lone stop would hang the others)."""
            if not getattr(probe, "supervised", False):
                return False
            flag = probe.stop.requested
            dist = _dist()
            if dist is None:
                return flag
            import torch

            t = torch.tensor([1 if flag else 0], device=args.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return bool(t.item())

        def on_step_end(self, args, state, control, **kwargs):
            self._step_s = time.monotonic() - self._t0
            if self.sdc is not None:  # after the optimizer step; the record goes out in on_log
                self._sdc_keys = self.sdc.after_step(state.global_step)
            if state.global_step < state.max_steps and self._stop_agreed(args):
                _log(f"stop requested: checkpointing step {state.global_step} and stopping")
                self.stopped_at = state.global_step
                control.should_save = True
                control.should_training_stop = True
            if state.global_step >= state.max_steps:
                control.should_save = True  # always checkpoint the final step
            # the probe's checkpoint phase starts in PtopsTrainer._save_checkpoint (after on_log's
            # record)

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
            metrics.update(self._sdc_keys)
            self._sdc_keys = {}
            if (
                heldout is not None
            ):  # [eval]: eval/<name> keys on this step's record (recipes/trl/evalloop.py)
                metrics.update(heldout(kwargs.get("model"), step))
            if more is not None:
                metrics.update(more())
            probe.step(step, metrics)

        def on_save(self, args, state, control, **kwargs):
            """The save of this step ended (committed or aborted in ``_save_checkpoint``): rank 0
            reports ``checkpoint`` or ``checkpoint_failed``. Training goes on after a failed
            save; a failed final (or on-request) save raises on every rank."""
            step = state.global_step
            final = step >= state.max_steps or self.stopped_at == step
            txn = saves.txn if saves.step == step else None
            path = txn.path if txn is not None else Path(args.output_dir) / f"checkpoint-{step}"
            err = (
                "the save of this step never started"
                if txn is None
                else (None if txn.ok else txn.error)
            )
            total = time.monotonic() - saves.t0 if txn is not None else 0.0
            if err is not None:
                saves.failures.append({"step": step, "error": err, "final": final})
                _log(
                    f"checkpoint-{step} FAILED, not committed ({err}); training goes on"
                    if not final
                    else f"checkpoint-{step} FAILED, not committed ({err})"
                )
                if state.is_world_process_zero:
                    probe.event(
                        "checkpoint_failed", step=step, path=str(path), error=err, final=final
                    )
            elif state.is_world_process_zero:
                if txn.pruned:
                    _log(f"retention: deleted {', '.join(txn.pruned)}")
                if txn.prune_error:
                    _log(f"retention failed: {txn.prune_error}")
                # a synchronous save: training was blocked for all of it
                probe.event(
                    "checkpoint",
                    step=step,
                    path=str(path),
                    blocking_s=round(total, 4),
                    total_s=round(total, 4),
                    mode="sync",
                )
            probe.phase("step", step)
            probe.faults.after_checkpoint(step)  # corrupt-ckpt fires once the save is committed
            if err is not None and final:
                raise RuntimeError(
                    f"the {'final' if self.stopped_at != step else 'on-request'} checkpoint "
                    f"(step {step}) "
                    f"could not be saved: {err}; the last good checkpoint is the newest one "
                    "committed"
                )

    return ProbeCallback()


# ---------------------------------------------------------------- trainers


def _common_args(recipe, out_dir: Path) -> dict[str, Any]:
    sec = recipe.trl  # on a GPU: one per rank (LOCAL_RANK), NCCL; without one: CPU and gloo
    return (
        dict(
            output_dir=str(out_dir),
            max_steps=recipe.train.steps,
            seed=recipe.train.seed,
            learning_rate=sec.lr,
            per_device_train_batch_size=sec.per_device_batch_size,
            gradient_accumulation_steps=sec.grad_accum,
            max_grad_norm=sec.max_grad_norm,
            use_cpu=not _cuda(),
            full_determinism=_cuda(),  # deterministic kernels: recovery stays exact on a GPU too
            bf16=bool(sec.bf16 and _cuda()),
            fp16=False,
            logging_steps=1,
            # a NaN loss must reach the monitors, not be averaged away
            logging_nan_inf_filter=False,
            report_to=[],
            save_strategy="steps",
            save_steps=recipe.checkpoint.interval,
            # retention is ptops.ckpt.prune after each commit (never the last good one)
            save_total_limit=None,
            disable_tqdm=True,
            dataloader_num_workers=0,
            ddp_find_unused_parameters=False,
        )
        | _checkpointing_arg(sec.activation_checkpointing)
        | (
            {"ddp_backend": "gloo"}
            if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _cuda()
            else {}
        )
        | fsdp_args(sec, _cuda())
    )


def _checkpointing_arg(on: bool) -> dict[str, bool]:
    """TRL defaults gradient checkpointing on; a 100k-parameter model only pays the recompute.
    transformers 5.24 renamed the argument; vLLM's CPU build holds transformers < 5.20."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    name = (
        "activation_checkpointing"
        if "activation_checkpointing" in fields
        else "gradient_checkpointing"
    )
    return {name: on}


def fsdp_args(sec, on_gpu: bool) -> dict[str, Any]:
    """``[trl] fsdp = true``: transformers' FSDP full shard, wrapped per decoder layer (GPU
    only)."""
    if not (sec.fsdp and on_gpu):
        return {}
    layer = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer"}[sec.model.arch]
    return {
        "fsdp": "full_shard auto_wrap",
        "fsdp_config": {"transformer_layer_cls_to_wrap": [layer]},
    }


def build_trainer(recipe, probe, run: RunDir):
    """The recipe's trainer, with the engine seam (``engine.py``) around its vLLM engine and the
    grader seam (``grader.py``) around its reward functions."""
    from ptops.recipes.trl import engine
    from ptops.recipes.trl.grader import GraderSeam

    seam = engine.for_recipe(recipe, probe, run.path)
    graded = GraderSeam(probe) if recipe.trl.trainer in ("grpo", "rloo") else None
    parts = [p for p in (seam, graded) if p is not None]

    def more() -> dict:
        out: dict = {}
        for part in parts:
            out.update(part.metrics())
        return out

    trainer = _build_trainer(recipe, probe, run, more if parts else None)
    for part in parts:
        part.attach(trainer)
    return trainer


def _build_trainer(recipe, probe, run: RunDir, more=None):
    from datasets import Dataset

    from ptops.recipes import assets
    from ptops.recipes.trl.model import load_model, load_tokenizer, model_dir

    sec = recipe.trl
    mdir = (
        model_dir(sec.model, seed=sec.model.seed)
        if not sec.model.pretrained
        else Path(sec.model.pretrained)
    )
    tokenizer = load_tokenizer(mdir)
    # train.init_from (a pipeline stage's input): its verified weights replace the initial ones
    from ptops.recipes import init_from
    from ptops.recipes.trl import evalloop

    wdir = init_from.weights_dir(recipe) or mdir
    args = _common_args(recipe, run.checkpoints)
    tally = _StepTally()
    from ptops.recipes.sdc import every_of

    sdc_every = every_of(recipe)
    saves = _SaveState(recipe.checkpoint.keep, sdc_every)
    heldout = evalloop.make(recipe, tokenizer, probe)

    callbacks = [
        _make_callback(
            probe, tally, recipe.checkpoint.keep, saves, heldout, sdc_every=sdc_every, more=more
        )
    ]
    from ptops.recipes.trl import rollback

    callbacks += rollback.callbacks(probe)  # PTOPS_ROLLBACK: lr factor after a rollback
    from ptops.recipes.trl import catalogue

    if sec.trainer in catalogue.TRAINERS:  # LoRA SFT, reward model, RLOO, GKD
        return catalogue.build(
            recipe,
            probe,
            run,
            args,
            tokenizer,
            str(wdir),
            lambda base: _make_trainer_class(base, probe, tally, saves),
            callbacks,
        )
    model = load_model(wdir)

    if sec.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(
            **args, max_length=sec.max_length, packing=False, assistant_only_loss=True
        )
        from ptops.recipes.trl import (
            rejection,
        )  # train.data_file: a rejection-sampling stage's kept rows

        data = Dataset.from_list(rejection.rows(recipe) or assets.chat_dataset(sec.dataset_size))
        cls = _make_trainer_class(SFTTrainer, probe, tally, saves)
        return cls(
            model=model,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=callbacks,
        )

    if sec.trainer == "dpo":
        from trl import DPOConfig, DPOTrainer

        config = DPOConfig(
            **args, max_length=sec.max_length, beta=sec.beta, precompute_ref_log_probs=False
        )
        data = Dataset.from_list(assets.preference_dataset(sec.dataset_size))
        ref_model = load_model(wdir)  # the reference is the policy's starting point
        cls = _make_trainer_class(DPOTrainer, probe, tally, saves)
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

        from ptops.recipes.trl import vllm
        from ptops.recipes.trl.rewards import reward_dataset, reward_setup

        # [trl] reward picks the functions and the rows they read (rewards.py); rank 0 reports
        # reward_source
        reward_funcs, reward_weights = reward_setup(
            sec.reward, sec.verifier, section=sec, probe=probe
        )

        config = GRPOConfig(
            **args,
            num_generations=sec.num_generations,
            max_completion_length=sec.max_completion_length,
            beta=sec.beta,
            temperature=sec.temperature,
            reward_weights=reward_weights,
            **vllm.config_kwargs(
                sec, probe
            ),  # [trl.vllm]; falls back to generate (one line) without a GPU
            log_completions=False,
        )
        data = Dataset.from_list(reward_dataset(sec))
        cls = _make_trainer_class(GRPOTrainer, probe, tally, saves)
        return cls(
            model=model,
            reward_funcs=reward_funcs,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=callbacks,
        )

    raise ValueError(f"[trl].trainer: unknown trainer {sec.trainer!r}")


def choose_resume(run: RunDir, world: int, probe: Any = None) -> Path | None:
    """Rank 0 asks ``ptops.ckpt.resume_point`` (the supervisor's verified choice, or the newest
    good checkpoint, newer bad ones quarantined); every rank gets the same answer."""

    def pick() -> str:
        from ptops.recipes.resume import resume_entry

        entry = resume_entry(
            run.checkpoints, probe=probe, world_size=world, versions=versions(*VERSIONED), log=_log
        )
        return entry.path if entry is not None else ""

    dist = _dist()
    if dist is None:
        chosen = pick()
    else:
        box = [pick() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        chosen = box[0]
    return Path(chosen) if chosen else None


def preload() -> None:
    """What a warm pool imports ahead of a rank (``ops/rank/warm.py``): torch, transformers,
    datasets, peft and TRL's trainers, most of a TRL rank's start-up (bench/README.md)."""
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers  # noqa: F401
    from trl import DPOTrainer, GRPOTrainer, RewardTrainer, RLOOTrainer, SFTTrainer  # noqa: F401


def main(recipe, probe) -> None:
    from ptops.ckpt import checkpoint_path

    for key, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("HF_DATASETS_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
        ("HF_HUB_DISABLE_TELEMETRY", "1"),
        # report_to=[]: ranks report through the probe; importing mlflow here only costs ~1-3 s per
        # rank
        ("DISABLE_MLFLOW_INTEGRATION", "TRUE"),
    ):
        os.environ.setdefault(key, value)
    # TRL 1.16 still calls transformers' deprecated gradient_checkpointing names on every save
    warnings.filterwarnings(
        "ignore", message=r".*gradient_checkpointing.* is deprecated", category=FutureWarning
    )
    run = RunDir(Path(os.environ["PTOPS_RUN_DIR"]))
    run.checkpoints.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    t0 = time.monotonic()
    # transformers initialises the process group lazily, inside the trainer's build
    probe.startup("build")
    probe.faults.on_startup("build")
    trainer = build_trainer(recipe, probe, run)
    dist = _dist()
    probe.world(dist.get_world_size() if dist else 1, dist.get_rank() if dist else 0)
    probe.startup("load")
    probe.faults.on_startup("load")
    probe.stop.accept()  # a stop request: the callback saves the step and training returns
    resume = choose_resume(run, world, probe)
    _log(
        f"{recipe.trl.trainer} trainer ready in {time.monotonic() - t0:.1f}s; "
        + (f"resuming from {resume}" if resume else "starting fresh")
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    final = trainer.state.global_step
    if final >= recipe.train.steps and checkpoint_path(run.checkpoints, final) is None:
        # belt and braces: the callback asks for a save at max_steps; make sure it exists
        # (same path as a regular save: guarded save, commit, events; raises if it fails)
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
    stopped = next(
        (cb.stopped_at for cb in trainer.callback_handler.callbacks if hasattr(cb, "stopped_at")),
        None,
    )
    _log(
        f"stopped on request at step {final}"
        if stopped is not None
        else f"finished at step {final}"
    )
