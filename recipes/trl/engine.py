"""The rank side of the engine seam (``[trl.vllm]``): what TRL's vLLM integration leaves unchecked.

- **Weights reach the engine on CPU.** vLLM's CPU build packs each linear layer's weight after
  loading and drops the original, so TRL's per-parameter ``load_weights`` fails ("'Parameter' object
  has no attribute 'weight_loader'"). ``reload_weights`` repacks, except a tied ``lm_head``: it
  keeps its pack of the old embedding and the engine silently serves stale logits (measured: a
  log-probability gap of 37 nats after a sync of the embedding alone). Both are handled here
  (colocate: in the rank's engine; server: by the engine's worker extension, ``engine_worker``).
- **Every sync verified.** The engine's log-probabilities of a fixed probe sequence against the
  trainer's, after each sync. A sync that did not take is done again once; if the engine still
  serves other weights the rank raises :class:`EngineStaleWeights` (the supervisor stops: rewards of
  a stale policy mean nothing, and a restart would load them the same way).
- **Rollouts carry their model version** (the trainer step of the sync they were generated after):
  ``engine/version`` and ``staleness`` (the ``stale_rollout`` monitor's key) on each step's
  record, with the sync's and the check's cost (``engine/sync_s``, ``engine/verify_s``) and the
  probe's gap (``engine/lp_gap``: the precision gap between engine and trainer, e.g. a bf16 engine
  beside an fp32 trainer), and the rollouts' throughput (``engine/generate_s``, ``engine/tokens``,
  ``engine/tokens_per_s``: time inside the engine's generate, completion tokens it made).
- **Sampling seeded per request** from (seed, rank, step, call, index): a restarted run draws the
  rollouts an uninterrupted one draws (vLLM's own generator restarts with the process).

- **The seams named.** The rank's phase is ``engine_sync`` or ``engine_generate`` (``reward``: the
  grader seam, ``grader.py``) while it is in one (after the attempt's first step, whose warm-up
  its own section judges): a hang there is reported with the seam's name (its budget is the
  step's). Waiting for a restarted
  engine is a declared pause (``engine_wait``, ``[supervisor.hang] engine_wait_s``).

A component: :meth:`EngineSeam.prepare` before TRL builds its engine, :meth:`EngineSeam.attach` to
the trainer, :meth:`EngineSeam.metrics` for each step's record.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PROBE_TOKENS = 24  # the probe sequence: token ids 1..24 of the policy's vocabulary
TOLERANCE = {True: 1e-3, False: 0.1}  # max probe gap: same dtype / engine and trainer differ


class EngineStaleWeights(RuntimeError):
    """The engine kept serving other weights than the trainer's after a sync and a re-sync."""


def engine_dtype(v: Any) -> str:
    """``[trl.vllm] dtype``: ``trainer`` is float32, the trainer's precision on CPU (the CPU build
    is where ptops chooses the engine's precision; on a GPU TRL's own settings stand)."""
    if v.dtype != "trainer":
        return v.dtype
    return "float32"


def engine_env(cache: Path) -> dict[str, str]:
    """What vLLM's CPU build needs in any process that holds an engine (unless already set)."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GB of KV cache: the default (4) is most of a small node
        "VLLM_CACHE_ROOT": str(cache),  # not ~/.cache/vllm
    }


def _repack_tied_head(model: Any) -> None:
    """vLLM CPU: a tied ``lm_head`` keeps its packed copy of the old embedding after a reload."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is not None and method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def for_recipe(recipe: Any, probe: Any, run_dir: Path) -> EngineSeam | None:
    """The seam of a GRPO / RLOO recipe whose ``[trl.vllm]`` engine can run here (prepared), or
    None (no engine: TRL's generate path, ``vllm.config_kwargs`` says so)."""
    from ptops.recipes.trl.vllm import unavailable

    sec = recipe.trl
    if sec is None or sec.vllm is None or sec.trainer not in ("grpo", "rloo"):
        return None
    if unavailable(in_rank=True) is not None:
        return None
    seam = EngineSeam(sec, probe, recipe.train.seed, run_dir)
    seam.prepare()
    return seam


