"""R3L: a failed response retried from its diagnosed failure point with language feedback; pivotal credit.

Shi et al. 2026, *R3L: Reflect-then-Retry Reinforcement Learning with Language-Guided Exploration, Pivotal
Credit, and Positive Amplification*, arXiv 2601.03715; official code ``shiweijiezero/R3L`` (Trinity-RFT workflows
``trinity/common/workflows/envs/R3L/``, read for the form, not copied). Three parts; this module holds the first
two as a wrapper stage after the planner's verified chains, the third is a shaper
(:class:`treejax.rl.shaping.r3l.PositiveAmplification`):

1. *reflect-then-retry*: a failed response is diagnosed, its failure point located, and the policy retries from
   there with language feedback in its context;
2. *pivotal credit*: only the diverging suffix is trained; the shared prefix gets no gradient, in the retried row
   **and** in the failed row it came from (the official ``_adjust_action_mask_for_retry`` masks both);
3. *positive amplification*: successful leaves' advantages are multiplied by ``alpha``.

On treejax's parts, for every prompt's group of ``W`` independent chains (``TreeConfig.branch_factor = 1``), the
last ``k = retries_per_prompt`` leaf slots are **retry slots**, the first ``W - k`` source slots::

    steps      [a_j, b_j): a source leaf's tokens, cut after newline tokens ("lines") or the tree's segments
    j*         = min { j : s_j < threshold }           s_j the PRM's step score; the failure point a = a_{j*}
    sources    per prompt up to k failed source leaves with a located j*, the longest prefix a first
    feedback   f = feedback_template(step j*, reflection)           tokens of the policy's tokenizer
               reflection = ""                                      feedback = "template"
               reflection ~ refiner(. | question, y_<a, step j*)    feedback = "refiner" (decoded text)
    retry      c ~ pi_sampler(. | x, y_<a, f)          ("none": c ~ pi_sampler(. | x, y_<a), no feedback)
    row        y' = y_<a . c (cut at T) in retry slot W - k + i; f is NOT in the row (kept out of the trained
               context); reward = the verifier's of y' (shaped as the planner's)
    masks      m'_t = 1[a <= t < |y'|] on the retried row; m_t = 0 for t < a on the source leaf
    log-probs  the retried row's Forest.logprobs on c: log pi_sampler(c_t | x, y_<a, f, c_<t)  (the behaviour)

**The feedback and off-policy-ness (the choice made).** The official workflow samples the retry with the
guidance in the system prompt and trains the same tokens under the prompt *without* it (its ``distill_trajectory``),
treating them as on-policy. Here too the feedback is dropped from the training row (so the policy learns to
produce the correction unprompted), but the tokens ``c`` were sampled from ``pi(. | x, y_<a, f)`` and are trained
under ``pi(. | x, y_<a)``: they are off-policy. Their behaviour log-probs (under ``f``) are stored, exactly as a
refiner's (``Rollouts.refined_PxWxT`` marks them), and with ``RunConfig.old_logp = 'trainer'`` and
``LossConfig.tis_cap = C`` the loss weighs each by ``min(pi_prox(c_t | x, y_<a, c_<t) / pi_sampler(c_t | x, y_<a,
f, c_<t), C)`` (truncated IS, as replayed and SCOPE rows), which the stage requires. ``feedback = "none"``
retries without feedback: the retry is then exactly on-policy (a fork from the failure point) and needs no
correction.

Reconstructed, not the paper's: the diagnosis is a PRM's first wrong step (the official reflection is the
policy's own JSON report naming ``retry_from_step`` and an ``improvement_suggestion``; here the suggestion is the
refiner's one-line reflection, or none); the group keeps ``W`` rows (the official group is ``n / 2`` first attempts
plus a retry for each failed one): a retry slot holds a fresh sample until a retry overwrites it, so the slots a
retry takes are chosen by position, never by outcome; the IS correction (the official code applies none). The
verifier's ``scores_PxW`` keep the policy's own leaves (``reward/accuracy`` measures the policy); the reward's
``reward_scores_PxW`` carry the retried rows' scores (what the estimator's rewards and Positive Amplification
read). Metrics: ``r3l/failed`` (failed source leaves judged), ``r3l/located``, ``r3l/retried``, ``r3l/salvaged``
(retried rows the verifier accepts), ``r3l/first_step_mean``, ``r3l/prefix_tokens`` (masked out, both rows),
``r3l/suffix_tokens`` (trained retry tokens), ``r3l/feedback_tokens`` (mean per retry), ``r3l/log_ratio_mean``
(mean ``log pi(c_t | no feedback) - log pi(c_t | feedback)`` under the sampler's weights: how off-policy the
feedback makes the retry), ``time/r3l_s``. The planner's dynamic sampling would drop all-wrong groups before R3L
sees them; the shipped config turns it off.
"""

