"""Rejection sampling: N sampled answers per prompt from a checkpoint, the best by the verifier
kept.

``python -m ptops.recipes.trl.rejection --from CKPT --out DATA.jsonl [--n 4 --prompts 64 ...]``
(what a pipeline stage with ``kind = "rejection-sampling"`` runs before its SFT launch): loads the
verified checkpoint, samples ``n`` answers for each of ``prompts`` arithmetic questions (a seed of
their own, so not the SFT set), grades each with :func:`ptops.recipes.trl.rewards.verifier` and
keeps the best answer of each prompt whose score is at least ``min_score``, as SFT chat rows
(``{"messages": ...}``) in a JSONL file. Beside it, ``DATA.json`` holds the file's sha256 and the
statistics (kept rows, mean best and mean sampled score: the gap is what selection bought). An SFT
recipe trains on the file through ``train.data_file`` (:func:`rows`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ptops.recipes.assets import sha256_file as sha256  # noqa: F401 - the pipeline imports it from here

PROMPT_SEED = 11  # a question set of its own (the training sets use 1, 2, 3; the held-out eval 7)


def rows(recipe) -> list[dict] | None:
    """The chat rows of ``train.data_file`` (None when unset): the SFT data set of a
    rejection-sampling stage."""
    path = recipe.train.data_file
    if not path:
        return None
    out = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not out:
        raise ValueError(f"train.data_file: {path}: no rows (rejection sampling kept nothing?)")
    return out


def sample(
    ckpt: Path,
    out: Path,
    *,
    n: int,
    prompts: int,
    seed: int,
    min_score: float,
    max_new_tokens: int,
    temperature: float,
) -> dict:
    import torch

    from ptops.recipes import assets
    from ptops.recipes.trl.model import load_model, load_tokenizer
    from ptops.recipes.trl.rewards import verifier

    torch.manual_seed(seed)
    tok = load_tokenizer(ckpt)
    tok.padding_side = "left"
    model = load_model(ckpt).eval()
    data = assets.prompt_dataset(prompts, seed=PROMPT_SEED)
    texts = [
        tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in data
    ]
    kept, best_scores, all_scores = [], [], []
    with torch.no_grad():
        for i in range(0, len(texts), 16):
            batch = tok(
                texts[i : i + 16], return_tensors="pt", padding=True, add_special_tokens=False
            )
            gen = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                num_return_sequences=n,
                pad_token_id=tok.pad_token_id,
            )
            answers = tok.batch_decode(
                gen[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
            )
            for j, row in enumerate(data[i : i + 16]):
                cands = [a.strip() for a in answers[j * n : (j + 1) * n]]
                scores = verifier(cands, [row["answer"]] * n)
                all_scores += scores
                b = max(range(n), key=lambda k: scores[k])  # first best on ties: deterministic
                best_scores.append(scores[b])
                if scores[b] >= min_score and cands[b]:
                    kept.append(
                        {"messages": [row["prompt"][0], {"role": "assistant", "content": cands[b]}]}
                    )
    tmp = out.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, out)
    stats = {
        "source": str(ckpt),
        "n": n,
        "prompts": prompts,
        "seed": seed,
        "min_score": min_score,
        "kept": len(kept),
        "mean_best": sum(best_scores) / len(best_scores),
        "mean_sampled": sum(all_scores) / len(all_scores),
        "sha256": sha256(out),
        "data": str(out),
    }
    out.with_suffix(".json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ptops.recipes.trl.rejection", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--from", dest="src", required=True, help="checkpoint folder or run directory (verified)"
    )
    ap.add_argument("--out", required=True, type=Path, help="JSONL of the kept chat rows")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--min-score", type=float, default=0.0, help="keep a prompt's best only at or above this"
    )
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    a = ap.parse_args(argv)
    for key, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ):
        os.environ.setdefault(key, value)
    from ptops.recipes.init_from import InitFromError, resolve

    try:
        ckpt = resolve(a.src)
    except InitFromError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stats = sample(
        ckpt,
        a.out,
        n=a.n,
        prompts=a.prompts,
        seed=a.seed,
        min_score=a.min_score,
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
    )
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
