"""torchtitan ``config_registry`` for ptops recipes: ``--module ptops.recipes.titan.registry``.

``ptops_recipe()`` turns the run's ``[titan]`` recipe (``PTOPS_RUN_DIR/recipe.json``,
or the recipe handed over by ``run.main``) into a ``ProbeTrainer.Config``: a
small llama3-family model, the locally built tokenizer, the generated text
corpus, DCP checkpoints in ``RUN_DIR/checkpoints`` and torchtitan's dump folder
in ``RUN_DIR/titan``. Importing this module applies the CPU compatibility
layer first, so torchtitan's own CLI also works with it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ptops import envnames
from ptops.recipes.titan import compat, context

compat.apply()

from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.components.validate import Validator  # noqa: E402
from torchtitan.config import ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.config.configs import CommConfig, DebugConfig  # noqa: E402
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader  # noqa: E402
from torchtitan.models import llama3  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim  # noqa: E402
from torchtitan.protocols.model_spec import ModelSpec  # noqa: E402

from ptops.recipes.sdc import every_of  # noqa: E402
from ptops.recipes.titan.checkpointing import ProbeCheckpointManager  # noqa: E402
from ptops.recipes.titan.dataset import register_local_text_dataset  # noqa: E402
from ptops.recipes.titan.metrics import ProbeMetricsProcessor  # noqa: E402
from ptops.recipes.titan.trainer import PoisonableCrossEntropyLoss, ProbeTrainer  # noqa: E402


def tiny_llama3(dim: int, n_layers: int, n_heads: int, vocab_size: int, seq_len: int) -> ModelSpec:
    """A llama3-family model of the given size, built with torchtitan's llama3 builders."""
    model = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab_size, param_init=llama3._output_linear_init(dim)
        ),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=64),
            rope=ComplexRoPE.Config(
                dim=dim // n_heads, max_seq_len=max(seq_len, 256), theta=500000, scaling="llama"
            ),
            attn_backend="flex",
        ),
    )
    compat.sdpa_instead_of_flex(model)
    return ModelSpec(
        name="llama3",
        flavor=f"ptops-d{dim}-l{n_layers}-h{n_heads}",
        model=model,
        parallelize_fn=llama3.parallelize_llama,
        pipelining_fn=llama3.pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=llama3.Llama3StateDictAdapter,
    )


def converters(recipe: Any, *, dry_run: bool = False) -> list:
    """``[titan.float8]`` as TorchTitan's own model converters (none when float8 is off).

    ``dry_run``: the fake-backend check on a machine without SM89 swaps the modules in emulation
    (same Float8Linear modules and sharding, no fp8 kernels).
    """
    from torchtitan.components.quantization import (
        Float8GroupedExpertsConverter,
        Float8LinearConverter,
    )

    t = recipe.titan
    f8 = t.float8
    if not f8.enabled:
        return []
    compiled = t.compile.enable and "model" in t.compile.components
    emulate = f8.emulate or dry_run
    out = [
        Float8LinearConverter.Config(
            recipe_name=f8.recipe,
            filter_fqns=list(f8.filter_fqns),
            emulate=emulate,
            model_compile_enabled=compiled and not emulate,
        )
    ]
    if f8.moe_experts and not dry_run:
        out.append(Float8GroupedExpertsConverter.Config(model_compile_enabled=compiled))
    return out


def model_spec(recipe: Any, *, dry_run: bool = False) -> ModelSpec:
    """The recipe's model: a flavor of TorchTitan's registry, or the small llama3 (SDPA,
    CPU-trainable)."""
    t = recipe.titan
    m = t.model
    conv = converters(recipe, dry_run=dry_run)
    if m.flavor:
        if m.family == "qwen3":
            from torchtitan.models import qwen3

            return qwen3.model_registry(m.flavor, converters=conv or None)
        return llama3.model_registry(m.flavor, converters=conv or None)
    spec = tiny_llama3(m.dim, m.n_layers, m.n_heads, m.vocab_size, t.seq_len)
    for c in conv:
        spec.model = c.build().convert(spec.model)
    return spec


