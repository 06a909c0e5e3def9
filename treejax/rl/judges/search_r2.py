"""Search-R2: a meta-refiner cuts a search agent's episode at its first flawed turn and regenerates it from there;
an evidence-density term joins the outcome reward.

He et al. 2026, *Search-R2: Enhancing Search-Integrated Reasoning via Actor-Refiner Collaboration*, arXiv
2602.03647 (read from the paper, sections 3-4 and Appendices E, K, L; no official code found). The paper: an Actor
writes search-integrated trajectories; a **Meta-Refiner** with a **Discriminator** (accepts the trajectory when
its verdict clears a threshold; Appendix E: a revision is triggered when its log-probability beats the
no-revision decision, margin 0) and a **Trimmer** (samples the cut point, the earliest flawed step; a step is an
assistant turn with its tool output) cuts every flagged trajectory, keeps the prefix, and the **Actor** itself
regenerates the whole suffix; at most one revision per rollout; the group of G trajectories is drawn from this
mixture and advantages are group-normalised; the reward is ``R = r_outcome (1 + r_process)`` with a 0/1 outcome
and ``r_process`` the share of search calls whose results are useful and new (Appendix K; an external judge that
sees the gold answer; :mod:`treejax.rl.judges.evidence`). The Meta-Refiner shares the Actor's weights (steered by
prompts) and its decision tokens are trained with the trajectory's advantage ("jointly optimized"). On treejax's
parts, a wrapper stage after the multi-turn planner's independent episodes (``[@MultiTurnConfig(),
@SearchR2Config()]``, e.g. the retrieval world's BM25 searches), every step::

    turns       tau_1 .. tau_K: an episode's turn nodes, each the policy's text then its observation
    select      the episodes the meta-refiner reads: the verifier's failures (select = "failed") or all ("all")
    discriminate  d = judge(question, episode text) in [0, 1] (ScorerConfig, verdict tokens);
                flawed iff d < discriminator_threshold (NaN: not flawed; discriminator = False: every selected one)
    trim        s_k = PRM(question, tau_1 .. tau_k) (prm.step_scores over the turns),
                k* = min { k : s_k < threshold }    (none below: argmin_k s_k with always_cut, else left alone)
    choose      per prompt up to refines_per_prompt flawed episodes, the longest kept prefix first (SCOPE's rule);
                refines_per_prompt = None: every flagged episode (once)
    cut         y_<a, a = the first token of turn k*; the environment replayed through turns 1 .. k* - 1
                (deterministic worlds: a replay reaches the same state, ``clone()``'s contract)
    regenerate  "refiner": z ~ q(. | template(question, y_<a, turn k*'s action)) (RefinerConfig), cut after the
                world's first stop string (``</search>``), with its behaviour log-probs log q(z_t); the world steps
                z; the policy continues the episode, c ~ pi_sampler(. | x, y_<a, z, o_z) with the world, for the
                turns left (run_turn_trees on the resumed world)
                "policy": the policy regenerates from the cut itself, c ~ pi_sampler(. | x, y_<a) (an on-policy
                fork of the episode at turn k*: no off-policy tokens)
    row         y' = y_<a . z . o_z . c replaces the flawed episode in its slot (the group keeps W episodes: the
                mixture of the actor's and the refined trajectories); its reward is the verifier's score of y'
                shaped like the planner's; observations stay out of the loss
    correction  on z: correction = "is" trains it with the loss's truncated IS, w_t = min(pi_prox(z_t) / q(z_t), C)
                (RunConfig.old_logp = 'trainer', LossConfig.tis_cap = C), as SCOPE's and replayed rows;
                "mask" keeps z out of the loss
    reward      R' = R + density_coef * rho * g (the evidence-density term on every slot, refined or not;
                g = 1[correct] with gate = "correct"; with R in {0, 1} and density_coef = 1: R (1 + rho))

**As the paper** in the shipped config (``configs/multiturn_retrieval_search_r2.gin``): every episode read (``select
= "all"``, no ground truth) with the paper's prompt for the earliest flawed step's index (``meta = "index"``: ``l_k
= log p("k")`` for ``k = 0 .. K``, flagged iff ``max_{k >= 1} l_k > l_0``, a margin of 0, cut at that step), a step
a whole turn with its observation, the Actor regenerating the suffix on-policy (``regenerate = "policy"``), at most
one revision per rollout (``refines_per_prompt = None``: no per-group cap), the refined episode in the original's
slot of the group, ``R = r_outcome (1 + rho)`` (``reward_style = "01"``, ``density = "collections"``, ``density_coef
= 1``, gated on correctness). **Not the paper's**: the Meta-Refiner reads with the policy's current weights
(``shared_weights``) but greedily and untrained (the paper's samples the cut and is trained with the trajectory's
advantage); ``meta = "judge_prm"`` reads it two ways instead (a Yes/No verdict on the whole episode, then a PRM over
its turns, the cut at the first turn below ``threshold``, or the lowest with ``always_cut``); a collection's
usefulness is an exact rule from the problem's ground truth (its evidence pages, or the gold answer in the text)
where the paper asks a 7B judge shown the gold answer. Options beyond the paper, kept from this module's first
reconstruction: ``regenerate = "refiner"`` (a second model rewrites the cut turn, its tokens trained with truncated
IS or masked), ``select = "failed"`` (only the verifier's failures: uses the gold answer), a per-group cap
``refines_per_prompt`` (the longest kept prefix first), ``always_cut = False``, and ``density = "documents"``
(documents the later turns reuse, no ground truth). The verifier's ``scores_PxW`` keep the actor's own episodes
(``reward/accuracy`` measures the policy); ``reward_scores_PxW`` carry the refined rows' scores. Metrics:
``search_r2/selected``, ``flagged``, ``located``, ``refined``, ``salvaged`` (refined rows the verifier accepts),
``first_turn_mean``, ``refined_tokens``, ``refiner_logp_mean``, ``density_mean``, ``density_bonus_mean``,
``chunks_mean`` (retrieved documents per slot), ``time/search_r2_s``. The planner's dynamic sampling would drop all-wrong groups first; the
shipped config (``configs/multiturn_retrieval_search_r2.gin``) turns it off.
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
from treejax.rl.judges.evidence import DEFAULT_EVIDENCE_PATTERN, DENSITIES, GATES, USEFUL
from treejax.rl.judges.scope import CORRECTIONS, choose_rewrites, first_wrong_step
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import EXPANDED, OFF_POLICY, VERIFIER
from treejax.scorers.config import ScorerConfig
from treejax.scorers.refiner import RefinerConfig

SELECT = ("failed", "all")
REGENERATE = ("refiner", "policy")
META = ("judge_prm", "index")
MAX_INDEX = 9  # meta = "index": choices "0" .. "9", one token each
#: the Meta-Refiner's one prompt in ``meta = "index"`` (``{question}``, ``{steps}``: the numbered turns with their
#: observations, ``{max_steps}``); the reply's first token is read as the index of the earliest flawed step
DEFAULT_INDEX_TEMPLATE = (
    "Here is a question and a search agent's attempt at it, step by step: each step is the agent's text and the "
    "documents its search returned.\n\nQuestion: {question}\n\n{steps}\n\nIdentify the earliest flawed step. "
    "Reply with a single integer between 0 and {max_steps}, where 0 means all steps are acceptable.")
#: the refiner's user turn for a search agent's flawed turn (``{question}``, ``{prefix}``: the turns before it with
#: their observations, ``{step}``: the flawed turn's action)
DEFAULT_SEARCH_REFINE_TEMPLATE = (
    "Here is a question and the start of a search agent's attempt at it.\n\nQuestion: {question}\n\n"
    "Attempt so far:\n{prefix}\n\nThis next step is flawed:\n{step}\n\nWrite a better next step instead: one short "
    "thought, then either one <search>query</search> call or the final answer as 'Answer: <answer>'.")


@dataclasses.dataclass(frozen=True)
class SearchR2Config(Stage):
    """Search-R2's meta-refiner and evidence-density reward (module docstring). gin::

        RunConfig.rollouts = [@MultiTurnConfig(), @SearchR2Config()]
        SearchR2Config.scorer = @ScorerConfig()      # the Discriminator (judge) and the Trimmer (PRM over turns)

    ``meta``: ``"index"`` (one prompt, ``index_template``, for the earliest flawed step's index, read as the
    next-token log-probs of ``"0" .. "K"``) or ``"judge_prm"`` (a judge verdict, then a PRM over the turns);
    ``shared_weights``: the Meta-Refiner reads with the policy's current sampler weights (the paper's shared LLM;
    ``ScorerConfig.model = "policy"``), else with the scorer's own frozen weights;
    ``refiner``: the model that rewrites the cut turn (``regenerate = "refiner"``); ``discriminator``: judge the
    whole episode first (``discriminator_threshold``); ``threshold``: a turn is flawed iff its PRM score is below
    it; ``always_cut``: a flagged episode without a turn below it is cut at its lowest-scored turn (the paper cuts
    every flagged trajectory), else left alone (these three: ``judge_prm``); ``select``: ``"failed"`` or ``"all"``
    episodes; ``refines_per_prompt`` (``None``: no cap, every flagged episode once); ``regenerate``:
    ``"refiner"`` or ``"policy"``; ``correction``: ``"is"`` or ``"mask"`` (the refiner's tokens); the
    evidence-density term (:mod:`treejax.rl.judges.evidence`; ``density_coef = 0``: reported, not added):
    ``density`` (``"collections"``: useful new search results per search call, the paper's; ``"documents"``:
    retrieved documents the later turns use), ``useful`` (collections: ``"evidence"`` pages or the gold
    ``"answer"``), ``density_coef``, ``gate``, ``evidence_pattern`` (one group: a retrieved document's text),
    ``min_overlap`` (documents)."""

    scorer: ScorerConfig = dataclasses.field(default_factory=ScorerConfig)
    refiner: RefinerConfig = dataclasses.field(default_factory=lambda: RefinerConfig(
        template=DEFAULT_SEARCH_REFINE_TEMPLATE, max_new_tokens=64, stop_at_newline=False))
    meta: str = "judge_prm"
    index_template: str = DEFAULT_INDEX_TEMPLATE
    shared_weights: bool = False
    discriminator: bool = True
    discriminator_threshold: float = 0.5
    threshold: float = 0.5
    always_cut: bool = False
    select: str = "failed"
    refines_per_prompt: int | None = 2
    regenerate: str = "refiner"
    correction: str = "is"
    density: str = "documents"
    useful: str = "evidence"
    density_coef: float = 0.2
    gate: str = "correct"
    evidence_pattern: str = DEFAULT_EVIDENCE_PATTERN
    min_overlap: int = 1

    role: ClassVar[str] = "wrapper"  # cuts and regenerates episodes of the multi-turn chain before it
    requires: ClassVar[tuple] = (VERIFIER, EXPANDED)
    needs: ClassVar[frozenset[str]] = frozenset({"turn_forest"})
    keeps: ClassVar[frozenset[str]] = frozenset()  # its rows are not checked with replay or the shape search
    passes_inputs: ClassVar[bool] = False  # inputs computed from the planner's episodes would not see the cuts

    def __post_init__(self):
        self.check_types()
        for name in ("discriminator_threshold", "threshold"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ConfigError(f"SearchR2Config.{name} must be in (0, 1), got {getattr(self, name)}; fix: "
                                  f"SearchR2Config.{name} = 0.5")
        for name, allowed in (("select", SELECT), ("regenerate", REGENERATE), ("correction", CORRECTIONS),
                              ("gate", GATES), ("density", DENSITIES), ("useful", USEFUL), ("meta", META)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"SearchR2Config.{name} must be one of {allowed}, got {getattr(self, name)!r}; "
                                  f"fix: SearchR2Config.{name} = {allowed[0]!r}")
        if (self.refines_per_prompt is not None and self.refines_per_prompt < 1) or self.min_overlap < 1:
            raise ConfigError(f"SearchR2Config: refines_per_prompt >= 1 and min_overlap >= 1 required, got "
                              f"{self.refines_per_prompt}, {self.min_overlap}; fix: SearchR2Config.refines_per_prompt "
                              "= 2, SearchR2Config.min_overlap = 1")
        if not 0.0 <= self.density_coef <= 1.0:
            raise ConfigError(f"SearchR2Config.density_coef must be in [0, 1] (above 1 a wrong answer could outrank a "
                              f"right one), got {self.density_coef}; fix: SearchR2Config.density_coef = 0.2")
        if self.shared_weights and (self.scorer.model != "policy" or self.scorer.sharding != "device"):
            raise ConfigError("SearchR2Config.shared_weights reads the Meta-Refiner with the policy's own current "
                              f"weights, so its scorer must be the policy (ScorerConfig.model = 'policy', got "
                              f"{self.scorer.model!r}) with sharding 'device' (got {self.scorer.sharding!r}); fix: "
                              "ScorerConfig.model = 'policy', or SearchR2Config.shared_weights = False")
        if self.meta == "index":
            missing = [f for f in ("{question}", "{steps}", "{max_steps}") if f not in self.index_template]
            if missing or not self.discriminator:
                raise ConfigError(f"SearchR2Config.meta = 'index' reads one prompt for the flag and the cut: its "
                                  f"index_template needs {{question}}, {{steps}} and {{max_steps}} (missing "
                                  f"{missing}) and discriminator = True; fix: SearchR2Config.index_template = "
                                  "DEFAULT_INDEX_TEMPLATE's fields, SearchR2Config.discriminator = True")
        self.check_pattern()

    def check_types(self) -> None:
        for name, cls in (("scorer", ScorerConfig), ("refiner", RefinerConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"SearchR2Config.{name} must be a {cls.__name__}, got {getattr(self, name)!r}; "
                                  f"fix: SearchR2Config.{name} = @{cls.__name__}()")

    def check_pattern(self) -> None:
        import re

        try:
            groups = re.compile(self.evidence_pattern).groups
        except re.error as e:
            groups, why = -1, str(e)
        if groups != 1:
            why = locals().get("why", f"{groups} groups")
            raise ConfigError(f"SearchR2Config.evidence_pattern must be a regex with one group (a document's text), "
                              f"got {self.evidence_pattern!r} ({why}); fix: see treejax.rl.judges.evidence."
                              "DEFAULT_EVIDENCE_PATTERN")

    def check(self, facts) -> None:
        if self.refines_per_prompt is not None and self.refines_per_prompt > facts.tree.num_leaves:
            raise ConfigError(f"SearchR2Config.refines_per_prompt = {self.refines_per_prompt} exceeds the "
                              f"{facts.tree.num_leaves} episodes of a group; fix: SearchR2Config.refines_per_prompt "
                              "= None (no cap) or <= TreeConfig.num_leaves")
        if self.regenerate == "refiner" and self.correction == "is" and not OFF_POLICY.holds(facts):
            raise ConfigError(OFF_POLICY.message(f"{self.stage_name} (correction = 'is')", facts)
                              + " (or SearchR2Config.correction = 'mask', or SearchR2Config.regenerate = 'policy')")

    def build(self, inner, ctx):
        roots, W = getattr(getattr(inner, "config", None), "roots", None), ctx.cfg.rollout.num_leaves
        turns = getattr(getattr(inner, "config", None), "max_turns", 0)
        if self.meta == "index" and turns > MAX_INDEX:
            raise ConfigError(f"SearchR2Config.meta = 'index' reads the flawed step's index as one digit token, and "
                              f"MultiTurnConfig.max_turns = {turns} allows more than {MAX_INDEX} steps; fix: "
                              f"MultiTurnConfig.max_turns <= {MAX_INDEX} (or SearchR2Config.meta = 'judge_prm')")
        if roots is not None and roots != W:
            raise ConfigError(f"SearchR2Config rewrites one slot's whole episode, which needs independent episodes "
                              f"(MultiTurnConfig.roots = {roots}, {W} slots); fix: MultiTurnConfig.roots = None")
        if not hasattr(inner, "make_env"):
            raise ConfigError("SearchR2Config regenerates episodes with the world of a multi-turn source; fix: "
                              "RunConfig.rollouts = [@MultiTurnConfig(), @SearchR2Config()]")
        return SearchR2Rollouts(inner, self, ctx)


def cut_turn(scores_S, threshold: float, always: bool) -> int:
    """The Trimmer's cut: the first turn scored below ``threshold``; with ``always``, the lowest-scored turn when
    none is (ties: the earliest); ``-1``: no cut (no finite score, or none below and not ``always``)."""
    k = first_wrong_step(scores_S, threshold)
    s = np.asarray(scores_S, np.float64)
    if k >= 0 or not always or not np.isfinite(s).any():
        return k
    return int(np.nanargmin(np.where(np.isfinite(s), s, np.nan)))


def index_cuts(logp_NxC, steps_N) -> list[int]:
    """The cut turn (0-based) of each episode from the Meta-Refiner's choice log-probs ``[N, C]`` over ``"0" ..
    "C-1"``: with ``K = steps_N[n]`` steps, ``k* = argmax_{1 <= k <= K} logp[n, k]`` (ties: the earliest); flagged
    (cut at turn ``k* - 1``) iff ``logp[n, k*] > logp[n, 0]``, else ``-1``."""
    out = []
    for row, K in zip(np.asarray(logp_NxC, np.float64), steps_N):
        if K < 1:
            out.append(-1)
            continue
        k = 1 + int(np.argmax(row[1:K + 1]))
        out.append(k - 1 if row[k] > row[0] else -1)
    return out


class ResumedEnv:
    """An environment already stepped through an episode's kept turns: ``reset`` leaves its state alone (no
    observation), everything else is the wrapped world's."""

    def __init__(self, env):
        self.env = env

    def reset(self, example) -> str:
        return ""

    def step(self, action: str):
        return self.env.step(action)

    def clone(self) -> "ResumedEnv":
        return ResumedEnv(self.env.clone())

    def __getattr__(self, name):
        return getattr(self.env, name)


@dataclasses.dataclass
class Turn:
    """One turn node of a slot's episode: response tokens ``[start, end)``, its action and observation texts."""

    start: int
    end: int
    action: str
    observation: str


def slot_turns(host, tokenizer, p: int, w: int) -> list[Turn]:
    """Slot ``(p, w)``'s turn nodes in order (the host turn forest ``host``), each split into the policy's text
    and the observation's (``policy_tokens``)."""
    path = np.asarray(host.leaf_path)[p, w, 1:]
    spans, toks = np.asarray(host.spans())[p], np.asarray(host.tokens)[p, w]
    pm = np.asarray(host.policy_tokens())[p, w] > 0
    out = []
    for n in path[path >= 0]:
        a, b = int(spans[n, 0]), int(spans[n, 0] + spans[n, 1])
        t, m = toks[a:b], pm[a:b]
        out.append(Turn(a, b, tokenizer.decode(t[m].tolist(), skip_special_tokens=True),
                        tokenizer.decode(t[~m].tolist(), skip_special_tokens=True)))
    return out


def cut_at_stop(tokens, logprobs, decode, stop_strings) -> tuple[np.ndarray, np.ndarray]:
    """A refiner's span kept through the first token whose text so far holds one of ``stop_strings`` (the whole
    span when none does): a cut by a rule of the decoded tokens, so every kept ``log q`` stays exact."""
    tokens, logprobs = np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32)
    if stop_strings and any(s in decode(tokens.tolist()) for s in stop_strings):
        for i in range(len(tokens)):
            if any(s in decode(tokens[: i + 1].tolist()) for s in stop_strings):
                return tokens[: i + 1], logprobs[: i + 1]
    return tokens, logprobs