from __future__ import annotations

import dataclasses
import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from treejax.errors import ConfigError
from treejax.rl.judges.base import example_fields
from treejax.rl.judges.scope import STEPS, SCOPERollouts, _Rewrite
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import EXPANDED, OFF_POLICY, VERIFIER
from treejax.scorers.config import ScorerConfig
from treejax.scorers.refiner import RefinerConfig

FEEDBACK = ("template", "refiner", "none")
#: the feedback the policy reads at the failure point (``{step}``: the wrong step's text; ``{reflection}``: the
#: refiner's decoded reflection, ``""`` with ``feedback = "template"``); never part of the training row
DEFAULT_FEEDBACK_TEMPLATE = "\n(Feedback: the next step, \"{step}\", was wrong. {reflection}Retry it.)\n"
#: the refiner's user turn when it writes the reflection (``feedback = "refiner"``)
DEFAULT_REFLECT_TEMPLATE = ("Here is a math problem and the start of a solution.\n\nProblem: {question}\n\n"
                            "Solution so far:\n{prefix}\n\nThis next step is wrong:\n{step}\n\n"
                            "In one sentence, say what is wrong with it and how to fix it.")


def retry_slots(W: int, k: int) -> tuple[range, range]:
    """``(source slots, retry slots)`` of a group of ``W`` leaves with ``k`` retries (module docstring)."""
    return range(0, W - k), range(W - k, W)


