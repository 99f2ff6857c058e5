"""The recipe's ``[monitors]`` section: every threshold, with its default and why.

A recipe may say, for example::

    [monitors.loss_spike]
    z_threshold = 8.0
    action = "rollback"

    [monitors.rollback]
    skip_batches = 4
    lr_scale = 0.5

    [monitors.reward_hacking]
    verifier_key = "rewards/correct/mean"

Policy vocabulary (what the supervisor does with a finding of that monitor):

- ``alert`` record the finding (events.jsonl ``anomaly``/``straggler``), export it, keep training;
- ``stop``         stop the run cleanly (``failed`` with the finding as the reason);
- ``rollback``     restart from the newest good checkpoint before the finding's step, skip
                   ``rollback.skip_batches`` batches, scale the LR by ``rollback.lr_scale``;
                   after ``rollback.max_rollbacks`` rollbacks in one run, ``stop`` instead;
- ``exclude_node`` (straggler only) restart without the straggler rank's node.

Every field can be written in TOML: "off" is 0 for a number and "" for a key.
Metric keys are written the TRL way (``completions/mean_length``); the monitors
also match the adapter's sanitised spelling (``completions_mean_length``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Action = Literal["alert", "stop", "rollback"]
StragglerAction = Literal["alert", "stop", "rollback", "exclude_node"]
ACTIONS = ("alert", "stop", "rollback", "exclude_node")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RollbackPolicy(_Strict):
    """How a ``rollback`` action rolls back."""

    skip_batches: int = Field(
        1,
        ge=0,
        description="data batches to skip after restoring, ending at the step that triggered the "
        "rollback "
        "(0 = replay the same data; the PaLM recipe skips a few hundred around a spike)",
    )
    lr_scale: float = Field(
        1.0, gt=0, le=1.0, description="multiply the learning rate by this after a rollback"
    )
    max_rollbacks: int = Field(
        3, ge=0, description="rollbacks allowed in one run; the next one becomes `stop`"
    )


class StragglerConfig(_Strict):
    """Per-rank time against the median of the other ranks at the same step (see straggler.py)."""

    enabled: bool = True
    action: StragglerAction = "alert"
    busy_keys: list[str] = Field(
        ["compute_s"],
        description="per-rank busy time that excludes waiting in collectives (best signal)",
    )
    wait_keys: list[str] = Field(
        ["wait_s"],
        description="per-rank time spent waiting in collectives; busy = step_s - wait_s when no "
        "busy key",
    )
    data_keys: list[str] = Field(
        ["data_s", "data_loading_s", "time_metrics_data_loading_s", "data_load_s", "dataloader_s"],
        description="per-rank data-loading time, scored on its own",
    )
    step_key: str = Field("step_s", description="per-rank step time (fallback signal)")
    step_s_mode: Literal["wait_inferred", "busy", "off"] = Field(
        "wait_inferred",
        description="how to read step_s when no busy/wait key exists: `wait_inferred` = in "
        "synchronous data "
        "parallel the ranks leave the step's collectives together, so a rank whose measured step "
        "is persistently "
        "*shorter* than the others' is the one they waited for (its slowness lies outside its "
        "measured step); "
        "`busy` = step_s is busy time (ranks not synchronised per step); `off` = ignore step_s",
    )
    margin: float = Field(
        0.2,
        gt=0,
        description="a rank is slow when its time is >= (1 + margin) x the others' median",
    )
    window: int = Field(
        5, ge=1, description="steps over which the median per-step ratio must stay past the margin"
    )
    min_excess_s: float = Field(
        0.05,
        ge=0,
        description="and the median absolute excess must be at least this many seconds (noise "
        "floor)",
    )
    lag_steps: int = Field(
        2,
        ge=1,
        description="score a step once every known rank reported it, or once any rank is this "
        "many steps past it",
    )


class NanConfig(_Strict):
    """Non-finite loss / grad norm (see numeric.py)."""

    enabled: bool = True
    action: Action = "rollback"
    keys: list[str] = Field(["loss", "grad_norm"], description="keys checked for NaN/Inf")
    none_after_numeric: bool = Field(
        True,
        description="treat None as NaN for a key that held numbers earlier on that rank (TRL "
        "logs None when all values were NaN)",
    )


class LossSpikeConfig(_Strict):
    """Robust z-score of the loss against its recent level and noise (see numeric.py)."""

    enabled: bool = True
    action: Action = "alert"
    key: str = Field("loss", description="the loss key")
    window: int = Field(
        50, ge=5, description="trailing finite values the noise level is estimated from"
    )
    level_window: int = Field(
        5, ge=1, description="the current level is the median of this many last values"
    )
    warmup_steps: int = Field(
        10, ge=0, description="steps <= this are never judged (the loss falls fast early on)"
    )
    min_history: int = Field(10, ge=3, description="reference values needed before judging")
    z_threshold: float = Field(
        6.0,
        gt=0,
        description="(x - level) / (1.4826 * noise) at or above this is a spike (noise: median "
        "|step-to-step change| / sqrt 2)",
    )
    min_rel_jump: float = Field(
        0.1,
        ge=0,
        description="and x must exceed the level by this fraction of |level| (guards flat, "
        "noiseless curves)",
    )
    skip_rl: bool = Field(
        True,
        description="stand down on records with a `reward` key: a GRPO/PPO loss is ~0 and "
        "sign-changing, not a descent objective",
    )


class LossPlateauConfig(_Strict):
    """The loss stopped improving (see plateau.py). Off by default: a run that converges, or a
    fine-tune past its best, plateaus by design; turn it on for pre-training, where a flat loss
    is money spent for nothing."""

    enabled: bool = False
    action: Action = "alert"
    key: str = Field("loss", description="the loss key")
    patience: int = Field(
        200, ge=1, description="steps without an improvement of the smoothed loss: a plateau"
    )
    min_delta: float = Field(
        0.01,
        ge=0,
        lt=1,
        description="an improvement: the smoothed loss below its best by more than this "
        "fraction of |best|",
    )
    ema_span: int = Field(
        20,
        ge=1,
        description="the loss is smoothed by an EMA of this span (alpha = 2 / (span + 1)): "
        "one lucky low step does not set a best the curve never reaches again",
    )


class GradExplosionConfig(_Strict):
    """Grad norm against a trailing reference and an absolute cap (see numeric.py)."""

    enabled: bool = True
    action: Action = "alert"
    key: str = Field(
        "grad_norm", description="the grad-norm key (the adapters log the norm before clipping)"
    )
    window: int = Field(50, ge=5, description="trailing finite values that form the reference")
    warmup_steps: int = Field(
        10, ge=0, description="steps <= this are not judged by the ratio rule"
    )
    min_history: int = Field(
        10, ge=3, description="reference values needed before the ratio rule applies"
    )
    reference_quantile: float = Field(
        0.75,
        gt=0,
        le=1,
        description="reference = this quantile of the trailing window (0.5 = median); above the "
        "median so that "
        "near-zero-gradient steps (GRPO groups with zero reward variance) do not drag it down",
    )
    ratio: float = Field(10.0, gt=1, description="grad norm >= ratio x reference is an explosion")
    abs_max: float | None = Field(
        1e4, ge=0, description="grad norm >= this is an explosion at any step (0 = off)"
    )


class EntropyCollapseConfig(_Strict):
    """Policy entropy against its early level, with a forecast of where its trend goes (see
    rl.py)."""

    enabled: bool = True
    action: Action = "alert"
    key: str = Field("entropy", description="mean token entropy of the policy")
    reward_key: str = Field(
        "reward", description="training reward, for the R = -a*e^H + b fit reported with a forecast"
    )
    warmup_steps: int = Field(0, ge=0, description="steps <= this are not part of the early level")
    baseline_steps: int = Field(
        10, ge=1, description="the early level is the median of this many first values"
    )
    smooth: int = Field(
        5, ge=1, description="the current level is the median of this many last values"
    )
    collapse_frac: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="current < collapse_frac x early level is a collapse (critical)",
    )
    window: int = Field(
        20, ge=3, description="values the forecast (a line through log entropy) is fitted on"
    )
    short_window: int = Field(
        5,
        ge=3,
        description="momentum: the values already under project_gate_frac x early level (less "
        "the first two, "
        "the drop itself; up to `window`) must be at least this many ...",
    )
    momentum_t: float = Field(
        2.5,
        gt=0,
        description="... and still fall, significantly (slope <= -momentum_t standard errors) "
        "and fast enough "
        "to reach the threshold within the horizon: a dip that dropped and stopped has a flat "
        "bottom there",
    )
    horizon: int = Field(50, ge=1, description="steps ahead the forecast looks")
    floor_frac: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="forecast reaching floor_frac x early level within horizon warns",
    )
    project_gate_frac: float = Field(
        0.8,
        gt=0,
        le=1,
        description="the forecast rule needs the current level already below this x early level",
    )
    confirm_steps: int = Field(
        2, ge=1, description="consecutive steps the forecast must hold before it warns"
    )
    recover_frac: float = Field(
        0.5,
        gt=0,
        le=1,
        description="all-clear: the level is back above this x early level and nothing is "
        "forecast ...",
    )
    clear_steps: int = Field(
        10, ge=1, description="... for this many consecutive steps (the episode then ends)"
    )


class KLDriftConfig(_Strict):
    """KL to the reference policy: over budget, or growing steadily (see rl.py)."""

    enabled: bool = True
    action: Action = "alert"
    key: str = Field("kl", description="KL to the reference policy (TRL logs it when beta > 0)")
    budget: float | None = Field(
        1.0,
        ge=0,
        description="kl (median of the last `smooth`) above this is over budget (0 = off)",
    )
    smooth: int = Field(3, ge=1, description="values the budget rule takes the median of")
    warmup_steps: int = Field(
        20,
        ge=0,
        description="steps <= this are not judged by the trend rule (KL rises from 0 early on)",
    )
    window: int = Field(20, ge=3, description="values the trend is fitted on")
    min_up_frac: float = Field(
        0.65, ge=0, le=1, description="fraction of step-to-step increases in the window"
    )
    min_growth: float = Field(
        1.0, ge=0, description="fitted end / fitted start - 1 over the window (1.0 = doubled)"
    )
    min_kl: float = Field(
        0.05, ge=0, description="the trend rule ignores KL below this (noise near zero)"
    )
    clear_steps: int = Field(
        10,
        ge=1,
        description="all-clear after this many consecutive steps under budget and not trending",
    )


class RewardHackingConfig(_Strict):
    """Training reward rising while a held-out score does not, or with length / clipping (see
    rl.py)."""

    enabled: bool = True
    action: Action = "alert"
    reward_key: str = Field(
        "reward", description="the training reward (TRL: weighted sum of the reward functions)"
    )
    verifier_key: str | None = Field(
        "rewards/verifier/mean",
        description='held-out / verifier reward key; "" (or a key the run never logs) = that '
        "rule is off",
    )
    heldout_keys: list[str] = Field(
        ["eval/accuracy", "eval/reward", "eval/score"],
        description="other held-out score keys, read when `verifier_key` is absent from a record "
        "(eval records logged "
        "every N steps, on their own or with the step's training keys)",
    )
    heldout_prefix: str = Field(
        "eval/",
        description="keys with this prefix are held-out eval scores (``[eval]`` writes "
        "eval/<name>, main "
        "score first); once a rank's records carry one, it replaces `verifier_key` (an "
        "in-training proxy) for the "
        'held-out rules; "" = off',
    )
    coupled_keys: list[str] = Field(
        ["completions/mean_length", "clip_ratio/region_mean"],
        description="keys whose steady rise together with the reward is suspicious",
    )
    warmup_steps: int = Field(10, ge=0, description="steps <= this are not judged")
    window: int = Field(
        20,
        ge=4,
        description="steps the trends are computed over (a sparse held-out score: at least "
        "`min_points` of its values, however many steps they span)",
    )
    min_points: int = Field(
        3, ge=3, description="held-out values needed before the held-out rules judge"
    )
    trend_corr: float = Field(
        0.6,
        gt=0,
        le=1,
        description="|Pearson r| of a value against the step that counts as a trend",
    )
    flat_corr: float = Field(
        0.0,
        ge=-1,
        le=1,
        description="held-out r against the step at or below this while the reward rises is "
        "divergence (warning; judged on at least 2 x min_points values); at or below -trend_corr "
        "it is hacking (critical)",
    )
    diverge_corr: float = Field(
        0.85,
        gt=0,
        le=1,
        description="divergence (held-out flat) needs the reward's r against the step at least "
        "this "
        "(a stronger rise than `trend_corr`: a flat held-out score is weaker evidence than a "
        "falling one)",
    )
    rise_t: float = Field(
        2.0,
        gt=0,
        description="hacking (critical): the reward climbs now (its slope over the last "
        "`window` steps this many standard errors up) and across the held-out span (r >= "
        "trend_corr) ...",
    )
    fall_z: float = Field(
        2.25,
        gt=0,
        description="... and the held-out slope this many down (its noise from its second "
        "differences; the bar raised to Student's t for the degrees of freedom they are worth, "
        "about half their number), over the span, or over twice the span with at least "
        "2 x min_points values",
    )
    noise_values: int = Field(
        2,
        ge=1,
        description="second differences of the held-out score needed for its noise "
        "estimate before the fall rule judges",
    )
    bend_z: float = Field(
        2.25,
        ge=0,
        description="hacking (critical), the turn rule: after the step where the training reward "
        "starts climbing faster (its bend, found on every reward value of the last 200 steps), "
        "the held-out slope on a line bent there (its last 48 values, continuous at the bend) "
        "this many standard errors down, raised to the t quantile for the noise estimate's honest "
        "degrees of freedom; dense or sparse held-out scores; no confirmation needed; 0 = off",
    )
    bend_t: float = Field(
        3.0,
        gt=0,
        description="... where the reward's slope rises at the bend by at least this many "
        "standard errors",
    )
    coupling_corr: float = Field(
        0.8, gt=0, le=1, description="Pearson r of reward and a coupled key that counts as coupled"
    )
    min_growth: float = Field(
        0.25, ge=0, description="relative rise of a coupled key over the window (fitted)"
    )
    confirm: int = Field(
        2,
        ge=1,
        description="consecutive evaluations a rule must hold before it is reported "
        "(divergence, the weaker evidence: one more) ...",
    )
    confirm_steps: int = Field(
        10,
        ge=0,
        description="... but no more than this many steps of waiting: a held-out "
        "score every 10 steps needs two values in a row, every 25 steps one",
    )
    clear_steps: int = Field(
        20, ge=1, description="all-clear after this many consecutive steps with no rule holding"
    )


class ModeCollapseConfig(_Strict):
    """Groups with zero reward variance, or falling diversity (see rl.py)."""

    enabled: bool = True
    action: Action = "alert"
    key: str = Field(
        "frac_reward_zero_std", description="fraction of groups whose rewards all agree"
    )
    threshold: float = Field(
        0.9, gt=0, le=1, description="every value in the window at or above this is a collapse"
    )
    window: int = Field(10, ge=1, description="consecutive values")
    warmup_steps: int = Field(0, ge=0, description="steps <= this are not judged")
    distinct_key: str | None = Field(
        None,
        description="a diversity key (e.g. distinct completions fraction), if the engine logs "
        'one ("" = off)',
    )
    distinct_frac: float = Field(
        0.3, gt=0, lt=1, description="diversity below this x its early level is a collapse"
    )
    baseline_steps: int = Field(
        10, ge=1, description="early level of the diversity key: median of the first values"
    )
    clear_steps: int = Field(
        10, ge=1, description="all-clear after this many consecutive steps with no rule holding"
    )


class StaleRolloutConfig(_Strict):
    """Policy-version lag of the rollouts a step trained on (see rl.py)."""

    enabled: bool = True
    action: Action = "alert"
    keys: list[str] = Field(
        ["policy_lag", "policy_version_lag", "staleness"],
        description="the first present key is read",
    )
    max_lag: float = Field(4, ge=0, description="lag above this is stale")
    clear_steps: int = Field(
        10, ge=1, description="all-clear after this many consecutive steps at or under max_lag"
    )


class TrainInferenceGapConfig(_Strict):
    """Log-probability gap between the engine that sampled the rollouts and the trainer (see
    rl/mismatch.py)."""

    enabled: bool = True
    action: Action = "alert"
    keys: list[str] = Field(
        ["sampling/sampling_logp_difference/mean", "engine/lp_gap"],
        description="the first present key is read (TRL's gap on the rollouts, else ptops' probe)",
    )
    max_gap: float = Field(
        0.05, ge=0, description="mean per-token gap (nats) above this is a mismatch"
    )
    clear_steps: int = Field(
        10, ge=1, description="all-clear after this many consecutive steps at or under max_gap"
    )


class MemoryConfig(_Strict):
    """A rank's memory trend against its limit (see memory.py)."""

    enabled: bool = True
    action: Action = "alert"
    horizon_steps: int = Field(
        50, ge=1, description="warn when the trend reaches the limit within this many steps"
    )
    window: int = Field(10, ge=2, description="steps of each rank's series the line is fitted to")
    min_points: int = Field(5, ge=2, description="points needed before a forecast")
    warmup_steps: int = Field(
        3, ge=0, description="first records of each attempt skipped (allocators grow there)"
    )
    min_slope_mb: float = Field(
        1.0, ge=0, description="MB/step below which memory is flat (noise floor)"
    )
    max_jump_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="a rise whose largest single step is more than this share of it is a "
        "jump (an allocation, e.g. the first checkpoint's buffers), not a trend",
    )
    limit_mb: float | None = Field(
        None,
        gt=0,
        description="host limit in MB instead of the one each rank reports (cgroup, else RAM)",
    )
    device_limit_mb: float | None = Field(
        None, gt=0, description="GPU limit in MB instead of the device's total memory"
    )