def node_lengths(episode) -> list[int]:
    """The turn-node lengths of a sampled :class:`~treejax.sampling.turns.state.Episode`: a policy span opens a
    node, the observation after it joins it (one before the first policy span joins the first node)."""
    out, lead = [], 0
    for a, b, kind in episode.turns:
        if kind == "policy":
            out.append(b - a + (lead if not out else 0))
        elif out:
            out[-1] += b - a
        else:
            lead += b - a
    return out


def step_score(result) -> float:
    """An environment step's score as :func:`treejax.rl.multiturn.episode_score` reads the last turn."""
    info = result.info or {}
    if "episode_score" in info:
        return float(info["episode_score"])
    if "answered" in info:
        return float(result.reward) if info["answered"] else 0.0
    return float(np.clip(result.reward, 0.0, 1.0))


def clean_calls(infos) -> int:
    """Tool calls among ``infos`` that ran cleanly (``Rollouts.tool_calls_PxW``)."""
    return sum(1 for i in infos if "tool_seconds" in i and not i.get("tool_error"))


@dataclasses.dataclass
class Cut:
    """One chosen flawed episode ``(p, w)``: its turns, the first flawed turn ``k``, the replayed world after turns
    ``< k`` and the infos of those turns."""

    p: int
    w: int
    turns: list
    k: int
    env: object = None
    infos: list = dataclasses.field(default_factory=list)

    @property
    def a(self) -> int:
        return self.turns[self.k].start


