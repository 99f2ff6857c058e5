"""The proxy reward rising while what it stands for does not (held-out scores first)."""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..base import Finding, finite_floats, finite_of, first_number, get_number, spelled
from ..config import RewardHackingConfig
from ..shared import _GATED, SharedRankedMonitor
from .common import _SharedRL, _spellings, _St
from .trend import _bend_noise, _d2_dof, _Fit, _Noise, _t_bar, _Tri, _Turn

# Student's t bars are computed once per degrees of freedom (``_t_bar``'s cache, O(dof) each):
# past this many the bar is within 1 % of the normal one, and a long dense run's thousands of
# second differences would otherwise compute a new bar every other step (a capped bar is higher)
_DOF_CAP = 200


class RewardHackingMonitor(_SharedRL):
    """Reward hacking (``monitor="reward_hacking"``).

    Reads ``reward``, a held-out score (``verifier_key``, else the first of
    ``heldout_keys`` such as ``eval/accuracy``; dense or logged only every N steps,
    on the step's record or on an eval record of its own) and ``coupled_keys``
    (``completions/mean_length``, ``clip_ratio/region_mean``).

    - Held-out rules, judged at each held-out value (and carried until the next):
      every held-out value is paired with the mean training reward since the
      previous one; over the last pairs within ``window`` steps (at least
      ``min_points`` pairs, spanning more steps when the score is sparse) the
      reward climbs (Pearson r against the step >= ``trend_corr``, and its slope over
      the last ``window`` steps >= ``rise_t`` standard errors) while the held-out slope
      is <= -``fall_z`` standard errors (hacking, critical; over that span or twice it).
      The held-out noise comes from its second differences (``_Noise``: a steady trend
      cancels), so 3 sparse values can already be confident; the bar is raised to the
      t quantile while that estimate rests on few differences. Or the held-out score
      does not follow (r <= ``flat_corr`` with the reward's r >= ``diverge_corr``, on
      at least 2 x ``min_points`` values: divergence, warning).
    - Turn rule (``bend_z``, ``bend_t``; dense or sparse held-out scores): the step where the
      training reward starts climbing faster (a line with one change of slope fits its last 200
      values best there, the change >= ``bend_t`` standard errors) and, on the last 48 held-out
      values fitted with a line bent at that step (continuous: the values before the bend pin
      where the score was heading), the slope after it <= -``bend_z`` standard errors, the bar the
      t quantile for the noise estimate's honest degrees of freedom (critical). The bend comes from
      the reward, whose noise is not the held-out score's: one test a look. A sparse score needs
      no confirmation (1-2 values after the bend can be enough); a dense one, judged at every
      step, the usual ``confirm``. A healthy run whose held-out score rises with the reward has
      a rising slope after the bend.
    - Coupling (every step): the reward trends up and a coupled key trends up with
      it (r(reward, key) >= ``coupling_corr``, fitted rise >= ``min_growth``) - warning.

    A rule must hold for ``confirm`` evaluations in a row, waiting at most ``confirm_steps``
    steps for them (a sparse score's next value is far away); one episode opens,
    escalates once, and ends with an all-clear after ``clear_steps`` quiet steps.

    Known false positives: coupling fires on healthy reasoning RL where longer
    answers are the point (lengths grow with reward by design) - keep it an alert,
    or drop ``completions/mean_length`` from ``coupled_keys``; a held-out score on a
    tiny eval set is noisy (raise ``min_points``). Known misses: hacking without a
    held-out score and without length/clip coupling.
    """

    name = "reward_hacking"

    def __init__(self, cfg: RewardHackingConfig | None = None) -> None:
        self.cfg = cfg or RewardHackingConfig()
        keys = [k for k in (self.cfg.verifier_key, *self.cfg.heldout_keys) if k]
        self._heldout = tuple(dict.fromkeys(keys))
        # held-out evals (``[eval]`` records) outrank the in-training verifier proxy
        self._proxy = (self.cfg.verifier_key,) if self.cfg.verifier_key else ()
        self._evals = tuple(k for k in self._heldout if k not in self._proxy)
        self._prefix = self.cfg.heldout_prefix
        self._plain: set = (
            set()
        )  # record keys seen that are no held-out eval (neither prefixed nor listed)
        self._eval_spellings = frozenset(_spellings(*self._evals))
        self._own = _spellings(self.cfg.reward_key)
        self._reward = spelled(self.cfg.reward_key)
        self._coupled = tuple((k, spelled(k)) for k in self.cfg.coupled_keys)
        self._coupled_sp = tuple(sp for _, sp in self._coupled)
        self._quick = _spellings(self.cfg.reward_key, *self._proxy)
        self._proxy_sp = spelled(self._proxy[0]) if self._proxy else None
        self._rewind_keys = self._own
        self._noop = (None,) * 5
        super().__init__()

    def _new_state(self) -> _St:
        st = _St()
        w = self.cfg.window
        st.rfit = _Fit(w)
        st.coupled = {k: _Tri(w) for k in self.cfg.coupled_keys}
        st.cconf = {k: 0 for k in self.cfg.coupled_keys}
        st.pairs = _Tri(max(w, self.cfg.min_points))
        st.lpairs = _Tri(2 * max(w, self.cfg.min_points))  # twice the span, for a slower fall
        st.turn = _Turn()  # the turn rule: the dense reward, the last held-out values
        st.racc = 0.0
        st.rn = 0
        st.last_r = None
        st.h_last = None  # step of the last held-out value
        st.h_step = 0  # spacing of the held-out values
        st.noise_h = _Noise()  # of the held-out values
        st.h_min = 0  # the closest spacing of held-out values seen
        st.h_key = None
        st.h_level = 0  # carried between held-out values
        st.h_conf = 0
        st.h_conf2 = 0
        st.h_quiet = True
        st.h_detail = ""
        st.h_value = None
        st.h_src = (
            None  # "proxy" (verifier_key) or "eval" (a held-out eval; once seen, the only source)
        )
        return st

    def _rewind(self, st: _St, step: int) -> None:
        st.ep.forget()
        st.rfit.rewind(step)
        for t in st.coupled.values():
            t.rewind(step)
        st.cconf = {k: 0 for k in st.cconf}
        st.pairs.rewind(step)
        st.lpairs.rewind(step)
        st.turn.rewind(step)
        st.racc, st.rn = 0.0, 0
        st.h_last = st.pairs.q[-1][0] if st.pairs.q else None
        st.noise_h.rewind(step, tuple(p[2] for p in list(st.pairs.q)[-2:]))
        st.h_level = st.h_conf = st.h_conf2 = 0
        st.h_quiet = True

    def feed_at(self, record: Mapping[str, Any], keys: Any, step: int, rank: int) -> list[Finding]:
        # no reward, no proxy, and only keys known to be no held-out eval: nothing to do (see
        # _RL.feed). Gated, as the base's gate: a record certified equal to this one but for some
        # values has the same keys, so its rank is gated too (``repeat``, ``repeat_group``), not
        # fed record by record (a node summary's seven ranks were, on every pre-training step)
        if keys <= self._plain and keys.isdisjoint(self._quick):
            self._led = (step, rank, record, _GATED, None, 0, False)
            return []
        return SharedRankedMonitor.feed_at(self, record, keys, step, rank)

    def _inputs(self, record: Mapping[str, Any]) -> tuple:
        """(reward, eval key, eval score, proxy key, proxy score, coupled values...): all ``_apply``
        reads. The eval score is a held-out eval (``heldout_keys``, else the record's first
        ``heldout_prefix`` key); the proxy is read only without one."""
        r = finite_of(record, self._reward)
        ek = ev = pk = pv = None
        if (
            not record.keys() <= self._plain
        ):  # a key not known to be plain: maybe an eval (one C set test)
            ek, ev = first_number(record, self._evals)
            if ev is None and self._prefix:
                ek, ev = self._prefixed(record)
        if (
            ev is None and self._proxy
        ):  # first_number over the one proxy key, its spellings computed once
            pv = finite_of(record, self._proxy_sp)
            if pv is not None:
                pk = self._proxy[0]
        if r is None:
            return (r, ek, ev, pk, pv)
        return (r, ek, ev, pk, pv) + finite_floats(record, self._coupled_sp)

    def _heldout_value(self, st: _St, inputs: tuple) -> tuple[str | None, float | None]:
        """The held-out eval score when the record has one, else the verifier proxy - until a rank's
        first eval, which switches that rank to evals for good (the proxy's pairs are dropped: a
        different score on a different scale)."""
        v = inputs[2]
        if v is not None:
            if st.h_src != "eval":
                if st.h_src == "proxy":
                    self._forget_heldout(st)
                st.h_src = "eval"
            return inputs[1], v
        if st.h_src == "eval" or not self._proxy:
            return None, None
        k, v = inputs[3], inputs[4]
        if v is not None:
            st.h_src = "proxy"
        return k, v

    def _prefixed(self, record: Mapping[str, Any]) -> tuple[str | None, float | None]:
        """The record's first ``heldout_prefix`` key with a finite value. Keys found to be neither
        an eval spelling nor prefixed join ``_plain``, so a record without an eval is ruled out by
        one subset test in C (``_heldout_value``), not a Python loop over its keys."""
        plain, prefix, evals = self._plain, self._prefix, self._eval_spellings
        found: tuple[str | None, float | None] = (None, None)
        for key in record:
            if key in plain:
                continue
            if isinstance(key, str) and prefix and key.startswith(prefix):
                if found[1] is None:
                    v = get_number(record, key)
                    if v is not None and math.isfinite(v):
                        found = (key, v)
            elif (
                key not in evals and len(plain) < 4096
            ):  # bounded: record keys are a small vocabulary
                plain.add(key)
        return found

    def heldout_source(self, rank: int = 0) -> tuple[str | None, str | None]:
        """("eval" | "proxy" | None, the key last read) for a rank: what the held-out rules compare
        against."""
        st = self._state_of(rank)
        return (st.h_src, st.h_key) if st is not None else (None, None)

    def _forget_heldout(self, st: _St) -> None:
        w = max(self.cfg.window, self.cfg.min_points)
        st.pairs, st.lpairs = _Tri(w), _Tri(2 * w)
        st.turn.h.clear()
        st.h_last, st.h_step, st.h_key = None, 0, None
        st.noise_h, st.h_min = _Noise(), 0
        st.h_level = st.h_conf = st.h_conf2 = 0
        st.h_quiet, st.h_detail, st.h_value = True, "", None

    def _judge_heldout(self, st: _St, step: int) -> None:
        cfg = self.cfg
        p = st.pairs
        span = max(cfg.window, cfg.min_points * st.h_step)
        p.drop_before(step - span + 1)
        lp = st.lpairs
        lp.drop_before(step - 2 * span + 1)
        level = 0
        bend, bend_text = False, ""
        st.h_quiet = True
        if step > cfg.warmup_steps and len(p.q) >= cfg.min_points:
            rc, vc = p.r_xa(), p.r_xb()
            # the all-clear needs signs of health (the reward stopped climbing, or the held-out
            # score follows it), not only a noisy stretch where the evidence fell short of a finding
            st.h_quiet = rc < 0.5 * cfg.trend_corr or vc > 0
            # the reward up and the held-out score down by so many standard errors, each series'
            # noise from its second differences (``_Noise``): a few sparse values still give a
            # confident slope where their own residuals (1-2 degrees of freedom) would not. The
            # noise estimate from n differences is itself noisy: the held-out bar is the t quantile
            # for the degrees of freedom n differences are worth, not the normal one
            n = st.noise_h.n
            z = zl = 0.0
            if n >= cfg.noise_values:
                # Student's t for the degrees of freedom n second differences are worth (about
                # n / 2: ``_d2_dof``); counted as n (its Cornish-Fisher term at n, until issue 49)
                # a score every 25 steps was judged on 2-3 differences as if sure of its noise
                # and flagged healthy controls before their onset (bench/README.md)
                fall = _t_bar(cfg.fall_z, max(1, min(_DOF_CAP, int(_d2_dof(n)))))
                sh = st.noise_h.sigma()
                z, zl = p.z("b", sh), lp.z("b", sh)
                climbs = (
                    st.rfit.tstat() >= cfg.rise_t
                )  # the reward climbs now, not only across the span
                if climbs and rc >= cfg.trend_corr and vc <= -cfg.trend_corr and z <= -fall:
                    level = 2
                elif (
                    climbs
                    and len(lp.q) >= 2 * cfg.min_points
                    and lp.r_xa() >= cfg.trend_corr
                    and zl <= -fall
                ):
                    level = 2  # a slower fall: twice the span
                # the turn rule: the reward starts climbing faster at some step (its bend, found
                # on every reward value: precise) and the held-out score falls after it, on a
                # line bent there - continuous, so the values before the bend pin where the score
                # was heading, and 1-2 sparse values after it can be enough. One test a look (the
                # bend comes from the reward, whose noise is not the held-out score's), its noise
                # the bent line's residuals pooled with the second differences before its values,
                # each counted for the degrees of freedom it has (``_bend_noise``). Judged only
                # while the reward climbs and the held-out score's recent slope is not up (cost)
                if cfg.bend_z and (climbs or lp.t_xa() >= cfg.rise_t) and min(z, zl) < 0:
                    turn = st.turn.judge(cfg.bend_t)
                    if turn is not None:
                        tau, acc, slope, vf, sse, k = turn
                        first_step = st.turn.h[0][0]
                        if slope < 0:
                            var, dof = _bend_noise(sse, k, st.noise_h.before(first_step))
                            sig = math.sqrt(var) if dof >= 1 else 0.0
                            zb = slope / (sig * math.sqrt(vf)) if sig > 0 else 0.0
                            if dof >= 1 and zb <= -_t_bar(cfg.bend_z, min(dof, _DOF_CAP)):
                                bend = True
                                if not level:
                                    level, z = 2, zb
                                    bend_text = (
                                        f"{cfg.reward_key} climbs faster from step {int(tau)} on "
                                        f"({acc:.1f} standard errors) while held-out {st.h_key} "
                                        f"falls after it ({slope:.2g} a step, {zb:.1f} standard "
                                        "errors)"
                                    )
            if (
                not level
                and rc >= cfg.diverge_corr
                and vc <= cfg.flat_corr
                and len(p.q) >= 2 * cfg.min_points
            ):
                level = 1  # held-out flat: weaker evidence than a fall, twice the values
            if level and bend_text:
                st.h_detail = (
                    f"{bend_text} over steps {int(first_step)}-{step} ({k} held-out values"
                    + (f", one every {st.h_step} steps)" if st.h_step > 1 else ")")
                )
                st.h_value = vc
            elif level:
                first, last = p.q[0], p.q[-1]
                how = "falls" if level == 2 else "does not follow"
                st.h_detail = (
                    f"{cfg.reward_key} rising ({first[1]:.3g} -> {last[1]:.3g}, r={rc:.2f}) "
                    "while held-out "
                    f"{st.h_key} {how} ({first[2]:.3g} -> {last[2]:.3g}, r={vc:.2f}, slope "
                    f"{min(z, zl):.1f} standard errors) over steps {int(first[0])}-{step} "
                    f"({len(p)} "
                    "held-out values"
                    + (f", one every {st.h_step} steps)" if st.h_step > 1 else ")")
                )
                st.h_value = vc
        st.h_conf = (
            st.h_conf + 1 if level >= 1 else 0
        )  # consecutive evaluations at warning or worse
        st.h_conf2 = st.h_conf2 + 1 if level >= 2 else 0  # ... at critical
        # confirmation costs at most ``confirm_steps`` steps: a sparse score's next value is far
        # away (the closest spacing seen: a gap in a dense score, a lost record or a rewind, does
        # not make it sparse)
        need = max(1, min(cfg.confirm, 1 + cfg.confirm_steps // max(1, st.h_min)))
        if bend and st.h_min * cfg.confirm > cfg.confirm_steps // 2:
            # the turn rule's evidence accumulates over the values after the bend: a sparse score
            # is not kept waiting for its next value; a dense one (the next value a step away,
            # and a look at every step: more looks, each on few values after the bend) confirms
            need = 1
        st.h_level = 2 if st.h_conf2 >= need else 1 if st.h_conf >= need + 1 else 0

    def _apply(
        self, st: _St, inputs: tuple, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:
        cfg = self.cfg
        r = inputs[0]
        hk, hv = self._heldout_value(st, inputs)
        if r is None and hv is None:
            return []
        if r is not None:
            st.rfit.add(step, r)
            st.turn.add_reward(step, r)
            st.racc += r
            st.rn += 1
            st.last_r = r
        if hv is not None and (st.rn or st.last_r is not None):
            if st.h_last is not None and step > st.h_last:
                st.h_step = step - st.h_last
                st.h_min = min(st.h_min, st.h_step) if st.h_min else st.h_step
            if st.h_last is None or step > st.h_last:
                rm = st.racc / st.rn if st.rn else st.last_r
                st.pairs.add(step, rm, hv)
                st.noise_h.add(hv, step)
                st.lpairs.add(step, rm, hv)
                st.turn.add_held(step, hv)
                st.racc, st.rn = 0.0, 0
                st.h_last = step
                st.h_key = hk
                self._judge_heldout(st, step)
        if r is None:
            # an eval record of its own: a finding it completes is reported on it, not on the next
            # training record (a step later); the all-clear counts training steps only
            out: list[Finding] = []
            if st.h_level > st.ep.level:
                phase = st.ep.update(st.h_level, False, cfg.clear_steps)
                if phase is not None:
                    self._report(
                        out,
                        st,
                        record,
                        step,
                        rank,
                        phase,
                        st.h_level,
                        st.h_value,
                        st.h_detail,
                        "",
                    )
            return out
        level = st.h_level
        value, detail = st.h_value, st.h_detail
        rising = (
            step > cfg.warmup_steps
            and len(st.rfit.q) >= cfg.window
            and st.rfit.corr() >= cfg.trend_corr
        )
        coupled_of = st.coupled
        for i, (k, sp) in enumerate(self._coupled, 5):
            t = coupled_of[k]
            y = inputs[i]
            if y is not None:
                t.add(step, r, y)
            coupled = False
            if rising and y is not None and len(t.q) >= cfg.window:
                start, end = t.b_line()
                growth = (
                    (end - start) / abs(start)
                    if abs(start) > 1e-9
                    else (math.inf if end > start else 0.0)
                )
                rk = t.r_ab()
                coupled = (
                    t.r_xb() >= cfg.trend_corr
                    and rk >= cfg.coupling_corr
                    and growth >= cfg.min_growth
                )
            st.cconf[k] = st.cconf[k] + 1 if coupled else 0
            if st.cconf[k] >= cfg.confirm and level < 1:
                level, value = 1, t.r_ab()
                detail = (
                    f"{cfg.reward_key} rising ({t.q[0][1]:.3g} -> {r:.3g}) together with {k} "
                    f"({start:.3g} -> {end:.3g} fitted, r={value:.2f}) over steps "
                    f"{int(t.q[0][0])}-{step}"
                )
        out = []
        phase = st.ep.update(level, level == 0 and st.h_quiet, cfg.clear_steps)
        if phase is not None:
            self._report(
                out,
                st,
                record,
                step,
                rank,
                phase,
                level,
                value,
                detail,
                f"{cfg.reward_key} and the held-out score agree again, no coupled rise, for "
                f"{cfg.clear_steps} steps",
            )
        return out
