"""SCOPE: a PRM finds the first wrong step of a failed response; a refiner rewrites it off-policy; the policy continues.

Ren et al. 2026, *Recycling Failures: Salvaging Exploration in RLVR via Fine-Grained Off-Policy Guidance*
(SCOPE, "Step-wise Correction for On-Policy Exploration"), arXiv 2602.24110; no official code found. Only the
abstract could be read: a PRM "pinpoints the first erroneous step in suboptimal rollouts" and SCOPE "applies
fine-grained, step-wise off-policy rectification", salvaging largely correct trajectories instead of replacing
whole trajectories with off-policy ones (LUFFY). What follows is **our reconstruction** of that sentence on
treejax's parts; each choice is marked.

For every prompt's group of ``W`` independent chains (``TreeConfig.branch_factor = 1``), after the planner has
decoded and verified them:

1. *steps*: a failed leaf's response tokens cut into steps ``[a_k, b_k)``: ``steps = "lines"`` ends a step after
   each token whose text holds a newline (a whitespace-only step joins the one before it), ``"segments"`` uses the
   tree's fixed segments of ``S`` tokens (:func:`token_steps`);
2. *first wrong step*: the PRM's step scores ``s_k`` (:func:`treejax.scorers.prm.step_scores`: ``p(yes) / (p(yes)
   + p(no))`` at each step's tag, one teacher-forced pass per leaf) and
   ``k* = min { k : s_k < threshold }`` (NaN, a step past the PRM's ``max_length``, is not wrong); a failed leaf
   without such a step is left alone (:func:`first_wrong_step`);
3. *which leaves* (reconstructed): per prompt, up to ``rewrites_per_prompt`` failed leaves with a located error,
   the longest salvaged prefix ``a_{k*}`` first (ties: the lower leaf index) (:func:`choose_rewrites`);
4. *rewrite* (the refiner, :mod:`treejax.scorers.refiner`): ``z ~ q(. | refiner template(question, y_{<a_{k*}},
   step k*))``, one line (or one segment) decoded with the sampler, with its behaviour log-probs ``log q(z_t)``;
5. *continue* (on-policy): ``c ~ pi_sampler(. | x, y_{<a_{k*}}, z)`` with the run's own sampling strategy and stop
   ids, until a stop token or the row's ``T`` tokens;
6. *the row* (:func:`assemble_row`): ``y' = y_{<a_{k*}} . z . c`` **replaces** the failed leaf in its group
   (reconstructed: the group keeps ``W`` leaves, LUFFY's mixed group; the estimator's baseline is over the mixed
   group). Its log-probs are the policy sampler's on ``y_{<a}`` and ``c`` and the refiner's ``log q`` on ``z``;
   its reward is the verifier's of ``y'`` (shaped as the planner shapes rewards). ``refined_PxWxT`` marks ``z``;
7. *correction* of the off-policy tokens ``z``: ``correction = "is"`` (default) trains them with the loss's
   truncated IS, exactly as a replayed row: ``w_t = min(pi_prox(z_t) / q(z_t), C)`` with ``pi_prox`` the
   trainer's pre-update log-prob (``RunConfig.old_logp = 'trainer'``, ``LossConfig.tis_cap = C``; on the policy's
   own tokens ``w_t`` is the usual sampler/trainer correction, about 1); ``"mask"`` keeps ``z`` out of the loss
   (``loss_mask = 0``) and trains only the policy's own tokens of the row. (The paper's abstract does not say
   which; LUFFY's regularized IS shaping ``f(w) = w / (w + gamma)`` is not reproduced.)

The verifier's ``scores_PxW`` keep the policy's own leaves (``reward/accuracy`` measures the policy, as with
DART's injected successes); the rewritten rows' outcomes are in the metrics: ``scope/failed`` (failed leaves
judged), ``scope/located`` (with a first wrong step), ``scope/rewritten``, ``scope/salvaged`` (rewritten rows the
verifier accepts), ``scope/first_step_mean``, ``scope/refined_tokens``, ``scope/refiner_logp_mean``,
``scope/log_ratio_mean`` (mean ``log pi_sampler(z_t) - log q(z_t)`` on the refined tokens: how off-policy the
refiner is), ``time/scope_s``.

Order of effects: the planner's dynamic sampling drops all-wrong groups before SCOPE sees them (the groups SCOPE
would give a signal), so the shipped config turns it off.
"""

