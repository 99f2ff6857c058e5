"""The catalogue trainers: LoRA SFT (peft), reward model, RLOO, GKD distillation.

Each builds the same way as SFT/DPO/GRPO in ``run.py`` (the ptops trainer subclass, the
probe callback, the guarded save), so checkpoints, resume and faults behave the same:

- ``lora_sft``: SFTTrainer with a peft ``LoraConfig``; only the adapters train, and a
  checkpoint holds ``adapter_model.safetensors`` (no base weights): ``ptops ckpt digest``
  covers the adapter weights and their optimizer moments (the frozen base is the
  recipe's model, fixed by its seed or ``trl.model.pretrained``).
- ``reward``: RewardTrainer on a one-score sequence-classification head over the tiny
  body (head initialised from ``trl.model.seed``: two fresh runs start identical).
- ``rloo``: RLOOTrainer with the arithmetic verifiable reward of the GRPO recipe.
- ``gkd``: ``trl.experimental.gkd.GKDTrainer`` with a teacher read from ``trl.teacher``
  (a run directory: its newest *verified* checkpoint; or a checkpoint folder). The
  first attempt pins that checkpoint and its digest in ``RUN_DIR/teacher.json`` and
  emits ``teacher {path, digest, step}``; a resumed attempt reuses the pin and refuses a
  teacher whose digest changed (a stage must not resume against other weights).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ptops.ops.runrecord import ranklog

TRAINERS = ("lora_sft", "reward", "rloo", "gkd")


# ---------------------------------------------------------------- teacher


class TeacherError(ValueError):
    pass


def resolve_teacher(spec: str) -> Path:
    """A checkpoint folder as is (verified deep); a run directory or a checkpoints folder: its
    newest good checkpoint (deep-verified)."""
    from ptops.ckpt import detect_kind, latest_good, verify

    p = Path(spec).expanduser()
    if not p.exists():
        raise TeacherError(f"[trl].teacher: {p} not found (a run directory or a checkpoint folder)")
    if (
        (p / "trainer_state.json").is_file()
        or detect_kind(p) == "trl"
        and p.name.startswith("checkpoint-")
    ):
        res = verify(p, deep=True)  # a checkpoint folder
        if not res.ok:
            raise TeacherError(f"[trl].teacher: {p} fails verification: {res.reason}")
        return p
    if (p / "config.json").is_file():
        return p  # a plain model folder (e.g. released weights)
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    entry = latest_good(root, deep=True)
    if entry is None:
        raise TeacherError(f"[trl].teacher: no verified checkpoint under {root}")
    return Path(entry.path)


def teacher_digest(path: Path) -> str:
    from ptops.ckpt import digest

    if (path / "trainer_state.json").exists():
        return digest(path)
    from ptops.recipes.assets import digest_dir

    return "dir:" + digest_dir(path)  # a plain model folder (no optimizer): its files' hash


def pin_teacher(spec: str, run_dir: Path) -> dict[str, Any]:
    """Rank 0: the teacher this run distils from, pinned on the first attempt (``teacher.json``)."""
    pin_file = run_dir / "teacher.json"
    if pin_file.is_file():
        pin = json.loads(pin_file.read_text())
        path = Path(pin["path"])
        if not path.exists():
            raise TeacherError(f"[trl].teacher: the pinned teacher {path} is gone (teacher.json)")
        try:
            now = teacher_digest(path)
        except Exception as e:  # noqa: BLE001 - a damaged file: torch/safetensors errors of any type
            raise TeacherError(
                f"[trl].teacher: the pinned teacher {path} cannot be read: {type(e).__name__}: {e}"
            )
        if now != pin["digest"]:
            raise TeacherError(
                f"[trl].teacher: the pinned teacher {path} changed (digest {now[:12]}, "
                f"pinned {pin['digest'][:12]}); refusing to resume against other weights"
            )
        return {**pin, "pinned": True}
    path = resolve_teacher(spec)
    cfg = path / "config.json"
    archs = json.loads(cfg.read_text()).get("architectures") or [] if cfg.is_file() else []
    if (
        archs
        and not any(a.endswith("ForCausalLM") for a in archs)
        and not (path / "adapter_config.json").is_file()
    ):
        raise TeacherError(
            f"[trl].teacher: {path} holds a {archs[0]}, not a causal LM (a reward model's run?)"
        )
    step = None
    state = path / "trainer_state.json"
    if state.is_file():
        step = json.loads(state.read_text()).get("global_step")
    pin = {"spec": spec, "path": str(path), "digest": teacher_digest(path), "step": step}
    tmp = pin_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(pin, indent=2))
    os.replace(tmp, pin_file)
    return {**pin, "pinned": False}


def frozen_dtype(sec) -> str:
    """Weights that never train (LoRA's base, the teacher): bf16 on GPUs with ``trl.bf16``, else
    fp32."""
    from ptops.recipes.trl.device import cuda

    return "bfloat16" if sec.bf16 and cuda() else "float32"


def load_teacher(path: Path, dtype: str = "float32"):
    """A full checkpoint or model folder; a LoRA checkpoint (adapters only) merged into its base."""
    from transformers import AutoModelForCausalLM

    if (path / "adapter_config.json").is_file() and not any(path.glob("model*.safetensors")):
        from peft import AutoPeftModelForCausalLM

        return AutoPeftModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, local_files_only=True
        ).merge_and_unload()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)


def _teacher(recipe, probe, run_dir: Path):
    """(teacher model, pin) agreed by all ranks: rank 0 resolves and pins, the others read its
    answer."""
    from ptops.recipes.trl.model import load_model, model_dir

    sec = recipe.trl
    if sec.teacher is None:
        dims = sec.teacher_model or sec.model
        path = model_dir(dims, seed=dims.seed + 1)
        return load_model(path, frozen_dtype(sec)), {
            "path": str(path),
            "digest": None,
            "step": None,
            "builtin": True,
        }
    from ptops.recipes.trl.device import dist as _dist

    dist = _dist()
    if dist is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("GKD teacher: the process group must exist before the teacher is pinned")
    rank0 = dist is None or dist.get_rank() == 0
    box: list[Any] = [None]
    if rank0:
        try:
            box[0] = pin_teacher(sec.teacher, run_dir)
        except TeacherError as e:
            box[0] = {"error": str(e)}
    if dist is not None:
        dist.broadcast_object_list(box, src=0)
    pin = box[0]
    if "error" in pin:
        raise TeacherError(pin["error"])
    if rank0:
        ranklog.get("trl").info(
            "teacher %s (digest %s, step %s%s",
            pin["path"],
            str(pin["digest"])[:16],
            pin["step"],
            ", pinned by an earlier attempt)" if pin.get("pinned") else ")",
        )
        probe.event(
            "teacher",
            path=pin["path"],
            digest=pin["digest"],
            step=pin["step"],
            spec=pin["spec"],
            pinned=bool(pin.get("pinned")),
        )
    return load_teacher(Path(pin["path"]), frozen_dtype(sec)), pin


# ---------------------------------------------------------------- configs


def trl_config(recipe, args: dict[str, Any], extra: dict[str, Any] | None = None):
    """The TRL config object of a catalogue trainer (also built by ``--dry-run``)."""
    sec = recipe.trl
    extra = extra or {}
    if sec.trainer == "lora_sft":
        from trl import SFTConfig

        return SFTConfig(**args, max_length=sec.max_length, packing=False, assistant_only_loss=True)
    if sec.trainer == "reward":
        from trl import RewardConfig

        return RewardConfig(**args, max_length=sec.max_length)
    if sec.trainer == "rloo":
        from trl import RLOOConfig

        from ptops.recipes.trl.rewards import REWARD_WEIGHTS

        return RLOOConfig(
            **args,
            num_generations=sec.num_generations,
            max_completion_length=sec.max_completion_length,
            beta=sec.beta,
            temperature=sec.temperature,
            reward_weights=list(REWARD_WEIGHTS),
            log_completions=False,
            **extra,
        )
    if sec.trainer == "gkd":
        from trl.experimental.gkd import GKDConfig

        return GKDConfig(
            **args,
            max_length=sec.max_length,
            temperature=sec.temperature,
            lmbda=sec.lmbda,
            beta=sec.jsd_beta,
            max_new_tokens=sec.max_completion_length,
            seq_kd=False,
        )
    raise ValueError(f"[trl].trainer: {sec.trainer!r} is not a catalogue trainer")


def lora_config(sec):
    from peft import LoraConfig

    lo = sec.lora
    return LoraConfig(
        r=lo.r,
        lora_alpha=lo.alpha,
        lora_dropout=lo.dropout,
        target_modules=list(lo.target_modules),
        task_type="CAUSAL_LM",
        bias="none",
    )


# ---------------------------------------------------------------- trainers


def build(
    recipe, probe, run, args: dict[str, Any], tokenizer, policy: str, make_cls, callbacks: list
):
    """The trainer of a catalogue recipe; ``make_cls(base)`` is run.py's ptops subclass factory."""
    import torch
    from datasets import Dataset

    from ptops.recipes import assets
    from ptops.recipes.trl.model import load_model, load_reward_model

    sec = recipe.trl
    if sec.trainer == "lora_sft":
        from trl import SFTTrainer

        model = load_model(policy, frozen_dtype(sec))
        torch.manual_seed(recipe.train.seed)  # the adapters' initial A matrices
        data = Dataset.from_list(assets.chat_dataset(sec.dataset_size))
        return make_cls(SFTTrainer)(
            model=model,
            args=trl_config(recipe, args),
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=callbacks,
            peft_config=lora_config(sec),
        )
    if sec.trainer == "reward":
        from trl import RewardTrainer

        model = load_reward_model(policy, sec.model.seed)
        data = Dataset.from_list(assets.preference_dataset(sec.dataset_size))
        return make_cls(RewardTrainer)(
            model=model,
            args=trl_config(recipe, args),
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    if sec.trainer == "rloo":
        from trl import RLOOTrainer

        from ptops.recipes.trl import vllm
        from ptops.recipes.trl.rewards import REWARD_FUNCS

        config = trl_config(recipe, args, vllm.config_kwargs(sec, probe))
        data = Dataset.from_list(assets.prompt_dataset(sec.dataset_size))
        return make_cls(RLOOTrainer)(
            model=load_model(policy),
            reward_funcs=list(REWARD_FUNCS),
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    if sec.trainer == "gkd":
        from trl.experimental.gkd import GKDTrainer

        config = trl_config(recipe, args)
        _ = (
            config.device
        )  # transformers starts the process group here: rank 0 alone pins the teacher
        teacher, _pin = _teacher(recipe, probe, Path(run.path))
        data = Dataset.from_list(assets.chat_dataset(sec.dataset_size))
        return make_cls(GKDTrainer)(
            model=load_model(policy),
            teacher_model=teacher,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    raise ValueError(f"[trl].trainer: {sec.trainer!r} is not a catalogue trainer")