class EngineSeam:
    def __init__(self, sec: Any, probe: Any, seed: int, run_dir: Path) -> None:
        self.v = sec.vllm
        self.probe = probe
        self.seed = int(seed)
        self.run_dir = Path(run_dir)
        self.trainer: Any = None
        self.version: int | None = None  # the trainer step of the last verified sync
        self.prev_lp: Any = None  # the trainer's probe log-probabilities at that sync
        self.floor = 0.0  # the probe gap of the last good sync (the precision gap)
        self.calls: tuple[int, int] = (-1, 0)  # (step, generate calls in it)
        self.last: dict[str, float | None] = {}
        self.resyncs = 0
        self.stepped = False  # this process recorded a step (its first step's warm-up is over)
        self.gen_s, self.gen_tokens = 0.0, 0  # this step's time in generate, tokens it made

    # ------------------------------------------------------------ before TRL builds its engine
    def prepare(self) -> None:
        from ptops.ops.runrecord.cache import cache_root
        from ptops.recipes.trl.vllm import cpu_build

        for key, value in engine_env(cache_root() / "vllm").items():
            os.environ.setdefault(key, value)
        if not cpu_build():
            return
        if self.v.mode == "colocate":
            import trl.generation.vllm_generation as vg

            base = vg.LLM
            dtype = engine_dtype(self.v)

            def llm(*args: Any, **kwargs: Any) -> Any:
                # TRL passes no dtype (the engine would run bf16 beside an fp32 trainer) and the
                # CPU build's graph capture costs more than a tiny model's generation
                kwargs.setdefault("dtype", dtype)
                kwargs.setdefault("enforce_eager", True)
                return base(*args, **kwargs)

            vg.LLM = llm
        else:
            from trl.generation.vllm_client import VLLMClient

            # the NCCL communicator needs CUDA; on CPU the weights travel as files (sync below)
            VLLMClient.init_communicator = lambda self, device=0: None
            VLLMClient.close_communicator = lambda self: None

    # ------------------------------------------------------------ the trainer's engine
    def attach(self, trainer: Any) -> None:
        from ptops.recipes.trl.vllm import cpu_build

        self.trainer = trainer
        gen = trainer.vllm_generation
        self.gen = gen
        self._trl_sync = gen.sync_weights
        self.cpu = cpu_build()
        gen.sync_weights = self.sync  # the reward call's phase is the grader seam's (grader.py)
        if gen.mode == "colocate":
            gen.llm.generate = self._seeded_colocate(gen.llm.generate)
        elif getattr(gen, "vllm_client", None) is not None:
            gen.vllm_client.generate = self._seeded_server(gen.vllm_client.generate)

    def _step(self) -> int:
        return int(self.trainer.state.global_step) if self.trainer is not None else 0

    def _next_seed(self) -> int:
        """A request seed from (seed, rank, step, call in the step): the same in a restarted run."""
        step = self._step()
        at, n = self.calls
        n = n + 1 if at == step else 0
        self.calls = (step, n)
        rank = int(os.environ.get("RANK", "0"))
        return (self.seed * 1_000_003 + rank * 7_919 + step * 131 + n) % (2**31 - 1) * 4096

    def _seeded_colocate(self, generate: Any) -> Any:
        def seeded(prompts: Any, sampling_params: Any = None, **kw: Any) -> Any:
            if sampling_params is not None and not isinstance(sampling_params, list):
                if getattr(sampling_params, "seed", None) is None:
                    base = self._next_seed()
                    many = []
                    for i in range(len(prompts)):
                        one = sampling_params.clone()
                        one.seed = base + i
                        many.append(one)
                    sampling_params = many
            with self._seam("engine_generate"):
                if self.probe is not None:
                    for f in self.probe.faults.engine_hang(self._step() + 1):
                        self.probe.faults.stall(f, self._step() + 1)  # the engine never returns
                t0 = time.monotonic()
                out = generate(prompts, sampling_params=sampling_params, **kw)
                tokens = sum(len(o.token_ids) for r in out for o in getattr(r, "outputs", ()))
                self._generated(time.monotonic() - t0, tokens)
                return out

        return seeded

    def _seeded_server(self, generate: Any) -> Any:
        """Seeded, and generated by the synced version: an engine that restarted after the sync (or
        during the call: TRL's client retries into the new one) holds its initial weights, so the
        seam syncs it again and generates again (the same seed: the same rollouts)."""

        def seeded(*args: Any, **kw: Any) -> Any:
            extra = dict(kw.get("generation_kwargs") or {})
            extra.setdefault("seed", self._next_seed())  # n children: seed + i (vLLM)
            kw["generation_kwargs"] = extra
            step = self._step()
            if self.probe is not None and self.probe.faults.engine_crash(step + 1):
                with self._seam("engine_wait"):
                    self._crash_engine()
            if self.probe is not None and self.probe.faults.engine_hang(step + 1):
                with self._seam("engine_wait"):
                    self._freeze_engine()
            for _ in range(3):
                self._ensure_version(step)
                with self._seam("engine_generate"):
                    t0 = time.monotonic()
                    out = generate(*args, **kw)
                    ids = out.get("completion_ids", []) if isinstance(out, dict) else []
                    self._generated(time.monotonic() - t0, sum(len(c) for c in ids))
                if self.version is None or self._engine_version() == self.version:
                    return out
            raise EngineStaleWeights(
                f"the engine kept restarting while it generated step {step + 1}'s rollouts"
            )

        return seeded

    # ------------------------------------------------------------ server mode: the engine's life
    def _rpc(self, method: str, *args: str, timeout: float = 30.0) -> Any:
        """One call, no retry: TRL's session retries a POST whose answer was lost, for up to a
        minute, which delivered ``ptops_exit`` to the restarted engine too."""
        import requests

        client = self.gen.vllm_client
        r = requests.post(
            f"{client.base_url}/collective_rpc",
            json={"method": method, "args": list(args)},
            timeout=timeout,
        )
        r.raise_for_status()
        return (r.json() or {}).get("results", [None])

    def _engine_version(self) -> int:
        return int(self._rpc("ptops_version")[0])

    def _ensure_version(self, step: int) -> None:
        """The engine holds the last synced version, or it is waited for and synced again."""
        if self.version is None:
            return
        self._wait_engine()
        held = self._engine_version()
        if held == self.version:
            return
        self.resyncs += 1
        self._event(
            "engine_resync",
            step=step,
            why=f"the engine restarted: it holds version {held}, the rollouts need {self.version}",
        )
        self.sync()

    def _healthy(self, timeout: float = 5.0) -> bool:
        """The engine's server answers ``/health`` with 200 (one that answers for a dead engine, or
        none at all, is not healthy)."""
        import requests

        try:
            url = f"{self.gen.vllm_client.base_url}/health"
            return requests.get(url, timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def _wait_engine(self) -> None:
        """Until the engine answers (the run's sidecar supervision restarts a dead one): a declared
        pause (``engine_wait``) while it does not, so that the peers waiting on this rank are not a
        hang."""
        if self._healthy(timeout=2.0):  # short: a wedged engine's wait is the declared pause below
            return
        deadline = time.monotonic() + self.v.health_timeout_s
        with self._seam("engine_wait"):
            while not self._healthy():
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"the vLLM engine at {self.gen.vllm_client.base_url} did not come back "
                        f"within {self.v.health_timeout_s:g} s ([trl.vllm] health_timeout_s)"
                    )
                time.sleep(0.5)

    def _crash_engine(self) -> None:
        """The ``engine-crash`` fault: the engine's process exits; wait until it is seen gone."""
        import requests

        try:
            self._rpc("ptops_exit", timeout=10)
        except requests.RequestException:
            pass  # the engine died answering
        deadline = time.monotonic() + 60
        while self._healthy(timeout=2) and time.monotonic() < deadline:
            time.sleep(0.2)

    def _freeze_engine(self) -> None:
        """The ``engine-hang`` fault: the engine's processes stop (alive, answering nothing) until
        the sidecar's health checks find it and replace it (the wait that follows is
        ``_wait_engine``'s)."""
        import requests

        with contextlib.suppress(requests.RequestException):
            self._rpc("ptops_freeze", timeout=3)  # never answered: the engine stops first

    # ------------------------------------------------------------ sync and its check
    @contextlib.contextmanager
    def _seam(self, phase: str) -> Iterator[None]:
        """A beat naming the seam the rank is in (``engine_sync``, ``engine_generate``,
        ``reward``): a hang inside one is reported with that phase."""
        step = self._step() + 1
        if self.probe is None or not self.stepped:  # the attempt's first step: its own section
            yield
            return
        self.probe.phase(phase, step)
        try:
            yield
        finally:
            self.probe.phase("step", step)

    def sync(self) -> None:
        with self._seam("engine_sync"):
            self._sync()

    def _sync(self) -> None:
        step = self._step()
        skip = self.probe.faults.skip_sync(step + 1) if self.probe is not None else False
        if self.probe is not None:
            self.probe.faults.in_sync(step + 1)
        t0 = time.monotonic()
        self._apply(skip)
        sync_s = time.monotonic() - t0
        t1 = time.monotonic()
        ok, gap, lp = self._check()
        if not ok:
            self.resyncs += 1
            self._event(
                "engine_resync", step=step, gap=gap, why="the engine's probe log-probabilities"
            )
            self._apply(self.probe.faults.skip_sync(step + 1) if self.probe is not None else False)
            ok, gap, lp = self._check()
            if not ok:
                self._event("engine_stale", step=step, gap=gap, version=self.version)
                raise EngineStaleWeights(
                    f"the engine serves other weights than the trainer's after a sync and a "
                    f"re-sync at step {step} (probe log-probability gap {gap:.3g}, tolerance "
                    f"{self._tolerance():g}; last good sync: step {self.version})"
                )
        verify_s = time.monotonic() - t1
        if lp is not None:
            self.prev_lp, self.floor = lp, gap
        self.version = step
        self.last = {
            "engine/version": float(step),
            "engine/sync_s": sync_s,
            "engine/verify_s": verify_s,
            "engine/lp_gap": gap,
            "engine/resyncs": float(self.resyncs),
        }

    def _generated(self, seconds: float, tokens: int) -> None:
        """The step's rollouts: time inside the engine's generate and completion tokens it made."""
        self.gen_s += seconds
        self.gen_tokens += tokens

    def metrics(self) -> dict[str, float | None]:
        """This step's keys (called once per step record)."""
        self.stepped = True
        out = dict(self.last)
        if self.gen_s > 0:
            out["engine/generate_s"] = self.gen_s
            out["engine/tokens"] = float(self.gen_tokens)
            out["engine/tokens_per_s"] = self.gen_tokens / self.gen_s
        self.gen_s, self.gen_tokens = 0.0, 0
        if self.version is not None:
            # the key the stale_rollout monitor reads (bounded by [monitors.stale_rollout] max_lag)
            out["staleness"] = float(max(0, self._step() - 1 - self.version))
        self.last = {}
        return out

    def _apply(self, skip: bool) -> None:
        if skip:
            return  # the injected fault: a sync that returns and changes nothing
        if not self.cpu:
            self._trl_sync()
            return
        gen = self.gen
        if gen.mode == "colocate":
            weights = [(name, param.detach()) for name, param in gen._iter_named_params()]
            runner = gen.llm.llm_engine.model_executor.driver_worker.model_runner
            runner.reload_weights(weights_iterator=iter(weights))
            _repack_tied_head(runner.get_model())
            gen.llm.reset_prefix_cache()
            return
        self._server_sync()

    def _server_sync(self) -> None:
        """Server mode on CPU: the main process writes the weights as safetensors under the run
        directory; the engine reloads them (``engine_worker.PtopsWorker.ptops_reload``)."""
        gen = self.gen
        named = list(gen._iter_named_params())  # every rank iterates: gathers are collectives
        if not gen.accelerator.is_main_process:
            return
        from safetensors.torch import save_file

        out = self.run_dir / "engine" / "weights"
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "model.safetensors.tmp"
        save_file({n: p.detach().contiguous().cpu() for n, p in named}, str(tmp))
        os.replace(tmp, out / "model.safetensors")
        self._rpc("ptops_reload", str(out), str(self._step()), timeout=600)
        gen.vllm_client.reset_prefix_cache()

    def _tolerance(self) -> float:
        same = engine_dtype(self.v) == "float32"
        return TOLERANCE[same]

    def _check(self) -> tuple[bool, float, Any]:
        """(the engine serves the trainer's weights, the probe's gap, the trainer's probe)."""
        if not self.v.verify:
            return True, 0.0, None
        gen = self.gen
        if gen.mode == "server" and not gen.accelerator.is_main_process:
            return True, 0.0, None
        import torch

        probe_ids = list(range(1, PROBE_TOKENS + 1))
        # the check draws nothing from the run's generators (a second check, after a re-sync, must
        # leave the rollouts an uninterrupted run draws)
        with torch.random.fork_rng(devices=[]):
            ours = self._trainer_logprobs(probe_ids)
            theirs = torch.tensor(self._engine_logprobs(probe_ids), dtype=torch.float64)
        gap = float((ours - theirs).abs().max())
        ok = gap <= self._tolerance()
        if ok and self.prev_lp is not None:
            # a sync that did not take leaves the engine at the previous version: nearer to it than
            # to this one, once the step moved the probe past the precision gap
            moved = float((ours - self.prev_lp).abs().max())
            if moved > 4 * max(self.floor, 1e-7) and gap > 0.5 * moved:
                ok = False
        return ok, gap, ours

    def _trainer_logprobs(self, ids: list[int]) -> Any:
        import torch

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        x = torch.tensor([ids], device=next(model.parameters()).device)
        with torch.no_grad():
            logits = model(input_ids=x).logits[0, :-1].double()
        return torch.log_softmax(logits, -1).gather(1, x[0, 1:, None].cpu())[:, 0].cpu()

    def _engine_logprobs(self, ids: list[int]) -> list[float]:
        gen = self.gen
        if gen.mode == "colocate":
            from vllm import SamplingParams

            # seeded: the probe draws from its own generator, not the rollouts' (max_tokens=1)
            params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0)
            res = self._raw_generate([{"prompt_token_ids": ids}], params)
            pl = res[0].prompt_logprobs
            return [pl[i][ids[i]].logprob for i in range(1, len(ids))]
        got = gen.vllm_client.get_sequence_logprobs([ids], [1], top_logprobs=0, temperature=1.0)
        return [row[0] for row in got["actual_logprobs"][0]]

    def _raw_generate(self, prompts: Any, params: Any) -> Any:
        """The engine's generate without the seeding wrapper (the probe is no rollout)."""
        from vllm import LLM

        return LLM.generate(self.gen.llm, prompts, sampling_params=params, use_tqdm=False)

    def _event(self, kind: str, **fields: Any) -> None:
        if self.probe is not None:
            self.probe.event(kind, mode=self.v.mode, **fields)
