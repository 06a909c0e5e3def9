"""CoSearch (Zeng et al. 2026, arXiv 2604.17555; official code ``snap-research/CoSearch``; issue 48): the reasoning
policy and a document ranker trained together in the retrieval world. The policy issues sub-queries
(``<search>...</search>``); the ranker orders the BM25 candidates of each sub-query before the policy sees them;
the policy trains on its episodes' verifier scores with any estimator (``configs/multiturn_retrieval_cosearch.gin``:
GRPO), the ranker with GRPO over groups of similar sub-queries (:mod:`treejax.rl.cosearch_core`: the grouping, the
composite reward, the advantage, the Plackett-Luce ranker and its loss).

gin: ``RunConfig.rollouts = [@MultiTurnConfig(), @CoSearchConfig()]`` with ``MultiTurnConfig.environment =
"retrieval"``. Per step:

1. The wrapper installs :class:`RankedSearchEnv` in the multi-turn source (its ``make_env`` seam): a search call
   takes the ``candidates`` best BM25 documents (positive score) of the sub-query, scores them with the ranker
   ``s = theta . phi`` and shows the first ``M = min(top_k, n)`` of a Plackett-Luce sample (Gumbel-top-M, a numpy
   generator seeded from the step's key, stream :data:`RANKER_STREAM`) in that order, ``[rank] title: text`` as the
   plain world. Calculations and every other rule are the retrieval world's (:class:`~treejax.envs.retrieval.
   RetrievalEnv`). Each call is recorded: its question, sub-query, candidate features, order, behaviour log-prob,
   the relevance of its candidates and its mean Hit@k (``hit_cutoffs``).
2. Relevance is the world's evidence signal (reconstructed; the paper's is "the answer string is in the passage"):
   a document is relevant to a question when it is one of the question's evidence pages, the pages its reference
   searches name (``metadata["reference_calls"]``: the company, the founder, the city). A call's evidence flag is
   "some candidate is relevant" (the paper's ``answer_in_docs`` over the top-N candidates).
3. After the episodes end, each call's outcome is the score of its episode (the verifier's score of the answer
   turn; 0 for an episode without one), its reward the composite reward, its cluster the semantic grouping over the
   step's calls, and the ranker takes ``epochs`` Adam steps on GRPO's clipped surrogate (``learning_rate``,
   ``clip_eps``). The ranker is a separate model with its own optimizer, as in the paper; its update runs on the
   host inside the source's ``sample`` (the policy's update is the loop's ``learn``, untouched).

Between steps (and in the held-out evaluation with tools) the ranker shows its greedy order. ``train_ranker =
False`` keeps the initial ranker and its greedy order (the paper's fixed-ranker baseline). The ranker starts as
BM25's order with some exploration: ``theta_0 = init_bm25_weight * e_bm25``.

Reconstructed or changed (the docstring of :mod:`treejax.rl.cosearch_core` lists the formulas): the ranker is a
Plackett-Luce policy over 8 features (the paper's is a second 7B LLM generating a ranking of the top 50 of a dense
retriever), relevance from the evidence pages, 10 candidates and Hit@{1,2,3} for a world that shows 3 documents
(the official 50 candidates, top 5 and Hit@{1,3,5}), no KL to a reference ranker. Taken from the official code:
the grouping rule and threshold, the composite reward and its thresholds, verl's GRPO statistics. Only
independent episodes (``MultiTurnConfig.roots = None``) are built: the official method has no trees of turns.

Metrics (``cosearch/``): ``ranker_calls``, ``clusters``, ``trained_calls`` (calls in clusters of at least
``min_group``), ``cluster_size_mean``, ``evidence_frac``, ``hit_mean``, ``reward_mean``, ``outcome_mean``,
``adv_abs_mean``, ``reordered_frac`` (calls whose shown documents differ from BM25's first ``M`` in order),
``ranker_loss``, ``ranker_grad_norm``, ``ranker_clipped_frac``, ``theta_<feature>``. The ranker's weights and Adam
state are saved in the checkpoint (``"cosearch_state"``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import ClassVar

import jax
import numpy as np

from treejax.checkpoint import decode_blob, encode_blob
from treejax.envs.base import tool_step
from treejax.envs.retrieval import parse_call
from treejax.rl.tool_match import evidence_pages
from treejax.errors import ConfigError
from treejax.rl import cosearch_core as core
from treejax.rl.allocation.base import prompt_key
from treejax.rl.sources.base import Stage, chain_sources
from treejax.rl.sources.requirements import VERIFIER

#: ``fold_in`` stream of the ranker's sampling key (the policy's rollout keeps the step's key).
RANKER_STREAM = 48_260


@dataclasses.dataclass(frozen=True)
class CoSearchConfig(Stage):
    """CoSearch's ranker (module docstring): ``candidates`` BM25 documents per search for it to order;
    ``grouping`` (``"rouge1"``, ``"exact"``, ``"question"``) and ``group_threshold`` (ROUGE-1 F1) of the semantic
    grouping; ``min_group``: calls a cluster needs to train; ``reward`` (``"composite"``, ``"hit"``, ``"outcome"``)
    with ``hit_cutoffs``, ``outcome_threshold`` and ``cond_threshold``; ``learning_rate``, ``clip_eps`` and
    ``epochs`` of the ranker's update; ``init_bm25_weight``: the initial weight of the BM25 feature;
    ``train_ranker``: ``False`` keeps the initial ranker, greedy."""

    candidates: int = 10
    grouping: str = "rouge1"
    group_threshold: float = 0.8
    min_group: int = 2
    reward: str = "composite"
    hit_cutoffs: tuple = (1, 2, 3)
    outcome_threshold: float = 0.8
    cond_threshold: float = 0.8
    learning_rate: float = 0.05
    clip_eps: float = 0.2
    epochs: int = 1
    init_bm25_weight: float = 3.0
    train_ranker: bool = True

    role: ClassVar[str] = "wrapper"  # ranks the multi-turn source's search results and trains the ranker
    requires: ClassVar[tuple] = (VERIFIER,)
    needs: ClassVar[frozenset[str]] = frozenset({"turn_forest"})

    def __post_init__(self):
        for name, low in (("candidates", 2), ("min_group", 1), ("epochs", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"CoSearchConfig.{name} must be an integer >= {low}, got {v!r}; fix: "
                                  f"CoSearchConfig.{name} = {getattr(CoSearchConfig, name)}")
        for name, choices in (("grouping", core.GROUPINGS), ("reward", core.REWARDS)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"CoSearchConfig.{name} must be one of {choices}, got {getattr(self, name)!r}; "
                                  f"fix: CoSearchConfig.{name} = {choices[0]!r}")
        for name in ("group_threshold", "outcome_threshold", "cond_threshold", "clip_eps"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
                raise ConfigError(f"CoSearchConfig.{name} must be in (0, 1], got {v!r}; fix: "
                                  f"CoSearchConfig.{name} = {getattr(CoSearchConfig, name)}")
        cuts = tuple(self.hit_cutoffs)
        if not cuts or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in cuts):
            raise ConfigError(f"CoSearchConfig.hit_cutoffs must be positive integers, got {self.hit_cutoffs!r}; "
                              "fix: CoSearchConfig.hit_cutoffs = (1, 2, 3)")
        if not (np.isfinite(self.learning_rate) and self.learning_rate > 0 and np.isfinite(self.init_bm25_weight)):
            raise ConfigError(f"CoSearchConfig: learning_rate must be > 0 and init_bm25_weight finite, got "
                              f"{self.learning_rate!r}, {self.init_bm25_weight!r}; fix: CoSearchConfig.learning_rate "
                              "= 0.05")

    def check(self, facts) -> None:
        """The ranker orders the retrieval world's BM25 candidates: the run's task is that world's."""
        if facts.task and facts.task != "retrieval_multihop":
            raise ConfigError(f"CoSearchConfig ranks the retrieval world's search results, and task {facts.task!r} "
                              "has none; fix: RunConfig.task = 'retrieval_multihop' (with MultiTurnConfig.environment "
                              "= 'retrieval')")

    def build(self, inner, ctx):
        mt = next((s for s in chain_sources(inner) if hasattr(s, "make_env") and hasattr(s, "config")), None)
        if mt is None:
            raise ConfigError("CoSearchConfig wraps the multi-turn source's environments; fix: RunConfig.rollouts = "
                              "[@MultiTurnConfig(), @CoSearchConfig()]")
        check_multiturn(mt.config)
        return CoSearchRollouts(inner, mt, self, seed=ctx.seed)