from __future__ import annotations

import dataclasses
import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from treejax.errors import ConfigError
from treejax.rl.judges.base import BaseStateOnly, example_fields
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import EXPANDED, OFF_POLICY, VERIFIER
from treejax.scorers.config import ScorerConfig
from treejax.scorers.refiner import RefinerConfig

STEPS = ("lines", "segments")
CORRECTIONS = ("is", "mask")


def token_steps(tokens, length: int, mode: str, segment_length: int, is_newline, is_blank) -> list[tuple[int, int]]:
    """A response's steps as token spans ``[(a_k, b_k)]`` (module docstring, 1). ``is_newline(id)``: the token's
    text holds a newline; ``is_blank(a, b)``: the span's text is whitespace only."""
    n = int(length)
    if mode == "segments":
        return [(a, min(a + segment_length, n)) for a in range(0, n, segment_length)]
    cuts = [t + 1 for t in range(n) if is_newline(int(tokens[t]))]
    bounds = [0] + [c for c in cuts if c < n] + [n] if n else [0]
    spans = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and is_blank(a, b):
            out[-1] = (out[-1][0], b)
        elif out and is_blank(*out[-1]):
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def first_wrong_step(scores_S, threshold: float) -> int:
    """``min { k : s_k < threshold }`` over the finite scores; ``-1`` when no step is below it."""
    s = np.asarray(scores_S, np.float64)
    with np.errstate(invalid="ignore"):
        hit = np.flatnonzero(np.isfinite(s) & (s < threshold))
    return int(hit[0]) if hit.size else -1


def choose_rewrites(candidates: list[tuple[int, int, int]], per_prompt: int) -> list[tuple[int, int]]:
    """``[(p, w)]``: of ``candidates`` ``(p, w, a)`` (a failed leaf with a first wrong step starting at token
    ``a``), per prompt the ``per_prompt`` with the largest ``a`` (ties: lower ``w``); sorted by ``(p, w)``."""
    by_prompt: dict[int, list[tuple[int, int]]] = {}
    for p, w, a in candidates:
        by_prompt.setdefault(p, []).append((-a, w))
    out = []
    for p, lst in by_prompt.items():
        out += [(p, w) for _, w in sorted(lst)[:per_prompt]]
    return sorted(out)


def assemble_row(prefix_tokens, prefix_logp, span_tokens, span_logp, cont_tokens, cont_logp, T: int):
    """One rewritten response of ``T`` slots (module docstring, 6): ``(tokens [T], logprobs [T], refined [T],
    length)``; ``refined`` is 1 on the refiner's span; a continuation past ``T`` is cut."""
    toks = np.concatenate([np.asarray(prefix_tokens, np.int32), np.asarray(span_tokens, np.int32),
                           np.asarray(cont_tokens, np.int32)])[:T]
    lps = np.concatenate([np.asarray(prefix_logp, np.float32), np.asarray(span_logp, np.float32),
                          np.asarray(cont_logp, np.float32)])[:T]
    refined = np.zeros(T, np.float32)
    a = len(prefix_tokens)
    refined[a:min(a + len(span_tokens), T)] = 1.0
    n = len(toks)
    out_t, out_l = np.zeros(T, np.int32), np.zeros(T, np.float32)
    out_t[:n], out_l[:n] = toks, lps
    return out_t, out_l, refined, n


