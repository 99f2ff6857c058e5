"""Held-out evaluation inside the TRL training loop (``[eval] interval = N``).

Every ``interval`` steps and at the final step, every rank greedily answers the same held-out
questions (none of them in the recipe's training sets) and grades them with the verifier of
:mod:`ptops.recipes.trl.rewards`; the results go onto that step's metrics record as
``eval/<name>`` (mean graded verifier score, 1.0 = exact) and ``eval/<name>_exact`` (exact
accuracy), where monitors (reward hacking), alerts, exporters and pipeline gates read them.

Every rank evaluates the whole set (a few dozen greedy tokens): no collective, the same value on
every rank, and a rank's timeline stays in step with its peers. The eval runs inside
``probe.pause("eval")`` (its own hang budget) and under a forked RNG with the model in eval mode,
so training - and an exact resume - is unchanged by it.
"""

from __future__ import annotations

from typing import Any, Callable


def heldout_rows(recipe) -> list[dict]:
    """``{"prompt", "answer"}`` rows of the held-out set: arithmetic questions absent from the chat,
    preference and prompt sets the recipe trains on (their seeds and size)."""
    from ptops.recipes import assets

    n = recipe.trl.dataset_size
    seen = {q for seed in (1, 2, 3) for q, _ in assets.arithmetic_pairs(n, seed)}
    rows: list[dict] = []
    for q, a in assets.arithmetic_pairs(4096, 7):
        if q in seen:
            continue
        seen.add(q)
        rows.append({"prompt": [{"role": "user", "content": q}], "answer": a})
        if len(rows) >= recipe.eval.size:
            break
    return rows


def make(recipe, tokenizer, probe) -> Callable[[Any, int], dict[str, float]]:
    """``evaluate(model, step) -> {"eval/<name>": ..., ...}`` ({} on steps without an eval)."""
    cfg = recipe.eval
    if not cfg.interval:
        return lambda model, step: {}
    rows = heldout_rows(recipe)
    final = recipe.train.steps

    def evaluate(model, step: int) -> dict[str, float]:
        if model is None or not (step % cfg.interval == 0 or step >= final):
            return {}
        import torch

        from ptops.recipes.trl.rewards import correct, verifier

        with probe.pause("eval", step), torch.random.fork_rng(devices=[]), torch.no_grad():
            net = getattr(model, "module", model)  # DDP wraps it
            was_training = net.training
            net.eval()
            try:
                texts = [
                    tokenizer.apply_chat_template(
                        r["prompt"], tokenize=False, add_generation_prompt=True
                    )
                    for r in rows
                ]
                side = tokenizer.padding_side
                tokenizer.padding_side = "left"
                batch = tokenizer(
                    texts, return_tensors="pt", padding=True, add_special_tokens=False
                )
                tokenizer.padding_side = side
                out = net.generate(
                    **batch,
                    max_new_tokens=cfg.max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                )
                answers = tokenizer.batch_decode(
                    out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
                )
            finally:
                net.train(was_training)
        want = [r["answer"] for r in rows]
        graded = verifier(answers, want)
        exact = correct(answers, want)
        return {
            f"eval/{cfg.name}": sum(graded) / len(graded),
            f"eval/{cfg.name}_exact": sum(exact) / len(exact),
        }

    return evaluate