def check_multiturn(config) -> None:
    """The multi-turn settings CoSearch is built for: the retrieval world, independent episodes, no semi-online
    rollout (one line each, with its fix)."""
    if config.environment != "retrieval":
        raise ConfigError(f"CoSearchConfig ranks the retrieval world's search results, not environment "
                          f"{config.environment!r}'s; fix: MultiTurnConfig.environment = 'retrieval'")
    if config.roots is not None:
        raise ConfigError(f"CoSearchConfig is built for independent episodes (MultiTurnConfig.roots = {config.roots}: "
                          "trees of turns); fix: MultiTurnConfig.roots = None")
    if config.semi_online is not None:
        raise ConfigError("CoSearchConfig ranks the policy's own searches, and the semi-online rollout replaces them "
                          "with the expert's; fix: MultiTurnConfig.semi_online = None")


@dataclasses.dataclass
class RankerCall:
    """One search call's ranking: its question key, ``episode`` (the session's episode id), sub-query, candidate
    features ``[n, F]``, the shown ``order`` (candidate indices), behaviour ``logp``, candidate ``relevant`` flags,
    ``evidence`` (some candidate relevant) and mean Hit@k; ``outcome``: its episode's score, set when the step ends."""

    question: str
    episode: int
    query: str
    features: np.ndarray
    order: np.ndarray
    logp: float
    relevant: np.ndarray
    evidence: bool
    hit: float
    outcome: float = 0.0