@dataclasses.dataclass(frozen=True)
class SCOPEConfig(Stage):
    """SCOPE (module docstring). gin::

        RunConfig.rollouts = [@SCOPEConfig()]
        SCOPEConfig.prm = @ScorerConfig()          # the PRM: its step scores locate the first wrong step
        SCOPEConfig.refiner = @RefinerConfig()     # the model that rewrites it ("policy": a frozen copy)

    ``threshold``: a step is wrong iff its PRM score is below it; ``rewrites_per_prompt``: failed leaves rewritten
    per group; ``steps``: ``"lines"`` or ``"segments"``; ``correction``: ``"is"`` (truncated IS, like replayed
    rows) or ``"mask"`` (the refiner's tokens out of the loss)."""

    prm: ScorerConfig = dataclasses.field(default_factory=ScorerConfig)
    refiner: RefinerConfig = dataclasses.field(default_factory=RefinerConfig)
    threshold: float = 0.5
    rewrites_per_prompt: int = 2
    steps: str = "lines"
    correction: str = "is"

    role: ClassVar[str] = "wrapper"  # rewrites failed leaves of the chain before it
    requires: ClassVar[tuple] = (VERIFIER, EXPANDED)
    keeps: ClassVar[frozenset[str]] = frozenset()  # its rows are not checked with replay or the shape search
    passes_inputs: ClassVar[bool] = False  # inputs computed from the planner's leaves would not see the rewrites

    def __post_init__(self):
        if not isinstance(self.prm, ScorerConfig):
            raise ConfigError(f"SCOPEConfig.prm must be a ScorerConfig, got {self.prm!r}; fix: "
                              "SCOPEConfig.prm = @ScorerConfig()")
        if not isinstance(self.refiner, RefinerConfig):
            raise ConfigError(f"SCOPEConfig.refiner must be a RefinerConfig, got {self.refiner!r}; fix: "
                              "SCOPEConfig.refiner = @RefinerConfig()")
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(f"SCOPEConfig.threshold must be in (0, 1), got {self.threshold}; fix: "
                              "SCOPEConfig.threshold = 0.5")
        if self.rewrites_per_prompt < 1:
            raise ConfigError(f"SCOPEConfig.rewrites_per_prompt must be >= 1, got {self.rewrites_per_prompt}; fix: "
                              "SCOPEConfig.rewrites_per_prompt = 2")
        if self.steps not in STEPS:
            raise ConfigError(f"SCOPEConfig.steps must be one of {STEPS}, got {self.steps!r}; fix: "
                              "SCOPEConfig.steps = 'lines'")
        if self.correction not in CORRECTIONS:
            raise ConfigError(f"SCOPEConfig.correction must be one of {CORRECTIONS}, got {self.correction!r}; fix: "
                              "SCOPEConfig.correction = 'is'")

    def check(self, facts) -> None:
        if facts.tree.branch_factor != 1:
            raise ConfigError("SCOPEConfig rewrites one leaf's tokens, which needs independent chains; fix: "
                              "TreeConfig.branch_factor = 1")
        if self.rewrites_per_prompt > facts.tree.num_leaves:
            raise ConfigError(f"SCOPEConfig.rewrites_per_prompt = {self.rewrites_per_prompt} exceeds the "
                              f"{facts.tree.num_leaves} leaves of a group; fix: SCOPEConfig.rewrites_per_prompt <= "
                              "TreeConfig.num_leaves")
        if self.correction == "is" and not OFF_POLICY.holds(facts):
            raise ConfigError(OFF_POLICY.message(f"{self.stage_name} (correction = 'is')", facts)
                              + " (or SCOPEConfig.correction = 'mask')")

    def build(self, inner, ctx):
        return SCOPERollouts(inner, self, ctx)


@dataclasses.dataclass
class _Rewrite:
    """One chosen failed leaf ``(p, w)``: its steps, its first wrong step ``k`` and the texts the refiner reads."""

    p: int
    w: int
    steps: list
    k: int
    prefix: str
    step: str


