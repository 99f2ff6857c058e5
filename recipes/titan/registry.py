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

from ptops.recipes.titan import compat

compat.apply()

from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer  # noqa: E402
from torchtitan.components.validate import Validator  # noqa: E402
from torchtitan.config import ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.config.configs import CommConfig, DebugConfig  # noqa: E402
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader  # noqa: E402
from torchtitan.models import llama3  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim  # noqa: E402
from torchtitan.protocols.model_spec import ModelSpec  # noqa: E402

from ptops.recipes.titan.trainer import (  # noqa: E402
    PoisonableCrossEntropyLoss,
    ProbeCheckpointManager,
    ProbeMetricsProcessor,
    ProbeTrainer,
    register_local_text_dataset,
)

_RECIPE: Any = None


def set_recipe(recipe: Any) -> None:
    global _RECIPE
    _RECIPE = recipe


def _recipe() -> Any:
    if _RECIPE is not None:
        return _RECIPE
    from ptops.recipes.schema import from_json

    run_dir = Path(os.environ["PTOPS_RUN_DIR"])
    return from_json((run_dir / "recipe.json").read_text())


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
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=max(seq_len, 256), theta=500000, scaling="llama"),
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


def trainer_config(recipe: Any, run_dir: Path) -> ProbeTrainer.Config:
    """The torchtitan job config of a ptops titan recipe."""
    from ptops.recipes.assets import tokenizer_dir

    t = recipe.titan
    m, par = t.model, t.parallelism
    keep = recipe.checkpoint.keep
    return ProbeTrainer.Config(
        model_spec=tiny_llama3(m.dim, m.n_layers, m.n_heads, m.vocab_size, t.seq_len),
        hf_assets_path=str(tokenizer_dir(m.vocab_size)),
        dump_folder=str(run_dir / "titan"),
        loss=PoisonableCrossEntropyLoss.Config(global_vocab_size=m.vocab_size),
        optimizer=default_adamw(lr=t.lr),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=t.warmup_steps, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ),
        training=TrainingConfig(
            local_batch_size=t.local_batch_size,
            seq_len=t.seq_len,
            steps=recipe.train.steps,
            max_norm=t.max_norm,
            mixed_precision_param="float32",
            disable_cuda_graphs=compat.CPU_FLAGS["training.disable_cuda_graphs"],
        ),
        dataloader=HuggingFaceTextDataLoader.Config(
            dataset=register_local_text_dataset(recipe.train.seed), infinite=True
        ),
        metrics=ProbeMetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=par.dp_shard,
            data_parallel_replicate_degree=par.dp_replicate,
            tensor_parallel_degree=par.tp,
            pipeline_parallel_degree=par.pp,
            pipeline_parallel_schedule=par.pp_schedule,
            pipeline_parallel_first_stage_less_layers=0,
            pipeline_parallel_last_stage_less_layers=0,
            spmd_backend=compat.CPU_FLAGS["parallelism.spmd_backend"],
        ),
        checkpoint=ProbeCheckpointManager.Config(
            enable=True,
            folder=str(run_dir / "checkpoints"),
            interval=recipe.checkpoint.interval,
            keep_latest_k=0,  # torchtitan's purge is off: ptops.ckpt.prune after each commit
            keep=keep,
            async_mode="async" if t.async_checkpoint else "disabled",
            last_save_model_only=False,
        ),
        activation_checkpoint=None,  # no AC: tiny model, saves recompute time
        validator=Validator.Config(enable=False),
        # the flight recorder's size: torchtitan overrides TORCH_FR_BUFFER_SIZE with it, so it passes on the
        # supervisor's setting (hang analysis: diagnostics/flightrec.py; gloo records too)
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
    return trainer_config(_recipe(), Path(os.environ["PTOPS_RUN_DIR"]))