class RankerSession:
    """One step's (or one evaluation's) use of the ranker: ``owner`` holds its weights (``owner.theta``) and
    settings (``owner.config``); ``rng``: a numpy generator to sample orders (``None``: greedy); ``record``: keep
    the calls and episodes for the update."""

    def __init__(self, owner, rng: np.random.Generator | None = None, record: bool = False):
        self.owner, self.rng, self.record = owner, rng, record
        self.calls: list[RankerCall] = []
        self.episodes: list = []  # each episode's environment, by episode id

    def new_episode(self, env) -> int:
        """The id of a new episode (``-1`` in a session that does not record: nothing is kept)."""
        if not self.record:
            return -1
        self.episodes.append(env)
        return len(self.episodes) - 1

    def search(self, task, example, query: str, top_k: int, episode: int) -> tuple[str, bool, dict]:
        """``(observation body, error, info)`` of one search: the ranker's order of the BM25 candidates (module
        docstring, 1)."""
        cfg, index = self.owner.config, task.index
        hits = index.search(query, cfg.candidates)
        if not hits:
            return f"[error] no document matches {query!r}", True, {}
        docs = [index.documents[i] for i, _ in hits]
        feats = core.candidate_features(query, docs, [s for _, s in hits])
        scores = feats.astype(np.float64) @ self.owner.theta
        m = min(top_k, len(docs))
        order = core.sample_order(scores, m, self.rng) if self.rng is not None else core.greedy_order(scores, m)
        gold = evidence_pages(example)
        relevant = np.array([d.title in gold for d in docs])
        logp = float(core.plackett_luce_logp(scores[None], np.ones((1, len(docs)), bool), order[None])[0])
        call = RankerCall(prompt_key(example), episode, query, feats, order, logp, relevant, bool(relevant.any()),
                          core.hit_at_ks(relevant[order], cfg.hit_cutoffs))
        if self.record:
            self.calls.append(call)
        body = "\n".join(f"[{r}] {docs[i].title}: {docs[i].text}" for r, i in enumerate(order, 1))
        return body, False, {"ranked": [int(hits[i][0]) for i in order], "reordered": bool(np.any(order != np.arange(m)))}

    def finish(self) -> list[RankerCall]:
        """The recorded calls, each with its episode's score as ``outcome``."""
        for c in self.calls:
            c.outcome = float(self.episodes[c.episode].outcome)
        return self.calls