class SCOPERollouts(BaseStateOnly):
    """The runtime wrapper (module docstring). ``base``: the chain before it. The PRM and the refiner load on the
    first step with a failed leaf."""

    def __init__(self, base, stage: SCOPEConfig, ctx):
        self.base, self.stage, self.ctx = base, stage, ctx
        self.pipeline = getattr(base, "pipeline", None)
        self.estimator_inputs = ()
        self.prm = self.refiner = None
        self._newline: dict[int, bool] = {}

    def _load(self):
        from treejax.scorers.model import load_scorer, resolve_model
        from treejax.scorers.refiner import Refiner, check_tokenizer, load_refiner

        if self.prm is None:
            prm_cfg, ref_cfg, policy = self.stage.prm, self.stage.refiner, self.ctx.cfg.model
            self.prm = load_scorer(prm_cfg, policy)
            same = (resolve_model(prm_cfg, policy), prm_cfg.compute_dtype) == (
                resolve_model(ref_cfg, policy), ref_cfg.compute_dtype) and prm_cfg.sharding == "device"
            self.refiner = (Refiner(ref_cfg, self.prm.model_config, self.prm.params, self.prm.tokenizer) if same
                            else load_refiner(ref_cfg, policy))  # one copy of the weights when both are one model
            check_tokenizer(self.refiner, self.ctx.tokenizer)

    def is_newline(self, token: int) -> bool:
        if token not in self._newline:
            self._newline[token] = "\n" in self.ctx.tokenizer.decode([token])
        return self._newline[token]

    def locate(self, host, correct_PxW, questions) -> tuple[list[_Rewrite], dict]:
        """The failed leaves' first wrong steps and the ones chosen for a rewrite (module docstring, 1-3)."""
        from treejax.scorers.prm import step_scores

        tok, stage = self.ctx.tokenizer, self.stage
        tokens, lengths, mask = host
        failed = np.argwhere(~np.asarray(correct_PxW, bool) & (np.asarray(mask).sum(-1) > 0))
        decode = lambda p, w, a, b: tok.decode(tokens[p, w, a:b].tolist(), skip_special_tokens=True)  # noqa: E731
        leaves = []
        for p, w in failed:
            blank = lambda a, b, p=p, w=w: not decode(p, w, a, b).strip()  # noqa: E731
            spans = token_steps(tokens[p, w], lengths[p, w], stage.steps, self.ctx.cfg.rollout.segment_length,
                                self.is_newline, blank)
            leaves.append((int(p), int(w), spans, [decode(p, w, a, b) for a, b in spans]))
        metrics = {"scope/failed": len(leaves), "scope/located": 0}
        if not leaves:
            return [], metrics
        self._load()
        scores = step_scores(self.prm, [questions[p] for p, _, _, _ in leaves], [t for *_, t in leaves])
        firsts = [first_wrong_step(s[: len(sp)], stage.threshold) for s, (_, _, sp, _) in zip(scores, leaves)]
        cands = [(p, w, sp[k][0]) for (p, w, sp, _), k in zip(leaves, firsts) if k >= 0]
        chosen = set(choose_rewrites(cands, stage.rewrites_per_prompt))
        out = [_Rewrite(p, w, sp, k, "".join(texts[:k]), texts[k])
               for (p, w, sp, texts), k in zip(leaves, firsts) if (p, w) in chosen]
        metrics.update({"scope/located": len(cands),
                        "scope/first_step_mean": float(np.mean([r.k for r in out])) if out else 0.0})
        return out, metrics

    def continue_rows(self, params, prompts, lens, heads, key):
        """The policy's continuations after ``prompt + head`` for each row (module docstring, 5): ``(tokens,
        logprobs, lengths, stopped)`` host arrays, and ``log pi_sampler`` of every head token (teacher forcing)."""
        from treejax.data.prompts import pad_token_lists
        from treejax.sampling import probe as probe_lib
        from treejax.sampling.decode import bucket_length, generate, resolve_stop_ids, score_tokens

        cfg, fns = self.ctx.cfg, self.ctx.sampler_fns
        T = cfg.rollout.max_length
        weights, _ = probe_lib.detach(params)
        ctx_ids = [list(np.asarray(prompts[i])[: lens[i]]) + list(h) for i, h in enumerate(heads)]
        width = bucket_length(max(len(c) for c in ctx_ids))
        cp, cl = pad_token_lists(ctx_ids, width, self.ctx.pad_id)
        room = max(1, T - min(len(h) for h in heads))
        stop_ids = resolve_stop_ids(cfg.rollout.stop_ids, fns)
        out = generate(weights, fns, cp, cl, key, room, cfg.rollout.strategy, stop_ids=stop_ids)
        toks, lps, ns = (np.asarray(x) for x in jax.device_get((out.tokens, out.logprobs, out.lengths)))
        hp = np.zeros((len(heads), T), np.int32)
        hn = np.array([len(h) for h in heads], np.int32)
        for i, h in enumerate(heads):
            hp[i, : len(h)] = h
        head_logp = np.asarray(score_tokens(weights, fns, np.asarray(prompts), np.asarray(lens), hp, hn))
        stopped = np.array([ns[i] > 0 and int(toks[i, ns[i] - 1]) in stop_ids for i in range(len(heads))])
        return toks, lps, ns, stopped, head_logp

    def rewrite(self, params, ro, chosen: list[_Rewrite], key, questions):
        """The chosen leaves rewritten and continued (module docstring, 4-6): per row ``(tokens [T], logprobs [T],
        refined [T], length, stopped)`` and the mean ``log pi_sampler - log q`` on the refined tokens."""
        from treejax.scorers.refiner import refine, refiner_context

        T = self.ctx.cfg.rollout.max_length
        tokens, logprobs = (np.asarray(x) for x in jax.device_get((ro.forest.tokens, ro.forest.logprobs)))
        contexts = [refiner_context(self.refiner, questions[r.p], r.prefix, r.step) for r in chosen]
        spans = refine(self.refiner, contexts, jax.random.fold_in(key, 0x5C0))
        starts = [r.steps[r.k][0] for r in chosen]
        kept = [min(int(n), T - a) for n, a in zip(spans.lengths_N, starts)]  # a span never passes the row's end
        heads = [list(tokens[r.p, r.w, :a]) + list(spans.tokens_NxK[i, :m])
                 for i, (r, a, m) in enumerate(zip(chosen, starts, kept))]
        prompts = np.asarray(ro.prompts_PxLp)[[r.p for r in chosen]]
        lens = np.asarray(ro.lengths_P)[[r.p for r in chosen]]
        ct, cl, cn, stopped, head_logp = self.continue_rows(params, prompts, lens, heads,
                                                            jax.random.fold_in(key, 0x5C1))
        rows, ratios = [], []
        for i, (r, a, m) in enumerate(zip(chosen, starts, kept)):
            room = T - a - m
            row = assemble_row(tokens[r.p, r.w, :a], logprobs[r.p, r.w, :a], spans.tokens_NxK[i, :m],
                               spans.logprobs_NxK[i, :m], ct[i, : min(cn[i], room)], cl[i, : min(cn[i], room)], T)
            rows.append(row + (bool(stopped[i]) and room > 0 and cn[i] <= room,))
            ratios += list(head_logp[i, a:a + m] - spans.logprobs_NxK[i, :m])
        return rows, spans, float(np.mean(ratios)) if ratios else 0.0

    def sample(self, params, key, step):
        ro = self.base.sample(params, key, step)
        t0 = time.perf_counter()
        f = ro.forest
        host = tuple(np.asarray(x) for x in jax.device_get((f.tokens, f.leaf_length, f.loss_mask)))
        questions, _ = example_fields(ro.examples, ro.prompts_PxLp, ro.lengths_P, self.ctx.tokenizer)
        chosen, metrics = self.locate(host, ro.correct_PxW, questions)
        metrics.update({"scope/rewritten": len(chosen), "scope/salvaged": 0, "scope/refined_tokens": 0})
        ro.refined_PxWxT = np.zeros(f.tokens.shape, np.float32)
        if chosen:
            rows, spans, ratio = self.rewrite(params, ro, chosen, jax.random.fold_in(key, 0x5C09E), questions)
            metrics.update(write_rows(ro, chosen, rows, self.ctx, self.stage.correction))
            refined = ro.refined_PxWxT.astype(bool)
            metrics.update({"scope/refiner_logp_mean": float(np.asarray(ro.forest.logprobs)[refined].mean())
                            if refined.any() else 0.0, "scope/log_ratio_mean": ratio})
        ro.extra_metrics = {**(ro.extra_metrics or {}), **metrics, "time/scope_s": time.perf_counter() - t0}
        return ro