@dataclasses.dataclass
class Regenerated:
    """A cut episode after regeneration: the head written at the cut (``z`` and its observation ``obs``; empty
    with ``regenerate = "policy"``) and where the episode stands (``done``, ``score``, ``status``, ``infos``)."""

    z: np.ndarray
    logq: np.ndarray
    obs: list
    done: bool
    score: float
    status: int
    infos: list


class SearchR2Rollouts(BaseStateOnly):
    """The runtime wrapper (module docstring). ``base``: the multi-turn source before it (its ``make_env``,
    ``config``, ``tree_config`` and ``observation_format``). The scorer and the refiner load on the first step
    with a selected episode."""

    def __init__(self, base, stage: SearchR2Config, ctx):
        self.base, self.stage, self.ctx = base, stage, ctx
        self.pipeline = getattr(base, "pipeline", None)
        self.estimator_inputs = ()
        self.scorer = self.refiner = None

    def _load(self):
        from treejax.scorers.model import load_scorer, resolve_model
        from treejax.scorers.refiner import Refiner, check_tokenizer, load_refiner

        sc, rc, policy = self.stage.scorer, self.stage.refiner, self.ctx.cfg.model
        if self.scorer is None:  # shared_weights: share() has set it
            self.scorer = load_scorer(sc, policy, getattr(self.ctx, "mesh", None))
        if self.stage.regenerate == "refiner" and self.refiner is None:
            same = not self.stage.shared_weights and sc.sharding == "device" and (
                resolve_model(sc, policy), sc.compute_dtype) == (resolve_model(rc, policy), rc.compute_dtype)
            self.refiner = (Refiner(rc, self.scorer.model_config, self.scorer.params, self.scorer.tokenizer)
                            if same else load_refiner(rc, policy))  # one copy of the weights when both are one
            check_tokenizer(self.refiner, self.ctx.tokenizer)

    def share(self, params) -> None:
        """``shared_weights``: the scorer this step is the policy itself, its model config, tokenizer and sampler
        weights ``params`` (nothing loaded; the policy's precision, not ``ScorerConfig.compute_dtype``)."""
        from treejax.scorers.model import from_params

        if self.stage.shared_weights:
            self.scorer = from_params(self.stage.scorer, self.ctx.model_config, params, self.ctx.tokenizer)

    def locate(self, ro, turns_PxW, questions, answers) -> tuple[list[Cut], dict]:
        """The Discriminator's flawed episodes, the Trimmer's first flawed turns and the ones chosen (module
        docstring: select, discriminate, trim, choose)."""
        from treejax.scorers.judge import judge_scores
        from treejax.scorers.prm import step_scores

        stage = self.stage
        scores = np.asarray(ro.scores_PxW if ro.reward_scores_PxW is None else ro.reward_scores_PxW)
        pick = np.ones(scores.shape, bool) if stage.select == "all" else scores < 1.0
        sel = [(p, w) for p, w in np.argwhere(pick) if turns_PxW[p][w]]
        metrics = {"search_r2/selected": len(sel), "search_r2/flagged": 0, "search_r2/located": 0}
        if not sel:
            return [], metrics
        self._load()
        if stage.meta == "index":
            return self.locate_by_index(sel, turns_PxW, questions, metrics)
        if stage.discriminator:
            texts = ["".join(t.action + t.observation for t in turns_PxW[p][w]) for p, w in sel]
            d = judge_scores(self.scorer, [questions[p] for p, _ in sel], texts, [answers[p] for p, _ in sel])
            with np.errstate(invalid="ignore"):
                sel = [pw for pw, x in zip(sel, np.asarray(d)) if np.isfinite(x) and x < stage.discriminator_threshold]
        metrics["search_r2/flagged"] = len(sel)
        if not sel:
            return [], metrics
        steps = [[t.action + t.observation for t in turns_PxW[p][w]] for p, w in sel]
        s = step_scores(self.scorer, [questions[p] for p, _ in sel], steps)
        firsts = [cut_turn(row[: len(st)], stage.threshold, stage.always_cut) for row, st in zip(s, steps)]
        return self.choose(sel, firsts, turns_PxW, metrics)

    def choose(self, sel, ks, turns_PxW, metrics) -> tuple[list[Cut], dict]:
        """The cuts of the selected episodes ``sel`` at turns ``ks`` (``-1``: none), per prompt at most
        ``refines_per_prompt`` (None: all), the longest kept prefix first; ``located`` and ``first_turn_mean``."""
        cands = [(int(p), int(w), turns_PxW[p][w][k].start) for (p, w), k in zip(sel, ks) if k >= 0]
        cap = self.stage.refines_per_prompt
        chosen = set(choose_rewrites(cands, len(cands) if cap is None else cap))
        cuts = [Cut(int(p), int(w), turns_PxW[p][w], k) for (p, w), k in zip(sel, ks) if (p, w) in chosen]
        metrics.update({"search_r2/located": len(cands),
                        "search_r2/first_turn_mean": float(np.mean([c.k for c in cuts])) if cuts else 0.0})
        return cuts, metrics

    def locate_by_index(self, sel, turns_PxW, questions, metrics) -> tuple[list[Cut], dict]:
        """``meta = "index"`` (the paper's Meta-Refiner prompt, Appendix L): one prompt per selected episode, the
        scorer's next-token log-probs of ``"0" .. "K"`` (K its turns); flagged iff the best ``k >= 1`` beats ``0``
        (a log-prob margin of 0, Appendix E), cut at that step (module docstring)."""
        from treejax.scorers.judge import chat_ids, choice_logprobs

        stage, mx = self.stage, self.scorer.config.max_length
        rows, ks = [], []
        for p, w in sel:
            tt = turns_PxW[p][w][:MAX_INDEX]
            steps = "\n\n".join(f"Step {i}:\n{t.action}{t.observation}".rstrip() for i, t in enumerate(tt, 1))
            text = stage.index_template.format(question=questions[p], steps=steps, max_steps=len(tt))
            rows.append(chat_ids(self.scorer, text)[-mx:])
            ks.append(len(tt))
        cuts = index_cuts(choice_logprobs(self.scorer, rows, tuple(str(i) for i in range(MAX_INDEX + 1))), ks)
        metrics["search_r2/flagged"] = sum(k >= 0 for k in cuts)
        return self.choose(sel, cuts, turns_PxW, metrics)

    def replay(self, cut: Cut, example) -> None:
        """``cut.env``: a fresh world reset on ``example`` and stepped with the kept turns' actions."""
        env = self.base.make_env()
        env.reset(example)
        for t in cut.turns[: cut.k]:
            r = env.step(t.action)
            cut.infos.append(r.info or {})
            if r.done:
                raise ValueError(f"SearchR2: the replayed world ended at a kept turn of slot ({cut.p}, {cut.w}); "
                                 "the environment is not deterministic")
        cut.env = env

    def heads(self, cuts: list[Cut], questions, key) -> list[Regenerated]:
        """The refiner's turn at each cut and the world's answer to it (module docstring: regenerate); with
        ``regenerate = "policy"`` (or an empty span) nothing is written at the cut."""
        from treejax.forest import NodeStatus
        from treejax.scorers.refiner import refine, refiner_context

        tok, T = self.ctx.tokenizer, self.ctx.cfg.rollout.max_length
        fmt = getattr(self.base, "observation_format", None) or (lambda s: s)
        empty = np.zeros(0, np.int32), np.zeros(0, np.float32)
        if self.stage.regenerate == "policy":
            return [Regenerated(*empty, [], False, 0.0, 0, []) for _ in cuts]
        contexts = [refiner_context(self.refiner, questions[c.p], "".join(t.action + t.observation
                                                                         for t in c.turns[: c.k]),
                                    c.turns[c.k].action) for c in cuts]
        spans = refine(self.refiner, contexts, key)
        out = []
        for i, c in enumerate(cuts):
            decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
            z, q = cut_at_stop(spans.tokens_NxK[i, : spans.lengths_N[i]], spans.logprobs_NxK[i, : spans.lengths_N[i]],
                               decode, tuple(getattr(c.env, "stop_strings", ()) or ()))
            if len(z) == 0:
                out.append(Regenerated(*empty, [], False, 0.0, 0, []))
            elif c.a + len(z) + 1 > T:  # the turn does not fit the row: cut, the episode ends unanswered
                out.append(Regenerated(z[: T - c.a], q[: T - c.a], [], True, 0.0, int(NodeStatus.TRUNCATED), []))
            else:
                r = c.env.step(decode(z.tolist()))
                obs = [] if r.done else list(tok.encode(fmt(r.observation))) if r.observation else []
                if not r.done and c.a + len(z) + len(obs) + 1 > T:
                    out.append(Regenerated(z, q, [], True, 0.0, int(NodeStatus.TRUNCATED), [r.info or {}]))
                    continue
                answered = bool((r.info or {}).get("answered"))
                status = int(NodeStatus.FINISHED if answered else NodeStatus.EOS) if r.done else 0
                out.append(Regenerated(z, q, obs, bool(r.done), step_score(r) if r.done else 0.0, status,
                                       [r.info or {}]))
        return out

    def continue_episodes(self, params, ro, host, cuts: list[Cut], heads: list[Regenerated], key) -> list:
        """The policy's continuation of each cut episode not yet ended (``None`` for the others): one
        :func:`~treejax.sampling.turns.run.run_turn_trees` call over them from ``prompt . y_<a . z . o_z`` on the
        resumed worlds, with the longest row's limits; :meth:`assemble` cuts each to its own turns and tokens."""
        from treejax.data.prompts import pad_token_lists
        from treejax.sampling.decode import bucket_length
        from treejax.sampling.turns import TurnLimits, TurnTreeConfig, run_turn_trees

        mt, tc, T = self.base.config, self.base.tree_config, self.ctx.cfg.rollout.max_length
        todo = [i for i, (c, h) in enumerate(zip(cuts, heads))
                if not h.done and self.turns_left(c, h) >= 1 and T - self.used(c, h) >= 2]
        out = [None] * len(cuts)
        if not todo:
            return out
        prompts, lens, tokens = np.asarray(ro.prompts_PxLp), np.asarray(ro.lengths_P), np.asarray(host.tokens)
        ctx_ids = [list(prompts[cuts[i].p, : lens[cuts[i].p]]) + list(tokens[cuts[i].p, cuts[i].w, : cuts[i].a])
                   + list(heads[i].z) + list(heads[i].obs) for i in todo]
        cp, cl = pad_token_lists(ctx_ids, bucket_length(max(len(c) for c in ctx_ids)), self.ctx.pad_id)
        limits = TurnLimits(max_turns=max(self.turns_left(cuts[i], heads[i]) for i in todo), turn_tokens=mt.turn_tokens,
                            max_tokens=max(T - self.used(cuts[i], heads[i]) for i in todo), chunk=mt.chunk)
        envs = [ResumedEnv(cuts[i].env) for i in todo]
        trees = run_turn_trees(params, self.ctx.sampler_fns, self.ctx.tokenizer, lambda b: envs[b],
                               [ro.examples[cuts[i].p] for i in todo], cp, cl, key, tc.strategy, limits,
                               TurnTreeConfig(), stop_ids=tuple(tc.stop_ids or ()),
                               observation_format=getattr(self.base, "observation_format", None))
        for i, tr in zip(todo, trees):
            out[i] = tr.slot_episode[0]
        return out

    def turns_left(self, cut: Cut, head: Regenerated) -> int:
        return self.base.config.max_turns - cut.k - (1 if len(head.z) else 0)

    @staticmethod
    def used(cut: Cut, head: Regenerated) -> int:
        return cut.a + len(head.z) + len(head.obs)

    def assemble(self, host, ro, cut: Cut, head: Regenerated, cont):
        """``(Trajectory, refined [T], score, clean calls)`` of one regenerated episode (module docstring: row):
        the kept turns, the refiner's turn and its observation, the policy's continuation cut to the turns and
        tokens left (a cut continuation ends unanswered: TRUNCATED, score 0)."""
        from treejax.forest import NodeStatus
        from treejax.rl.multiturn import episode_score, episode_status
        from treejax.rl.spear import Trajectory

        T, (p, w, a) = self.ctx.cfg.rollout.max_length, (cut.p, cut.w, cut.a)
        z_pm = 0.0 if self.stage.correction == "mask" else 1.0
        toks = [np.asarray(host.tokens)[p, w, :a], head.z, np.asarray(head.obs, np.int32)]
        lps = [np.asarray(host.logprobs)[p, w, :a], head.logq, np.zeros(len(head.obs), np.float32)]
        pms = [np.asarray(host.policy_tokens())[p, w, :a].astype(np.float32), np.full(len(head.z), z_pm, np.float32),
               np.zeros(len(head.obs), np.float32)]
        nodes = [t.end - t.start for t in cut.turns[: cut.k]] + ([len(head.z) + len(head.obs)] if len(head.z) else [])
        status, score, infos = head.status, head.score, list(cut.infos) + list(head.infos)
        if cont is not None:
            room, left = T - self.used(cut, head), self.turns_left(cut, head)
            lengths = node_lengths(cont)
            keep = min(sum(lengths[:left]), room)
            toks.append(np.asarray(cont.tokens[:keep], np.int32))
            lps.append(np.asarray(cont.logprobs[:keep], np.float32))
            pms.append(np.asarray(cont.policy_mask[:keep], np.float32))
            ends, kept = np.cumsum(lengths), []
            for n, e in zip(lengths, ends):
                if e - n < keep:
                    kept.append(int(min(n, keep - (e - n))))
            nodes += kept
            cut_off = keep < len(cont.tokens) or len(lengths) > left
            status = int(NodeStatus.TRUNCATED) if cut_off else episode_status(cont)
            score = 0.0 if cut_off else episode_score(cont)
            infos += list(cont.infos[: len(kept)])
        elif not head.done:  # no turn or token left for the policy
            status, score = int(NodeStatus.TRUNCATED), 0.0
        tokens, logprobs, pmask = (np.concatenate(x) for x in (toks, lps, pms))
        refined = np.zeros(T, np.float32)
        refined[a:a + len(head.z)] = 1.0
        example = ro.examples[p] if ro.examples is not None else None
        traj = Trajectory(step=0, prompt=np.asarray(ro.prompts_PxLp)[p], prompt_length=int(np.asarray(ro.lengths_P)[p]),
                          node_lengths=np.asarray(nodes, np.int32), tokens=tokens.astype(np.int32),
                          logprobs=logprobs.astype(np.float32), policy_mask=pmask, status=int(status), reward=0.0,
                          score=float(score), example=example)
        return traj, refined, float(score), clean_calls(infos)

    def write(self, ro, host, cuts: list[Cut], rows: list) -> dict:
        """The regenerated episodes written over their slots (their prompts' forest rows rebuilt, RAPO's
        ``episodes_forest`` / ``splice_rows``); rewards (shaped like the planner's), ``reward_scores_PxW``,
        ``tool_calls_PxW`` and ``refined_PxWxT`` updated. Returns the row metrics."""
        from treejax.rl import scoring
        from treejax.rl.rapo import episodes_forest, splice_rows
        from treejax.rl.spear import _trajectory as slot_trajectory

        cfg, W, T = self.ctx.cfg, host.num_leaves, host.max_response_length
        prompts, lens = np.asarray(ro.prompts_PxLp), np.asarray(ro.lengths_P)
        new = {(c.p, c.w): r for c, r in zip(cuts, rows)}
        targets = sorted({c.p for c in cuts})
        built = [[new[(p, w)][0] if (p, w) in new else
                  slot_trajectory(host, prompts[p], int(lens[p]), p, w, 0, 0.0, 0.0, None) for w in range(W)]
                 for p in targets]
        forest = episodes_forest(built, T, host.node_parent.shape[1], host.max_depth).replace(
            segment_length=host.segment_length)
        ro.forest = splice_rows(host.replace(leaf_weight=np.asarray(host.leaf_weights())), forest, targets)
        scores = np.array([r[2] for r in rows], np.float32)
        length = np.array([[len(r[0].tokens) for r in rows]], np.int32)
        shaped = scoring.shaped_rewards(scores[None], length, cfg.reward_style, cfg.rollout.max_length,
                                        cfg.overlong_buffer, cfg.overlong_factor)[0]
        rewards = np.array(jax.device_get(ro.rewards_PxW), np.float32)
        reward_scores = np.array(ro.scores_PxW if ro.reward_scores_PxW is None else ro.reward_scores_PxW, np.float32)
        calls = None if ro.tool_calls_PxW is None else np.array(ro.tool_calls_PxW)
        for i, c in enumerate(cuts):
            rewards[c.p, c.w], reward_scores[c.p, c.w] = shaped[i], scores[i]
            ro.refined_PxWxT[c.p, c.w] = rows[i][1]
            if calls is not None:
                calls[c.p, c.w] = rows[i][3]
        ro.rewards_PxW, ro.reward_scores_PxW, ro.tool_calls_PxW = jnp.asarray(rewards), reward_scores, calls
        refined = ro.refined_PxWxT.astype(bool)
        lp = np.asarray(jax.device_get(ro.forest.logprobs))
        return {"search_r2/salvaged": int((scores >= 1.0).sum()), "search_r2/refined_tokens": int(refined.sum()),
                "search_r2/refiner_logp_mean": float(lp[refined].mean()) if refined.any() else 0.0}

    def density(self, ro) -> dict:
        """The evidence-density term on every slot (:mod:`treejax.rl.judges.evidence`), added to the rewards."""
        from treejax.rl.judges.evidence import (chunk_usage, collection_density, collection_usage, evidence_density,
                                                hybrid_rewards, usage_arrays, useful_document)

        host, st = jax.device_get(ro.forest), self.stage
        P, W = np.asarray(host.tokens).shape[:2]
        turns = [[[(t.action, t.observation) for t in slot_turns(host, self.ctx.tokenizer, p, w)] for w in range(W)]
                 for p in range(P)]
        if st.density == "collections":
            useful = [useful_document(st.useful, ro.examples[p]) for p in range(P)]
            usage = [[(collection_usage(turns[p][w], useful[p], st.evidence_pattern), []) for w in range(W)]
                     for p in range(P)]
            used, _, valid = usage_arrays(usage)
            rho = collection_density(jnp.asarray(used), jnp.asarray(valid))
        else:
            used, doc, valid = usage_arrays([[chunk_usage(t, st.evidence_pattern, st.min_overlap) for t in row]
                                             for row in turns])
            rho = evidence_density(jnp.asarray(used), jnp.asarray(doc), jnp.asarray(valid))
        scores = np.asarray(ro.scores_PxW if ro.reward_scores_PxW is None else ro.reward_scores_PxW)
        before = jnp.asarray(ro.rewards_PxW, jnp.float32)
        ro.rewards_PxW = hybrid_rewards(before, jnp.asarray(scores >= 1.0), rho, st.density_coef, st.gate)
        return {"search_r2/density_mean": float(jnp.mean(rho)), "search_r2/chunks_mean": float(valid.sum(-1).mean()),
                "search_r2/density_bonus_mean": float(jnp.mean(ro.rewards_PxW - before))}

    def sample(self, params, key, step):
        ro = self.base.sample(params, key, step)
        t0 = time.perf_counter()
        host = jax.device_get(ro.forest)
        if host.node_span is None:
            raise ValueError("SearchR2Config cuts the turns of multi-turn episodes; this chain's rows are single-turn "
                             "trees (fix: RunConfig.rollouts = [@MultiTurnConfig(), @SearchR2Config()])")
        P, W = np.asarray(host.tokens).shape[:2]
        turns = [[slot_turns(host, self.ctx.tokenizer, p, w) for w in range(W)] for p in range(P)]
        questions, answers = example_fields(ro.examples, ro.prompts_PxLp, ro.lengths_P, self.ctx.tokenizer)
        self.share(params)
        cuts, metrics = self.locate(ro, turns, questions, answers)
        metrics.update({"search_r2/refined": len(cuts), "search_r2/salvaged": 0, "search_r2/refined_tokens": 0})
        ro.refined_PxWxT = np.zeros(np.asarray(host.tokens).shape, np.float32)
        if cuts:
            for c in cuts:
                self.replay(c, ro.examples[c.p])
            heads = self.heads(cuts, questions, jax.random.fold_in(key, 0x5E2))
            conts = self.continue_episodes(params, ro, host, cuts, heads, jax.random.fold_in(key, 0x5E3))
            rows = [self.assemble(host, ro, c, h, e) for c, h, e in zip(cuts, heads, conts)]
            metrics.update(self.write(ro, host, cuts, rows))
        metrics.update(self.density(ro))
        ro.extra_metrics = {**(ro.extra_metrics or {}), **metrics, "time/search_r2_s": time.perf_counter() - t0}
        return ro


__all__ = ["Cut", "DEFAULT_INDEX_TEMPLATE", "DEFAULT_SEARCH_REFINE_TEMPLATE", "MAX_INDEX", "META", "REGENERATE",
           "Regenerated", "ResumedEnv", "SELECT", "SearchR2Config", "SearchR2Rollouts", "Turn", "clean_calls",
           "cut_at_stop", "cut_turn", "index_cuts", "node_lengths", "slot_turns", "step_score"]