def activation_checkpoint(recipe: Any) -> Any:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    mode = recipe.titan.activation_checkpoint.mode
    return {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[mode]


def trainer_config(recipe: Any, run_dir: Path, *, dry_run: bool = False) -> ProbeTrainer.Config:
    """The torchtitan job config of a ptops titan recipe: every ``[titan]`` key onto its TorchTitan
    field."""
    from torchtitan.config import CompileConfig
    from torchtitan.models.common.config_utils import decoder_vocab_size

    from ptops.recipes.assets import tokenizer_dir

    t = recipe.titan
    m, par = t.model, t.parallelism
    keep = recipe.checkpoint.keep
    # train.init_from (a pipeline stage's input): a verified DCP checkpoint, loaded model-only by
    # TorchTitan's initial load when the run has no checkpoint of its own (recipes/init_from.py)
    init_dir = None
    if recipe.train.init_from and not dry_run:
        from ptops.recipes.init_from import weights_dir

        init_dir = str(weights_dir(recipe))
    spec = model_spec(recipe, dry_run=dry_run)
    if (
        par.cp > 1
    ):  # torch's own CP option (TorchTitan 0.3.0 has no config field for it); process-global
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(par.cp_rotate_method)
    vocab = decoder_vocab_size(spec)
    on_cpu = not compat._has_accelerator()
    async_mode = "disabled"
    if t.async_checkpoint:
        async_mode = (
            "async_with_pinned_mem" if (t.pinned_memory_checkpoint and not on_cpu) else "async"
        )
    return ProbeTrainer.Config(
        model_spec=spec,
        # a dry run reads no real tokenizer or corpus: the local ones stand in (no step runs)
        hf_assets_path=(t.hf_assets_path and not dry_run and t.hf_assets_path)
        or str(tokenizer_dir(m.vocab_size)),
        dump_folder=str(run_dir / "titan"),
        loss=PoisonableCrossEntropyLoss.Config(global_vocab_size=vocab),
        optimizer=default_adamw(lr=t.lr),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=t.warmup_steps, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ),
        training=TrainingConfig(
            local_batch_size=t.local_batch_size,
            global_batch_size=t.global_batch_size,
            seq_len=t.seq_len,
            steps=recipe.train.steps,
            max_norm=t.max_norm,
            mixed_precision_param=t.mixed_precision_param,
            disable_cuda_graphs=compat.CPU_FLAGS["training.disable_cuda_graphs"],
        ),
        dataloader=HuggingFaceTextDataLoader.Config(
            dataset=(not dry_run and t.dataset) or register_local_text_dataset(recipe.train.seed),
            infinite=True,
        ),
        metrics=ProbeMetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=par.dp_shard,
            data_parallel_replicate_degree=par.dp_replicate,
            fsdp_reshard_after_forward=par.fsdp_reshard_after_forward,
            tensor_parallel_degree=par.tp,
            pipeline_parallel_degree=par.pp,
            pipeline_parallel_schedule=par.pp_schedule,
            pipeline_parallel_microbatch_size=par.pp_microbatch_size,
            pipeline_parallel_first_stage_less_layers=0,
            pipeline_parallel_last_stage_less_layers=0,
            context_parallel_degree=par.cp,
            context_parallel_load_balancer=None
            if par.cp_load_balancer == "none"
            else par.cp_load_balancer,
            expert_parallel_degree=par.ep,
            spmd_backend=compat.CPU_FLAGS["parallelism.spmd_backend"],
        ),
        checkpoint=ProbeCheckpointManager.Config(
            enable=True,
            folder=str(run_dir / "checkpoints"),
            interval=recipe.checkpoint.interval,
            keep_latest_k=0,  # torchtitan's purge is off: ptops.ckpt.prune after each commit
            keep=keep,
            sdc_every=every_of(recipe),
            async_mode=async_mode,
            last_save_model_only=False,
            initial_load_path=init_dir or (not dry_run and t.initial_load_path) or None,
            initial_load_in_hf=False if init_dir else t.initial_load_in_hf,
        ),
        activation_checkpoint=activation_checkpoint(recipe),
        compile=CompileConfig(enable=t.compile.enable, components=list(t.compile.components)),
        validator=Validator.Config(enable=False),
        # the flight recorder's size: torchtitan overrides TORCH_FR_BUFFER_SIZE with it, so it
        # passes on the supervisor's setting (hang analysis: diagnostics/flightrec.py; gloo records
        # too)
        comm=CommConfig(trace_buf_size=_fr_buffer_size(), train_timeout_seconds=t.train_timeout_s),
        debug=DebugConfig(seed=recipe.train.seed, deterministic=t.deterministic),
    )


def _fr_buffer_size() -> int:
    try:
        return max(0, int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0))
    except ValueError:
        return 0


def ptops_recipe() -> ProbeTrainer.Config:
    """config_registry entry: the recipe of ``$PTOPS_RUN_DIR`` as a torchtitan job config."""
    return trainer_config(context.get_recipe(), Path(os.environ[envnames.RUN_DIR]))