class SdcConfig(_Strict):
    """Silent data corruption: exact fingerprints of each rank's state (see sdc.py and
    recipes/sdc.py)."""

    enabled: bool = True
    action: Action = Field(
        "rollback",
        description="rollback: to the newest checkpoint before the corruption, replaying the same "
        "data at the same LR (exact: the run ends as an uninterrupted one would); a rank caught "
        "again in a later attempt (a bad device) strikes its node",
    )
    every: int = Field(
        25,
        ge=0,
        description="ranks fingerprint their parameters and optimizer state after the optimizer "
        "step of every `every`-th step and again at the start of the next one (0 = off); the "
        "cost is two reads of the rank's state per `every` steps: 25 keeps it under 1% of a step "
        "on the tiny recipes (bench/README.md), a big model's step hides far more",
    )
    recheck_every: int = Field(
        200,
        ge=0,
        description="where no replica holds the same state (FSDP shards): every "
        "`recheck_every`-th step each rank computes its gradients a second time from the same "
        "batch and weights, before the optimizer, and compares them exactly (a third run decides "
        "a disagreement; the corrupt one is discarded, the weights never see it); 0 = off. One "
        "forward-backward per `recheck_every` steps: a recheck costs about one step (0.82-1.07x "
        "on titan-tiny), so 200 keeps it near 0.5% and every check together (at rest, recheck, "
        "partner) under 1% (bench/README.md)",
    )
    partner_every: int = Field(
        1000,
        ge=0,
        description="FSDP without TP/PP/CP: every `partner_every`-th step (and whenever a "
        "recheck's three runs all differ) each rank also computes the previous rank's batch and "
        "the ranks compare what each device handed to the gradient reduce-scatter: the one check "
        "that sees a device wrong the same way every time (its own re-runs agree with it); 0 = "
        "off. One forward-backward without the reduce per `partner_every` steps (bench/README.md)",
    )