def write_rows(ro, chosen, rows, ctx, correction: str) -> dict:
    """The rewritten rows written over their leaves in ``ro`` (tokens, log-probs, loss mask, lengths, statuses,
    segments, rewards; ``ro.refined_PxWxT`` marks the refiner's tokens; ``correction = "mask"``: out of the
    loss); returns ``scope/salvaged`` and ``scope/refined_tokens``."""
    from treejax.forest import NodeStatus
    from treejax.rl import scoring

    cfg, f = ctx.cfg, ro.forest
    tokens, logprobs, mask, lengths, status, seg = (np.array(x) for x in jax.device_get(
        (f.tokens, f.logprobs, f.loss_mask, f.leaf_length, f.leaf_status, f.segment_index)))
    rewards = np.array(jax.device_get(ro.rewards_PxW), np.float32)
    texts = [ctx.tokenizer.decode(tok[:n].tolist(), skip_special_tokens=True) for tok, _, _, n, _ in rows]
    scores = np.array([ctx.task.score(x, ro.examples[r.p]) for x, r in zip(texts, chosen)], np.float32)
    new_len = np.array([n for *_, n, _ in rows], np.int32)
    shaped = scoring.shaped_rewards(scores[None], new_len[None], cfg.reward_style, cfg.rollout.max_length,
                                    cfg.overlong_buffer, cfg.overlong_factor)[0]
    T, depth, S = tokens.shape[-1], f.leaf_path.shape[-1] - 1, f.segment_length
    t = np.arange(T)
    for i, (r, (tok, lp, refined, n, stopped)) in enumerate(zip(chosen, rows)):
        on = (t < n).astype(mask.dtype)
        tokens[r.p, r.w], logprobs[r.p, r.w], lengths[r.p, r.w] = tok, lp, n
        mask[r.p, r.w] = on * (1.0 - refined) if correction == "mask" else on
        seg[r.p, r.w] = np.where(t < n, np.minimum(t // S, depth - 1), 0).astype(seg.dtype)
        status[r.p, r.w] = int(NodeStatus.EOS if stopped else NodeStatus.TRUNCATED)
        rewards[r.p, r.w] = shaped[i]
        ro.refined_PxWxT[r.p, r.w] = refined
    ro.forest = f.replace(tokens=jnp.asarray(tokens), logprobs=jnp.asarray(logprobs), loss_mask=jnp.asarray(mask),
                          leaf_length=jnp.asarray(lengths), leaf_status=jnp.asarray(status),
                          segment_index=jnp.asarray(seg))
    ro.rewards_PxW = jnp.asarray(rewards)
    return {"scope/salvaged": int((scores >= 1.0).sum()), "scope/refined_tokens": int(ro.refined_PxWxT.sum())}


__all__ = ["SCOPEConfig", "SCOPERollouts", "assemble_row", "choose_rewrites", "first_wrong_step", "token_steps",
           "write_rows"]