class RankedSearchEnv:
    """The retrieval world with CoSearch's ranker on its searches (module docstring, 1): ``inner`` a
    :class:`~treejax.envs.retrieval.RetrievalEnv` (its state: the example, the call count, ``done``), ``owner``
    the wrapper whose ``session`` ranks and records. ``outcome``: the episode's score (the answer turn's verifier
    score, 0 before an answer or without one)."""

    def __init__(self, inner, owner):
        self.inner, self.owner = inner, owner
        self.session, self.episode, self.outcome = None, -1, 0.0

    @property
    def stop_strings(self):
        return self.inner.stop_strings

    def reset(self, example) -> str:
        obs = self.inner.reset(example)
        self.session, self.outcome = self.owner.session, 0.0
        self.episode = self.session.new_episode(self)
        return obs

    def step(self, action: str):
        result = tool_step(self.inner, action, parse_call, self._run)
        if result.done:
            self.outcome = float(result.reward) if result.info.get("answered") else 0.0
        return result

    def _run(self, call: dict) -> tuple[str, dict]:
        if call["name"] != "search":
            return self.inner._run(call)
        t = time.perf_counter()
        inner = self.inner
        body, error, info = self.session.search(inner.task, inner.example, call["args"]["query"], inner.top_k,
                                                self.episode)
        return body, {"tool_call": call, "tool_seconds": time.perf_counter() - t, "tool_error": error,
                      **({"cosearch": info} if info else {})}

    def clone(self) -> "RankedSearchEnv":
        """A copy in the same state, a new episode of the same session (its calls so far stay its parent's)."""
        other = RankedSearchEnv(self.inner.clone(), self.owner)
        other.session, other.outcome = self.session, self.outcome
        other.episode = self.session.new_episode(other)
        return other