class MonitorsSection(_Strict):
    """``[monitors]``: which monitors run, their thresholds, and what the supervisor does on a
    finding."""

    enabled: bool = Field(True, description="false = run no monitors at all")
    rollback: RollbackPolicy = RollbackPolicy()
    straggler: StragglerConfig = StragglerConfig()
    nan: NanConfig = NanConfig()
    loss_spike: LossSpikeConfig = LossSpikeConfig()
    loss_plateau: LossPlateauConfig = LossPlateauConfig()
    grad_explosion: GradExplosionConfig = GradExplosionConfig()
    entropy_collapse: EntropyCollapseConfig = EntropyCollapseConfig()
    kl_drift: KLDriftConfig = KLDriftConfig()
    reward_hacking: RewardHackingConfig = RewardHackingConfig()
    mode_collapse: ModeCollapseConfig = ModeCollapseConfig()
    stale_rollout: StaleRolloutConfig = StaleRolloutConfig()
    train_inference_gap: TrainInferenceGapConfig = TrainInferenceGapConfig()
    memory: MemoryConfig = MemoryConfig()
    sdc: SdcConfig = SdcConfig()

    def action_for(self, monitor: str) -> str:
        """The policy action for a finding of ``monitor`` (``alert`` for monitors this section does
        not know)."""
        cfg = getattr(self, monitor, None)
        return getattr(cfg, "action", "alert")
