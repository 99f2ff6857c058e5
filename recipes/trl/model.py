"""The tiny Qwen2-style causal LM that TRL recipes train on CPU.

Built deterministically from a seed and the local tokenizer, saved with
``save_pretrained`` into the ptops asset cache (``assets.build_once``: one builder,
checked by loading it before it is marked complete) and loaded with
``from_pretrained`` offline. The same folder serves as DPO's reference model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ptops.recipes.assets import AssetError, build_once, tokenizer_dir
from ptops.recipes.trl.config import TrlModel


def _config_dict(dims: TrlModel, tok_dir: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    heads = dims.num_heads
    if dims.hidden_size % heads:
        raise ValueError(
            f"[trl].model: hidden_size {dims.hidden_size} is not divisible by num_heads {heads}"
        )
    return dict(
        vocab_size=len(tok),
        hidden_size=dims.hidden_size,
        intermediate_size=dims.hidden_size * 2,
        num_hidden_layers=dims.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        use_cache=True,
    )


def _build(dims: TrlModel, seed: int, out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok_dir = tokenizer_dir(dims.vocab_size)
    config = Qwen2Config(**_config_dict(dims, tok_dir))
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )
    # Once a process group exists, transformers writes weights and config.json on global rank 0
    # only; this process holds the asset's build lock (rank 1, or local rank 0 of another node, may
    # be the builder), so it is the process that saves.
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    model.save_pretrained(str(out), safe_serialization=True, is_main_process=True)
    AutoTokenizer.from_pretrained(str(tok_dir)).save_pretrained(str(out))
    # keep the chat template exactly as the tokenizer asset has it
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = tok_dir / name
        if src.exists():
            shutil.copy2(src, out / name)
    (out / "ptops_model.json").write_text(json.dumps({"seed": seed, **dims.model_dump()}, indent=2))


def model_dir(dims: TrlModel, seed: int = 0) -> Path:
    """Folder with a ``from_pretrained``-loadable tiny Qwen2 model and its tokenizer."""
    name = (
        f"trl-qwen2-h{dims.hidden_size}-l{dims.num_layers}-a{dims.num_heads}"
        f"-v{dims.vocab_size}-s{seed}"
    )
    return build_once(
        name, lambda out: _rng_kept(_build, dims, seed, out), lambda out: _rng_kept(_check, out)
    )


def _rng_kept(fn, *args) -> None:
    """Building seeds torch: the caller's RNG must not depend on whether the cache was empty (a
    judge built on a fresh cache moved the training RNG; a warm cache did not)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        fn(*args)


def _check(path: Path) -> None:
    """Complete means it loads: config (with its model_type), every weight, the tokenizer."""
    model, info = _load(path, "float32", output_loading_info=True)
    missing = [k for k in info.get("missing_keys") or () if k not in _tied(model)]
    if missing or info.get("unexpected_keys") or info.get("mismatched_keys"):
        raise AssetError(
            f"{path}: weights do not match the model (missing {missing[:3]}, "
            f"unexpected {list(info.get('unexpected_keys') or ())[:3]})"
        )
    load_tokenizer(path)


def _tied(model) -> set[str]:
    return set(
        getattr(model, "_tied_weights_keys", None) or ()
    )  # a list, or a dict keyed by the tied name


def _load(path: Path, dtype: str, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True, **kw)


def load_model(path: Path, dtype: str = "float32"):
    return _load(path, dtype)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def hf_config(dims: TrlModel, num_labels: int | None = None):
    """The transformers config of a recipe's stated architecture, built without any download
    (production recipes and ``--dry-run``; the tiny recipes use :func:`model_dir`)."""
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[dims.arch]
    kw = dict(
        vocab_size=dims.vocab_size,
        hidden_size=dims.hidden_size,
        intermediate_size=dims.intermediate_size or 2 * dims.hidden_size,
        num_hidden_layers=dims.num_layers,
        num_attention_heads=dims.num_heads,
        num_key_value_heads=dims.num_kv_heads or dims.num_heads,
        max_position_embeddings=dims.max_position_embeddings,
        tie_word_embeddings=dims.tie_word_embeddings,
    )
    if num_labels is not None:
        kw["num_labels"] = num_labels
    config = cls(**kw)
    try:
        config.rope_parameters = {"rope_type": "default", "rope_theta": dims.rope_theta}
    except (AttributeError, TypeError, ValueError):
        config.rope_theta = dims.rope_theta
    return config


def policy_dir(dims: TrlModel) -> str:
    """What ``from_pretrained`` loads: the production weights when the recipe names them, else the
    tiny model."""
    return dims.pretrained if dims.pretrained else str(model_dir(dims, seed=dims.seed))


def load_reward_model(path, seed: int):
    """A sequence-classification (one score) head on the causal LM's body; the head is initialised
    from ``seed`` so that two fresh runs start bit-identical."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_pretrained(
        str(path), num_labels=1, dtype="float32", local_files_only=True
    )
