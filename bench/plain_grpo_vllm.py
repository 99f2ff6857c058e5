"""The peer of ``bench/vllm_seam.py``: TRL GRPO with vLLM colocate, no ptops supervising it.

What a user writes without ptops: ``GRPOTrainer`` with ``use_vllm=True, vllm_mode="colocate"`` on
the same tiny policy, prompts, rewards and settings as ``trl-grpo-tiny`` with the engine (read from
ptops' recipe and assets, so the work is the same). ``--as-shipped`` leaves TRL's weight sync as it
is (on vLLM's CPU build it fails at the first sync); otherwise the sync is the least a user must
add to make it work there (vLLM's ``reload_weights`` and the tied ``lm_head`` repacked), with no
check. Prints one JSON line on rank 0: the mean time of steps 3.. and the number of steps. Run
under torchrun:

    .venv-vllm/bin/torchrun --nproc-per-node 2 bench/plain_grpo_vllm.py --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--as-shipped", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import trl.generation.vllm_generation as vg
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ptops.recipes.schema import load
    from ptops.recipes.trl.model import load_model, load_tokenizer, model_dir
    from ptops.recipes.trl.rewards import reward_dataset, reward_setup

    recipe, _ = load("trl-grpo-tiny", ['trl.vllm.mode="colocate"'])
    sec = recipe.trl
    mdir = model_dir(sec.model, seed=sec.model.seed)
    base = vg.LLM
    vg.LLM = lambda *a, **kw: base(*a, **{"dtype": "float32", "enforce_eager": True, **kw})

    times: list[float] = []
    gen_acc = [0.0, 0]  # this step's seconds inside the engine's generate, completion tokens
    gens: list[tuple[float, int]] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t = time.monotonic()

        def on_step_end(self, *a, **kw):
            times.append(time.monotonic() - self.t)
            gens.append((gen_acc[0], gen_acc[1]))
            gen_acc[0], gen_acc[1] = 0.0, 0

    funcs, weights = reward_setup(sec.reward, sec.verifier, section=sec)
    out = f"/tmp/plain-grpo-vllm-{os.getpid()}"
    config = GRPOConfig(
        output_dir=out,
        max_steps=args.steps,
        seed=recipe.train.seed,
        learning_rate=sec.lr,
        per_device_train_batch_size=sec.per_device_batch_size,
        gradient_accumulation_steps=sec.grad_accum,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        gradient_checkpointing=False,
        # as ptops' TRL adapter sets them (recipes/trl/run.py _common_args): the same work
        max_grad_norm=sec.max_grad_norm,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        logging_nan_inf_filter=False,
        num_generations=sec.num_generations,
        max_completion_length=sec.max_completion_length,
        beta=sec.beta,
        temperature=sec.temperature,
        reward_weights=weights,
        use_vllm=True,
        vllm_mode="colocate",
        log_completions=False,
    )
    trainer = GRPOTrainer(
        model=load_model(mdir),
        reward_funcs=funcs,
        args=config,
        train_dataset=Dataset.from_list(reward_dataset(sec)),
        processing_class=load_tokenizer(mdir),
        callbacks=[Timer()],
    )
    if not args.as_shipped:
        gen = trainer.vllm_generation

        def sync() -> None:  # the least that works on the CPU build: no check
            runner = gen.llm.llm_engine.model_executor.driver_worker.model_runner
            runner.reload_weights(weights_iterator=iter(list(gen._iter_named_params())))
            head = runner.get_model().lm_head
            head.quant_method.process_weights_after_loading(head)
            gen.llm.reset_prefix_cache()

        gen.sync_weights = sync
    engine_generate = trainer.vllm_generation.llm.generate

    def timed(*a, **kw):  # the rollouts' throughput, measured as ptops' seam measures it
        t0 = time.monotonic()
        out = engine_generate(*a, **kw)
        gen_acc[0] += time.monotonic() - t0
        gen_acc[1] += sum(len(o.token_ids) for r in out for o in r.outputs)
        return out

    trainer.vllm_generation.llm.generate = timed
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        tail = times[2:] or times
        g = gens[2:] or gens
        gen_s, tokens = sum(x for x, _ in g), sum(n for _, n in g)
        print(
            json.dumps(
                {
                    "steps": len(times),
                    "step_s": sum(tail) / len(tail),
                    "tokens_per_s": tokens / gen_s if gen_s else None,
                    "generate_s": gen_s / len(g),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