def pivotal_masks(a: int, n_retry: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[T]`` each: the retried row's mask ``1[a <= t < n_retry]`` (the diverging suffix only) and the
    multiplier of the source leaf's mask ``1[t >= a]`` (its shared prefix out of the loss)."""
    t = np.arange(T)
    return ((t >= a) & (t < n_retry)).astype(np.float32), (t >= a).astype(np.float32)


def assemble_retry(prefix_tokens, prefix_logp, retry_tokens, retry_logp, T: int):
    """One retried row of ``T`` slots: ``(tokens [T], logprobs [T], length)``: ``y_<a . c`` cut at ``T`` (the
    feedback is not in it); log-probs: the source's on the prefix, the behaviour's on ``c``."""
    toks = np.concatenate([np.asarray(prefix_tokens, np.int32), np.asarray(retry_tokens, np.int32)])[:T]
    lps = np.concatenate([np.asarray(prefix_logp, np.float32), np.asarray(retry_logp, np.float32)])[:T]
    out_t, out_l = np.zeros(T, np.int32), np.zeros(T, np.float32)
    out_t[: len(toks)], out_l[: len(toks)] = toks, lps
    return out_t, out_l, len(toks)


@dataclasses.dataclass(frozen=True)
class R3LConfig(Stage):
    """R3L's reflect-then-retry with pivotal credit (module docstring). gin::

        RunConfig.rollouts = [@R3LConfig()]
        RunConfig.shapers = [@PositiveAmplification()]     # R3L's third part (treejax.rl.shaping.r3l)
        R3LConfig.prm = @ScorerConfig()                    # the diagnoser: its first wrong step is the failure point

    ``threshold``: a step is wrong iff its PRM score is below it; ``retries_per_prompt``: the group's retry slots
    ``k`` (``1 <= k < W``); ``steps``: ``"lines"`` or ``"segments"``; ``feedback``: ``"template"``, ``"refiner"``
    (the refiner, ``RefinerConfig`` with ``{prefix}``, decodes the reflection) or ``"none"``;
    ``feedback_template``: the text the policy reads at the failure point (``{step}``, ``{reflection}``)."""

    prm: ScorerConfig = dataclasses.field(default_factory=ScorerConfig)
    refiner: RefinerConfig = dataclasses.field(
        default_factory=lambda: RefinerConfig(template=DEFAULT_REFLECT_TEMPLATE, max_new_tokens=48))
    threshold: float = 0.5
    retries_per_prompt: int = 4
    steps: str = "lines"
    feedback: str = "template"
    feedback_template: str = DEFAULT_FEEDBACK_TEMPLATE

    role: ClassVar[str] = "wrapper"  # retries failed leaves of the chain before it
    requires: ClassVar[tuple] = (VERIFIER, EXPANDED)
    keeps: ClassVar[frozenset[str]] = frozenset()  # its rows are not checked with replay or the shape search
    passes_inputs: ClassVar[bool] = False  # inputs computed from the planner's leaves would not see the retries

    @property
    def rewrites_per_prompt(self) -> int:  # what SCOPE's locator reads
        return self.retries_per_prompt

    def __post_init__(self):
        for name, cls in (("prm", ScorerConfig), ("refiner", RefinerConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"R3LConfig.{name} must be a {cls.__name__}, got {getattr(self, name)!r}; fix: "
                                  f"R3LConfig.{name} = @{cls.__name__}()")
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(f"R3LConfig.threshold must be in (0, 1), got {self.threshold}; fix: "
                              "R3LConfig.threshold = 0.5")
        if self.retries_per_prompt < 1:
            raise ConfigError(f"R3LConfig.retries_per_prompt must be >= 1, got {self.retries_per_prompt}; fix: "
                              "R3LConfig.retries_per_prompt = 4")
        if self.steps not in STEPS:
            raise ConfigError(f"R3LConfig.steps must be one of {STEPS}, got {self.steps!r}; fix: "
                              "R3LConfig.steps = 'lines'")
        if self.feedback not in FEEDBACK:
            raise ConfigError(f"R3LConfig.feedback must be one of {FEEDBACK}, got {self.feedback!r}; fix: "
                              "R3LConfig.feedback = 'template'")
        try:
            self.feedback_template.format(step="", reflection="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"R3LConfig.feedback_template may use only {{step}} and {{reflection}} ({e!r}); "
                              "fix: see treejax.rl.judges.r3l.DEFAULT_FEEDBACK_TEMPLATE") from None

    def check(self, facts) -> None:
        if facts.tree.branch_factor != 1:
            raise ConfigError("R3LConfig retries one leaf's response, which needs independent chains; fix: "
                              "TreeConfig.branch_factor = 1")
        if self.retries_per_prompt >= facts.tree.num_leaves:
            raise ConfigError(f"R3LConfig.retries_per_prompt = {self.retries_per_prompt} leaves no source slot in "
                              f"a group of {facts.tree.num_leaves}; fix: R3LConfig.retries_per_prompt < "
                              "TreeConfig.num_leaves")
        if self.feedback != "none" and not OFF_POLICY.holds(facts):
            raise ConfigError(OFF_POLICY.message(f"{self.stage_name} (feedback = {self.feedback!r})", facts)
                              + " (or R3LConfig.feedback = 'none')")

    def build(self, inner, ctx):
        return R3LRollouts(inner, self, ctx)


@dataclasses.dataclass(frozen=True)
class RetryRow:
    """One retried row: its source leaf ``(p, w)``, the retry slot ``slot``, the failure point ``a``, the row
    (``tokens``, ``logprobs`` ``[T]``, ``length``), whether the policy stopped, the feedback's token count."""

    p: int
    w: int
    slot: int
    a: int
    tokens: np.ndarray
    logprobs: np.ndarray
    length: int
    stopped: bool
    feedback_tokens: int


class R3LRollouts(SCOPERollouts):
    """The runtime wrapper (module docstring). ``base``: the chain before it. The PRM (and with ``feedback =
    "refiner"`` the refiner) load on the first step with a failed source leaf; SCOPE's locator finds the failure
    points (:meth:`SCOPERollouts.locate`)."""

    def _load(self):
        from treejax.scorers.model import load_scorer, resolve_model
        from treejax.scorers.refiner import Refiner, check_tokenizer, load_refiner

        if self.prm is None:
            prm_cfg, ref_cfg, policy = self.stage.prm, self.stage.refiner, self.ctx.cfg.model
            self.prm = load_scorer(prm_cfg, policy)
            if self.stage.feedback == "refiner":
                same = (resolve_model(prm_cfg, policy), prm_cfg.compute_dtype) == (
                    resolve_model(ref_cfg, policy), ref_cfg.compute_dtype) and prm_cfg.sharding == "device"
                self.refiner = (Refiner(ref_cfg, self.prm.model_config, self.prm.params, self.prm.tokenizer)
                                if same else load_refiner(ref_cfg, policy))
                check_tokenizer(self.refiner, self.ctx.tokenizer)

    def feedback_ids(self, chosen: list[_Rewrite], questions, key) -> list[list[int]]:
        """The feedback tokens the policy reads at each chosen leaf's failure point (module docstring)."""
        from treejax.scorers.refiner import refine, refiner_context

        stage, tok = self.stage, self.ctx.tokenizer
        if stage.feedback == "none":
            return [[] for _ in chosen]
        reflections = ["" for _ in chosen]
        if stage.feedback == "refiner":
            contexts = [refiner_context(self.refiner, questions[r.p], r.prefix, r.step) for r in chosen]
            spans = refine(self.refiner, contexts, key)
            texts = [tok.decode(spans.tokens_NxK[i, : spans.lengths_N[i]].tolist(), skip_special_tokens=True)
                     for i in range(len(chosen))]
            reflections = [t.strip() + " " if t.strip() else "" for t in texts]
        return [list(tok.encode(stage.feedback_template.format(step=r.step.strip(), reflection=x)))
                for r, x in zip(chosen, reflections)]

    def retry(self, params, ro, chosen: list[_Rewrite], feedback: list[list[int]], key):
        """The policy's retries after ``prompt . y_<a . f`` (module docstring): host ``(tokens, logprobs,
        lengths, stopped)`` of the decoded continuations and ``log pi_sampler`` of each retried token without
        the feedback (``[N, T]``, teacher forcing; for ``r3l/log_ratio_mean``)."""
        from treejax.data.prompts import pad_token_lists
        from treejax.sampling import probe as probe_lib
        from treejax.sampling.decode import bucket_length, generate, resolve_stop_ids, score_tokens

        cfg, fns = self.ctx.cfg, self.ctx.sampler_fns
        T = cfg.rollout.max_length
        weights, _ = probe_lib.detach(params)
        tokens = np.asarray(jax.device_get(ro.forest.tokens))
        prompts = np.asarray(ro.prompts_PxLp)[[r.p for r in chosen]]
        lens = np.asarray(ro.lengths_P)[[r.p for r in chosen]]
        starts = [r.steps[r.k][0] for r in chosen]
        ctx_ids = [list(prompts[i][: lens[i]]) + list(tokens[r.p, r.w, :a]) + list(f)
                   for i, (r, a, f) in enumerate(zip(chosen, starts, feedback))]
        cp, cl = pad_token_lists(ctx_ids, bucket_length(max(len(c) for c in ctx_ids)), self.ctx.pad_id)
        stop_ids = resolve_stop_ids(cfg.rollout.stop_ids, fns)
        out = generate(weights, fns, cp, cl, key, max(1, T - min(starts)), cfg.rollout.strategy, stop_ids=stop_ids)
        toks, lps, ns = (np.asarray(x) for x in jax.device_get((out.tokens, out.logprobs, out.lengths)))
        ns = np.array([min(int(n), T - a) for n, a in zip(ns, starts)], np.int32)  # a retry never passes T
        stopped = np.array([n > 0 and int(toks[i, n - 1]) in stop_ids for i, n in enumerate(ns)])
        rows = np.zeros((len(chosen), T), np.int32)
        for i, (r, a) in enumerate(zip(chosen, starts)):
            rows[i, :a], rows[i, a:a + ns[i]] = tokens[r.p, r.w, :a], toks[i, : ns[i]]
        plain = np.asarray(score_tokens(weights, fns, prompts, lens, rows, np.asarray(starts) + ns))
        return toks, lps, ns, stopped, plain

    def retried_rows(self, params, ro, chosen: list[_Rewrite], key, questions):
        """The chosen source leaves retried (module docstring): their :class:`RetryRow` s (retry slot ``W - k + i``
        for the ``i``-th source of a prompt) and the mean ``log pi(c | no feedback) - log pi(c | feedback)``."""
        T, W = self.ctx.cfg.rollout.max_length, ro.forest.tokens.shape[1]
        feedback = self.feedback_ids(chosen, questions, jax.random.fold_in(key, 0x3F))
        toks, lps, ns, stopped, plain = self.retry(params, ro, chosen, feedback, jax.random.fold_in(key, 0x3E))
        tokens, logprobs = (np.asarray(x) for x in jax.device_get((ro.forest.tokens, ro.forest.logprobs)))
        rows, ratios, used = [], [], {}
        for i, r in enumerate(chosen):
            a = r.steps[r.k][0]
            slot = retry_slots(W, self.stage.retries_per_prompt)[1][used.get(r.p, 0)]
            used[r.p] = used.get(r.p, 0) + 1
            t, lp, n = assemble_retry(tokens[r.p, r.w, :a], logprobs[r.p, r.w, :a], toks[i, : ns[i]],
                                      lps[i, : ns[i]], T)
            rows.append(RetryRow(r.p, r.w, slot, a, t, lp, n, bool(stopped[i]), len(feedback[i])))
            if feedback[i]:
                ratios += list(plain[i, a:n] - lp[a:n])
        return rows, float(np.mean(ratios)) if ratios else 0.0

    def sample(self, params, key, step):
        ro = self.base.sample(params, key, step)
        t0 = time.perf_counter()
        f = ro.forest
        host = tuple(np.asarray(x) for x in jax.device_get((f.tokens, f.leaf_length, f.loss_mask)))
        W = host[0].shape[1]
        questions, _ = example_fields(ro.examples, ro.prompts_PxLp, ro.lengths_P, self.ctx.tokenizer)
        sources = np.asarray(ro.correct_PxW, bool).copy()
        sources[:, retry_slots(W, self.stage.retries_per_prompt)[1].start:] = True  # retry slots are no source
        chosen, found = self.locate(host, sources, questions)
        metrics = {k.replace("scope/", "r3l/"): v for k, v in found.items()}
        metrics.update({"r3l/retried": len(chosen), "r3l/salvaged": 0, "r3l/prefix_tokens": 0,
                        "r3l/suffix_tokens": 0, "r3l/feedback_tokens": 0.0, "r3l/log_ratio_mean": 0.0})
        ro.refined_PxWxT = np.zeros(f.tokens.shape, np.float32)
        if chosen:
            rows, ratio = self.retried_rows(params, ro, chosen, jax.random.fold_in(key, 0x3E3), questions)
            metrics.update(write_retries(ro, rows, self.ctx, off_policy=self.stage.feedback != "none"))
            metrics["r3l/log_ratio_mean"] = ratio
        ro.extra_metrics = {**(ro.extra_metrics or {}), **metrics, "time/r3l_s": time.perf_counter() - t0}
        return ro


def write_retries(ro, rows: list[RetryRow], ctx, off_policy: bool) -> dict:
    """The retried rows written into their retry slots of ``ro`` (tokens, log-probs, pivotal loss masks on the
    retried row and its source, lengths, statuses, segments, rewards, ``reward_scores_PxW``; with ``off_policy``
    ``refined_PxWxT`` marks the retried tokens); returns the ``r3l/*`` row metrics."""
    from treejax.forest import NodeStatus
    from treejax.rl import scoring

    cfg, f = ctx.cfg, ro.forest
    tokens, logprobs, mask, lengths, status, seg = (np.array(x) for x in jax.device_get(
        (f.tokens, f.logprobs, f.loss_mask, f.leaf_length, f.leaf_status, f.segment_index)))
    rewards = np.array(jax.device_get(ro.rewards_PxW), np.float32)
    base_scores = ro.scores_PxW if ro.reward_scores_PxW is None else ro.reward_scores_PxW
    reward_scores = np.array(base_scores, np.float32)
    texts = [ctx.tokenizer.decode(r.tokens[: r.length].tolist(), skip_special_tokens=True) for r in rows]
    scores = np.array([ctx.task.score(x, ro.examples[r.p]) for x, r in zip(texts, rows)], np.float32)
    shaped = scoring.shaped_rewards(scores[None], np.array([[r.length for r in rows]], np.int32), cfg.reward_style,
                                    cfg.rollout.max_length, cfg.overlong_buffer, cfg.overlong_factor)[0]
    T, depth, S = tokens.shape[-1], f.leaf_path.shape[-1] - 1, f.segment_length
    t = np.arange(T)
    prefix = 0
    for i, r in enumerate(rows):
        retry_mask, keep_source = pivotal_masks(r.a, r.length, T)
        prefix += int(mask[r.p, r.w, : r.a].sum()) + r.a
        mask[r.p, r.w] = mask[r.p, r.w] * keep_source
        tokens[r.p, r.slot], logprobs[r.p, r.slot], lengths[r.p, r.slot] = r.tokens, r.logprobs, r.length
        mask[r.p, r.slot] = retry_mask
        seg[r.p, r.slot] = np.where(t < r.length, np.minimum(t // S, depth - 1), 0).astype(seg.dtype)
        status[r.p, r.slot] = int(NodeStatus.EOS if r.stopped else NodeStatus.TRUNCATED)
        rewards[r.p, r.slot], reward_scores[r.p, r.slot] = shaped[i], scores[i]
        ro.refined_PxWxT[r.p, r.slot] = retry_mask if off_policy else 0.0
    ro.forest = f.replace(tokens=jnp.asarray(tokens), logprobs=jnp.asarray(logprobs), loss_mask=jnp.asarray(mask),
                          leaf_length=jnp.asarray(lengths), leaf_status=jnp.asarray(status),
                          segment_index=jnp.asarray(seg))
    ro.rewards_PxW, ro.reward_scores_PxW = jnp.asarray(rewards), reward_scores
    return {"r3l/salvaged": int((scores >= 1.0).sum()), "r3l/prefix_tokens": prefix,
            "r3l/suffix_tokens": int(sum(r.length - r.a for r in rows)),
            "r3l/feedback_tokens": float(np.mean([r.feedback_tokens for r in rows]))}


__all__ = ["DEFAULT_FEEDBACK_TEMPLATE", "DEFAULT_REFLECT_TEMPLATE", "FEEDBACK", "R3LConfig", "R3LRollouts",
           "RetryRow", "assemble_retry", "pivotal_masks", "retry_slots", "write_retries"]