class CoSearchRollouts:
    """The multi-turn source with CoSearch's ranker (module docstring). ``base``: the source this wraps; ``mt``:
    the multi-turn source in its chain (its ``make_env`` is wrapped); ``seed``: the run's seed (the sampling
    generator when a step has no key)."""

    def __init__(self, base, mt, config: CoSearchConfig, seed: int = 0):
        self.base, self.mt, self.config, self.seed = base, mt, config, seed
        self.pipeline = getattr(base, "pipeline", None)
        self.estimator_inputs = getattr(base, "estimator_inputs", ())
        self.theta = np.zeros(len(core.FEATURES))
        self.theta[core.FEATURES.index("bm25")] = config.init_bm25_weight
        self.adam: dict = {}
        self.session = RankerSession(self)  # greedy, not recording: between steps and in the evaluation
        make = mt.make_env
        mt.make_env = lambda: RankedSearchEnv(make(), self)

    def rng(self, key, step: int) -> np.random.Generator:
        """The step's sampling generator: seeded from the step's key folded with :data:`RANKER_STREAM`."""
        if key is None:
            return np.random.default_rng([self.seed, step, RANKER_STREAM])
        data = np.asarray(jax.random.key_data(jax.random.fold_in(key, RANKER_STREAM)), np.uint32).ravel()
        return np.random.default_rng(data.tolist())

    def sample(self, params, key, step):
        cfg = self.config
        session = RankerSession(self, self.rng(key, step) if cfg.train_ranker else None, record=True)
        self.session = session
        try:
            ro = self.base.sample(params, key, step)
        finally:
            self.session = RankerSession(self)
        metrics = self.train(session.finish())
        ro.extra_metrics = {**(getattr(ro, "extra_metrics", None) or {}), **metrics}
        return ro

    def train(self, calls: list[RankerCall]) -> dict:
        """The ranker's GRPO step on one step's calls (module docstring, 3); its metrics."""
        cfg = self.config
        metrics = {"cosearch/ranker_calls": len(calls)}
        if calls:
            cluster = core.cluster_subqueries([c.question for c in calls], [c.evidence for c in calls],
                                              [c.query for c in calls], cfg.grouping, cfg.group_threshold)
            rewards = core.ranker_rewards([c.hit for c in calls], [c.evidence for c in calls],
                                          [c.outcome for c in calls], cfg.reward, cfg.outcome_threshold,
                                          cfg.cond_threshold)
            adv, weight = core.cluster_advantages(rewards, cluster, cfg.min_group)
            sizes = np.bincount(cluster)
            metrics.update({"cosearch/clusters": int(sizes.size), "cosearch/cluster_size_mean": float(sizes.mean()),
                            "cosearch/trained_calls": int(weight.sum()),
                            "cosearch/evidence_frac": float(np.mean([c.evidence for c in calls])),
                            "cosearch/hit_mean": float(np.mean([c.hit for c in calls])),
                            "cosearch/outcome_mean": float(np.mean([c.outcome for c in calls])),
                            "cosearch/reward_mean": float(rewards.mean()),
                            "cosearch/adv_abs_mean": float(np.abs(adv).mean()),
                            "cosearch/reordered_frac": float(np.mean([np.any(c.order != np.arange(len(c.order)))
                                                                      for c in calls]))})
            if cfg.train_ranker and weight.sum() > 0:
                metrics.update(self.update(calls, adv, weight))
        metrics.update({f"cosearch/theta_{n}": float(v) for n, v in zip(core.FEATURES, self.theta)})
        return metrics

    def update(self, calls: list[RankerCall], adv, weight) -> dict:
        """``epochs`` Adam steps of the clipped surrogate on the padded calls (:func:`pad_calls`)."""
        feats, valid, order, logp_old = pad_calls(calls, self.config.candidates)
        loss = grad_norm = stopped = 0.0
        for _ in range(self.config.epochs):
            loss, grad, stopped = core.ranker_loss_grad(self.theta, feats, valid, order, adv, logp_old, weight,
                                                        self.config.clip_eps)
            grad_norm = float(np.linalg.norm(grad))
            self.theta, self.adam = core.adam_step(self.theta, grad, self.adam, self.config.learning_rate)
        return {"cosearch/ranker_loss": float(loss), "cosearch/ranker_grad_norm": grad_norm,
                "cosearch/ranker_clipped_frac": float(stopped)}

    # -------------------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict:
        """The wrapped source's state and the ranker's weights and Adam state (``"cosearch_state"``)."""
        return {**getattr(self.base, "checkpoint_state", dict)(),
                "cosearch_state": encode_blob({"theta": self.theta.copy(), "adam": dict(self.adam)})}

    def restore_state(self, data_state: dict) -> None:
        if hasattr(self.base, "restore_state"):
            self.base.restore_state(data_state)
        text = data_state.get("cosearch_state")
        if text:
            data = decode_blob(text)
            self.theta, self.adam = np.asarray(data["theta"], np.float64), dict(data["adam"])


def pad_calls(calls: list[RankerCall], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(feats_AxNxF, valid_AxN, order_AxM, logp_old_A)``: the calls' candidates padded to ``width`` (invalid past
    each call's ``n``), their orders to the longest (``-1`` past each end), their behaviour log-probs."""
    A, F = len(calls), len(core.FEATURES)
    M = max((len(c.order) for c in calls), default=0)
    feats, valid = np.zeros((A, width, F), np.float64), np.zeros((A, width), bool)
    order = np.full((A, M), -1, np.int64)
    for a, c in enumerate(calls):
        n = len(c.features)
        feats[a, :n], valid[a, :n], order[a, :len(c.order)] = c.features, True, c.order
    return feats, valid, order, np.array([c.logp for c in calls], np.float64)


__all__ = ["CoSearchConfig", "CoSearchRollouts", "RANKER_STREAM", "RankedSearchEnv", "RankerCall", "RankerSession",
           "check_multiturn", "pad_calls"]
