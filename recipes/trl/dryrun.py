"""``ptops launch TRL-RECIPE --dry-run``'s build, in a subprocess of the CLI (torch stays out of
it).

``python -m ptops.recipes.trl.dryrun RECIPE.json WORLD`` prints one ``PTOPS_DRYRUN {json}`` line:

- the recipe's stated architecture as a transformers config, the model instantiated on the *meta*
  device (no weights, no download): exact parameter count; a reward model gets its one-score head;
  LoRA adapters applied with peft (target modules must exist; trainable count); a GKD teacher
  (``trl.teacher_model``) built the same way, its vocabulary checked against the student's;
- the TRL config object the run would build (SFTConfig / RewardConfig / RLOOConfig / GRPOConfig /
  GKDConfig, with the ``[trl.vllm]`` options as on a GPU node with vLLM), so TRL's own
  argument checks run;
- a per-GPU memory estimate (weights, gradients, AdamW state; FSDP shards them over the world;
  reference / teacher models in bf16; vLLM's reserved share), against the GPU of ``trl.target``.
  Activations are not modelled (listed under ``not_checked``).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GIB = 1024**3


def _meta_model(dims, reward: bool = False):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from ptops.recipes.trl.model import hf_config

    config = hf_config(dims, num_labels=1 if reward else None)
    with torch.device("meta"):
        if reward:
            return AutoModelForSequenceClassification.from_config(config)
        return AutoModelForCausalLM.from_config(config)


def _count(model, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _trl_config(recipe, out: str) -> Any:
    """The TRL config object with the run's arguments (as on a GPU node; built on CPU here)."""
    from ptops.recipes.trl import catalogue, vllm
    from ptops.recipes.trl.run import _common_args

    args = _common_args(recipe, Path(out))
    args |= {"use_cpu": True, "bf16": False}  # the CPU this runs on; the GPU run sets bf16 itself
    sec = recipe.trl
    vkw: dict[str, Any] = {}
    if sec.vllm is not None:
        orig = vllm.unavailable
        vllm.unavailable = lambda in_rank=True: None  # check the options TRL gets on a GPU node
        try:
            vkw = vllm.config_kwargs(sec)
        finally:
            vllm.unavailable = orig
    if sec.trainer in catalogue.TRAINERS:
        return catalogue.trl_config(recipe, args, vkw)
    if sec.trainer == "sft":
        from trl import SFTConfig

        return SFTConfig(**args, max_length=sec.max_length)
    if sec.trainer == "dpo":
        from trl import DPOConfig

        return DPOConfig(**args, max_length=sec.max_length, beta=sec.beta)
    from trl import GRPOConfig

    return GRPOConfig(
        **args,
        num_generations=sec.num_generations,
        max_completion_length=sec.max_completion_length,
        beta=sec.beta,
        temperature=sec.temperature,
        **vkw,
    )


def check(recipe, world: int, gpu_gib: float) -> dict[str, Any]:
    sec = recipe.trl
    t0 = time.monotonic()
    res: dict[str, Any] = {
        "ok": True,
        "not_checked": ["activation memory (sequence length x batch) is not modelled"],
    }
    model = _meta_model(sec.model, reward=sec.trainer == "reward")
    n = _count(model)
    res["model"] = type(model).__name__
    res["params"] = n
    trainable = n
    if sec.trainer == "lora_sft":
        from peft import get_peft_model

        from ptops.recipes.trl.catalogue import lora_config

        peft_model = get_peft_model(model, lora_config(sec))  # raises if no target module matches
        trainable = _count(peft_model, trainable_only=True)
        res["lora_modules"] = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, _ in peft_model.named_modules()
                if name.endswith(tuple(sec.lora.target_modules)) and "lora" not in name
            }
        )
    res["trainable_params"] = trainable
    shard = world if sec.fsdp else 1
    mem = {
        "weights_gib": (2 if sec.bf16 else 4) * (n - trainable) / shard / GIB,
        "trainable_gib": 16 * trainable / shard / GIB,
    }  # fp32 weights + grads + AdamW m, v
    if sec.trainer in ("rloo", "grpo", "dpo") and sec.beta > 0:
        mem["reference_gib"] = 2 * n / shard / GIB
    if sec.trainer == "gkd":
        tdims = sec.teacher_model or sec.model
        teacher = _meta_model(tdims)
        res["teacher_model"] = type(teacher).__name__
        res["teacher_params"] = _count(teacher)
        if teacher.config.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"trl.teacher_model: vocabulary {teacher.config.vocab_size} differs from the "
                f"student's {model.config.vocab_size} (they share a tokenizer)"
            )
        mem["teacher_gib"] = 2 * res["teacher_params"] / shard / GIB
        res["not_checked"].append(
            f"the teacher checkpoint itself ({sec.teacher or 'built-in tiny teacher'}): "
            "resolved, verified and pinned when the run starts"
        )
    if sec.vllm is not None:
        v = sec.vllm
        if v.mode == "colocate":
            mem["vllm_reserved_gib"] = v.gpu_memory_utilization * gpu_gib
        else:
            server_weights = 2 * n / v.tensor_parallel_size / GIB
            res["vllm_server_weights_gib_per_gpu"] = round(server_weights, 2)
            if server_weights > v.gpu_memory_utilization * gpu_gib:
                raise ValueError(
                    f"trl.vllm: the server's bf16 weights ({server_weights:.1f} GiB per GPU at "
                    f"tensor_parallel_size {v.tensor_parallel_size}) exceed gpu_memory_utilization "
                    f"{v.gpu_memory_utilization} x {gpu_gib:.0f} GiB"
                )
    res["memory_gib"] = {k: round(v, 2) for k, v in mem.items()}
    res["memory_total_gib"] = round(sum(mem.values()), 2)
    res["gpu_gib"] = gpu_gib
    res["fits"] = res["memory_total_gib"] <= gpu_gib
    with tempfile.TemporaryDirectory(prefix="ptops-trl-dryrun-") as out:
        cfg = _trl_config(recipe, out)
    res["trl_config"] = type(cfg).__name__
    res["use_vllm"] = bool(getattr(cfg, "use_vllm", False))
    res["seconds"] = round(time.monotonic() - t0, 2)
    return res


def main(argv: list[str]) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    from ptops.recipes.schema import from_json

    recipe = from_json(Path(argv[0]).read_text())
    world, gpu_gib = int(argv[1]), float(argv[2])
    try:
        res = check(recipe, world, gpu_gib)
    except Exception as e:  # noqa: BLE001 - reported as one line by the CLI
        res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print("PTOPS_DRYRUN " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
