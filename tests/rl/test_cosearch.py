"""CoSearch (issue 48; arXiv 2604.17555): the semantic grouping, the composite reward and the cluster advantage by
hand and against slow pure-Python references, the Plackett-Luce ranker (log-probs by enumeration, Gumbel sampling
by frequency, the loss gradient against jax's autodiff), Adam by hand, the ranked search environment on the real
retrieval world, the wrapper on a scripted multi-turn source (clusters, rewards, an update that lowers the
surrogate, determinism, checkpoints), the config checks' one-line errors, and the shipped config for one loop step
(slow)."""

from __future__ import annotations

import itertools
import math
import types

import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.rl import cosearch_core as core
from treejax.rl.cosearch import (CoSearchConfig, CoSearchRollouts, RankedSearchEnv, RankerSession, check_multiturn,
                                 pad_calls)
from treejax.rl.tool_match import evidence_pages


# ------------------------------------------------------------------------------------------ slow references
def slow_clusters(questions, evidence, queries, grouping, threshold):
    """The grouping rule written out plainly: lists of clusters, each ``[base, representative, members]``."""
    def norm(s):
        s = s.lower()
        for art in ("a", "an", "the"):
            s = " ".join(" " if w == art else w for w in s.split(" "))
        s = "".join(ch if (ch.isalnum() or ch == "_" or ch.isspace()) else " " for ch in s)
        return " ".join(s.split())

    def f1(x, y):
        xs, ys = x.split(), y.split()
        if not xs or not ys:
            return 0.0
        common = 0
        pool = list(ys)
        for w in xs:
            if w in pool:
                pool.remove(w)
                common += 1
        if common == 0:
            return 0.0
        p, r = common / len(xs), common / len(ys)
        return 2 * p * r / (p + r)

    clusters = []  # [base, representative, ids]
    out = []
    for q, e, text in zip(questions, evidence, queries):
        base, n = (q, bool(e)), norm(text)
        found = None
        for k, (b, rep, _) in enumerate(clusters):
            if b != base:
                continue
            if grouping == "question" or (grouping == "exact" and rep == n) or (grouping == "rouge1" and
                                                                                 f1(n, rep) >= threshold):
                found = k
                break
        if found is None:
            clusters.append((base, n, []))
            found = len(clusters) - 1
        out.append(found)
    return out


def slow_advantages(rewards, clusters, min_group, eps=1e-6):
    out = []
    for a, r in enumerate(rewards):
        members = [rewards[b] for b in range(len(rewards)) if clusters[b] == clusters[a]]
        n = len(members)
        if n < min_group:
            out.append(0.0)
        elif n == 1:
            out.append(r / (1.0 + eps))
        else:
            mean = sum(members) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
            out.append((r - mean) / (std + eps))
    return out


# ------------------------------------------------------------------------------------------ grouping
QUESTIONS = ["q1", "q1", "q1", "q1", "q1", "q2", "q1"]
EVIDENCE = [True, True, True, False, True, True, True]
QUERIES = ["Velor Systems", "the Velor Systems!", "Velor Systems founder", "Velor Systems", "Ana Brik",
           "Velor Systems", "founder Ana Brik born"]


def test_normalize_and_rouge1_by_hand():
    assert core.normalize_subquery("The Founder of  Velor-Systems?") == "founder of velor systems"
    assert core.normalize_subquery("an Apple a day") == "apple day"
    assert core.rouge1_f1("velor systems", "velor systems founder") == pytest.approx(0.8)  # P 1, R 2/3
    assert core.rouge1_f1("founder ana brik born", "ana brik") == pytest.approx(2 / 3)  # P 1/2, R 1
    assert core.rouge1_f1("", "ana") == 0.0 and core.rouge1_f1("x y", "z") == 0.0


@pytest.mark.parametrize("grouping, want", [("rouge1", [0, 0, 0, 1, 2, 3, 4]), ("exact", [0, 0, 1, 2, 3, 4, 5]),
                                            ("question", [0, 0, 0, 1, 0, 2, 0])])
def test_clusters_by_hand_and_against_the_slow_reference(grouping, want):
    """The hand-made calls: "the Velor Systems!" normalises to a0's text (F1 1); "Velor Systems founder" has F1 0.8
    with it (joins at the threshold); a3 has no evidence, a5 another question (their own clusters); "founder Ana
    Brik born" has F1 2/3 with "Ana Brik" (a new cluster)."""
    got = core.cluster_subqueries(QUESTIONS, EVIDENCE, QUERIES, grouping, 0.8)
    assert got.tolist() == want
    assert got.tolist() == slow_clusters(QUESTIONS, EVIDENCE, QUERIES, grouping, 0.8)
    assert core.cluster_subqueries(QUESTIONS, EVIDENCE, QUERIES, "rouge1", 0.81).tolist() == [0, 0, 1, 2, 3, 4, 5]


def test_clusters_match_the_slow_reference_on_random_calls():
    rng = np.random.default_rng(0)
    words = ["velor", "systems", "ana", "brik", "the", "founder", "born", "city", "Tolsa,"]
    for trial in range(30):
        A = int(rng.integers(1, 25))
        qs = [f"q{rng.integers(3)}" for _ in range(A)]
        ev = rng.random(A) < 0.7
        texts = [" ".join(rng.choice(words, size=int(rng.integers(1, 5)))) for _ in range(A)]
        thr = float(rng.choice([0.5, 0.8, 1.0]))
        for g in core.GROUPINGS:
            assert core.cluster_subqueries(qs, ev, texts, g, thr).tolist() == slow_clusters(qs, ev, texts, g, thr)


# ------------------------------------------------------------------------------------------ rewards, advantages
HIT = [1.0, 1 / 3, 2 / 3, 0.5, 1.0]
EV = [True, True, True, False, True]
OUT = [1.0, 1.0, 0.0, 1.0, 0.0]


def test_hit_and_rewards_by_hand():
    assert core.hit_at_ks([False, True, False], (1, 2, 3)) == pytest.approx(2 / 3)
    assert core.hit_at_ks([False, False], (1, 2, 3)) == 0.0
    assert core.hit_at_ks([True], (1, 2, 3)) == 1.0  # fewer shown than a cutoff: what is there
    # a0: 1 + 1; a1: Hit 1/3 < 0.8 with evidence available, no outcome credit; a2: 2/3 + 0; a3: no evidence, h = 0,
    # + its outcome; a4: 1 + 0
    np.testing.assert_allclose(core.ranker_rewards(HIT, EV, OUT), [2.0, 1 / 3, 2 / 3, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(core.ranker_rewards(HIT, EV, OUT, "hit"), [1.0, 1 / 3, 2 / 3, 0.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(core.ranker_rewards(HIT, EV, OUT, "outcome"), [1, 1, 0, 1, 0])
    np.testing.assert_allclose(core.ranker_rewards(HIT, EV, [0.79] * 5, outcome_threshold=0.8),
                               [1.0, 1 / 3, 2 / 3, 0.0, 1.0], rtol=1e-6)


def test_cluster_advantages_by_hand_and_against_the_slow_reference():
    rewards, clusters = [2.0, 1 / 3, 2 / 3, 1.0, 1.0], [0, 0, 0, 1, 2]
    # cluster 0: mean 1, Bessel std sqrt((1 + 4/9 + 1/9) / 2) = sqrt(7/9) = 0.8819171; singletons 1, 2
    adv, w = core.cluster_advantages(rewards, clusters, min_group=2)
    np.testing.assert_allclose(adv, [1.1338934, -0.7559289, -0.3779645, 0.0, 0.0], rtol=1e-5)
    np.testing.assert_array_equal(w, [1, 1, 1, 0, 0])
    adv1, w1 = core.cluster_advantages(rewards, clusters, min_group=1)  # verl's singleton rule: R / (1 + eps)
    np.testing.assert_allclose(adv1, [1.1338934, -0.7559289, -0.3779645, 1 / (1 + 1e-6), 1 / (1 + 1e-6)], rtol=1e-5)
    assert w1.tolist() == [1, 1, 1, 1, 1]
    adv3, _ = core.cluster_advantages([1.0, 1.0, 1.0], [0, 0, 0], min_group=2)
    assert adv3.tolist() == [0.0, 0.0, 0.0]  # equal rewards: exact zeros
    rng = np.random.default_rng(1)
    for _ in range(20):
        A = int(rng.integers(1, 15))
        r = rng.choice([0.0, 1 / 3, 2 / 3, 1.0, 2.0], size=A)
        c = rng.integers(0, 4, size=A)
        c = np.unique(c, return_inverse=True)[1]
        for m in (1, 2, 3):
            np.testing.assert_allclose(core.cluster_advantages(r, c, m)[0], slow_advantages(list(r), list(c), m),
                                       rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ the ranker
def test_plackett_luce_by_hand_and_by_enumeration():
    s = np.array([[1.0, 0.0, -1.0]])
    # order (2, 0): (-1 - log(e + 1 + 1/e)) + (1 - log(e + 1)) = -2.4076059 - 0.3132617
    got = core.plackett_luce_logp(s, np.ones((1, 3), bool), np.array([[2, 0]]))
    np.testing.assert_allclose(got, [-2.7208676], rtol=1e-6)
    rng = np.random.default_rng(2)
    scores, valid = rng.normal(size=(1, 5)), np.array([[True, True, True, True, False]])
    total = sum(math.exp(core.plackett_luce_logp(scores, valid, np.array([o]))[0])
                for o in itertools.permutations(range(4), 3))
    assert total == pytest.approx(1.0, abs=1e-9)  # the ordered top-3 choices of the 4 valid candidates
    pad = core.plackett_luce_logp(scores, valid, np.array([[1, -1, -1]]))
    np.testing.assert_allclose(pad, core.plackett_luce_logp(scores, valid, np.array([[1]])))


def test_gumbel_top_m_samples_plackett_luce():
    s = np.array([0.5, 0.0, -0.5, 1.0])
    rng = np.random.default_rng(3)
    n = 20000
    counts: dict = {}
    for _ in range(n):
        o = tuple(core.sample_order(s, 2, rng).tolist())
        counts[o] = counts.get(o, 0) + 1
    for o in itertools.permutations(range(4), 2):
        p = math.exp(core.plackett_luce_logp(s[None], np.ones((1, 4), bool), np.array([o]))[0])
        assert abs(counts.get(o, 0) / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3, (o, counts.get(o), p)
    assert core.greedy_order(np.array([0.0, 2.0, 2.0, 1.0]), 3).tolist() == [1, 2, 3]  # ties by BM25 order


def test_loss_gradient_matches_jax_autodiff():
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(4)
    A, N, F, M = 6, 5, len(core.FEATURES), 3
    feats = rng.normal(size=(A, N, F))
    valid = np.ones((A, N), bool)
    valid[0, 3:] = False
    order = np.array([rng.permutation(int(valid[a].sum()))[:M] for a in range(A)])
    theta = rng.normal(size=F) * 0.3
    adv = np.array([1.0, -1.0, 1.0, 1.0, -1.0, 0.5])
    w = np.array([1, 1, 1, 0, 1, 1], float)
    # rho = e^0.5 with A > 0 (clipped: no gradient), e^0.5 with A < 0 and e^-0.5 with A > 0 (unclipped), 1 elsewhere
    logp_old = core.plackett_luce_logp(feats @ theta, valid, order) - np.array([0.5, 0.5, -0.5, 0.0, 0.0, 0.0])

    def ref_loss(th):
        s = jnp.einsum("anf,f->an", feats, th)
        logp = jnp.zeros(A)
        rem = jnp.asarray(valid)
        for j in range(M):
            o = order[:, j]
            lse = jax.nn.logsumexp(jnp.where(rem, s, -jnp.inf), axis=-1)
            logp = logp + s[jnp.arange(A), o] - lse
            rem = rem.at[jnp.arange(A), o].set(False)
        rho = jnp.exp(logp - logp_old)
        obj = jnp.minimum(rho * adv, jnp.clip(rho, 0.8, 1.2) * adv)
        return -jnp.sum(w * obj) / jnp.sum(w)

    jax.config.update("jax_enable_x64", True)  # the reference in float64 (as tests/rl/test_losses.py)
    try:
        want_loss, want_grad = jax.value_and_grad(ref_loss)(jnp.asarray(theta, jnp.float64))
    finally:
        jax.config.update("jax_enable_x64", False)
    loss, grad, stopped = core.ranker_loss_grad(theta, feats, valid, order, adv, logp_old, w, 0.2)
    assert loss == pytest.approx(float(want_loss), rel=1e-9)
    np.testing.assert_allclose(grad, np.asarray(want_grad), rtol=1e-7, atol=1e-10)
    assert stopped == pytest.approx(1 / 5)  # a0 of the 5 weighted calls
    assert core.ranker_loss_grad(theta, feats, valid, order, adv, logp_old, np.zeros(A), 0.2)[1].tolist() == [0.0] * F


def test_adam_step_by_hand():
    theta, state = core.adam_step(np.array([1.0, -1.0]), np.array([0.5, -2.0]), {}, 0.1)
    np.testing.assert_allclose(theta, [0.9, -0.9], rtol=1e-6)  # the first bias-corrected step: lr * sign(g)
    assert state["t"] == 1
    np.testing.assert_allclose(state["m"], [0.05, -0.2])
    np.testing.assert_allclose(state["v"], [0.00025, 0.004])


def test_candidate_features_by_hand():
    Doc = types.SimpleNamespace
    docs = [Doc(title="Velor Systems", text="Velor Systems is a company founded by Ana Brik.", kind="company"),
            Doc(title="Ana Brik", text="Ana Brik is a pilot.", kind="person")]
    f = core.candidate_features("Velor Systems founder", docs, [4.0, 1.0])
    np.testing.assert_allclose(f[0], [1.0, 1.0, 1.0, 2 / 3, 0, 0, 0, 1])
    np.testing.assert_allclose(f[1], [0.25, 0.5, 0.0, 0.0, 0, 0, 1, 0])


# ------------------------------------------------------------------------------------------ the world
@pytest.fixture(scope="module")
def task():
    from treejax.envs.retrieval_corpus import RetrievalTask

    return RetrievalTask(size=16, eval_size=4, seed=3)


def _owner(task, config=CoSearchConfig()):
    """A wrapper over a fake multi-turn source whose environments are the plain retrieval world."""
    from treejax.envs.retrieval import RetrievalEnv
    from treejax.rl.multiturn import MultiTurnConfig

    mt = types.SimpleNamespace(make_env=lambda: RetrievalEnv(task, max_calls=3, top_k=3),
                               config=MultiTurnConfig(environment="retrieval"))
    return CoSearchRollouts(mt, mt, config, seed=0)


def test_ranked_search_on_the_retrieval_world(task):
    """The greedy initial ranker shows BM25's order: the company's own page first (an evidence page), the call
    recorded with its features, order, relevance and Hit@{1,2,3} = 1; the answer sets the episode's outcome."""
    owner = _owner(task)
    owner.session = RankerSession(owner, rng=None, record=True)
    ex = next(task.examples("train"))
    env = owner.mt.make_env()
    assert isinstance(env, RankedSearchEnv) and env.stop_strings == ("</search>", "</calculate>")
    env.reset(ex)
    company = ex.metadata["company"]
    r = env.step(f"Let me look.\n<search>{company}</search>")
    hits = task.index.search(company, 3)
    assert r.observation.startswith(f"\n<output>\n[1] {company}: ") and not r.done
    assert r.info["cosearch"]["ranked"] == [i for i, _ in hits] and r.info["tool_call"]["name"] == "search"
    assert env.step("<calculate>2 + 3</calculate>").observation == "\n<output>\n5\n</output>\n"
    assert company in evidence_pages(ex)
    (call,) = owner.session.calls
    assert call.query == company and call.evidence and call.hit == 1.0 and call.relevant[0]
    assert call.features.shape == (min(10, len(task.index.search(company, 10))), len(core.FEATURES))
    assert env.step(f"Answer: {ex.ground_truth}").done and env.outcome == 1.0
    assert owner.session.finish()[0].outcome == 1.0
    other = env.clone()
    assert other.episode == 1 and other.outcome == 1.0 and other.inner is not env.inner
    assert owner.session.search(task, ex, "zzzqqq", 3, 0)[:2] == ("[error] no document matches 'zzzqqq'", True)


class ScriptedTurns:
    """A multi-turn source without a model: each step, every prompt's ``W`` episodes run scripted actions on the
    source's environments (``make_env``), in slot order."""

    def __init__(self, task, scripts):
        from treejax.envs.retrieval import RetrievalEnv
        from treejax.rl.multiturn import MultiTurnConfig

        self.task, self.scripts = task, scripts
        self.make_env = lambda: RetrievalEnv(task, max_calls=3, top_k=3)
        self.config = MultiTurnConfig(environment="retrieval")
        self.examples = list(task.examples("train"))[:2]

    def sample(self, params, key, step):
        for p, ex in enumerate(self.examples):
            for actions in self.scripts(ex):
                env = self.make_env()
                env.reset(ex)
                for a in actions:
                    if env.step(a).done:
                        break
        return types.SimpleNamespace(extra_metrics={"base": 1.0})


def _scripts(ex):
    """Four slots: the company (answers right), "the <company>" and "<company> founder" (answer wrong), the founder
    (never answers)."""
    company, founder = ex.metadata["company"], ex.metadata["reference_calls"][1]["args"]["query"]
    return [[f"<search>{company}</search>", f"Answer: {ex.ground_truth}"],
            [f"<search>the {company}</search>", "Answer: nowhere"],
            [f"<search>{company} founder</search>", "Answer: nowhere"],
            [f"<search>{founder}</search>"]]


def test_the_wrapper_groups_rewards_and_trains_the_ranker(task):
    base = ScriptedTurns(task, _scripts)
    src = CoSearchRollouts(base, base, CoSearchConfig(learning_rate=0.05))
    theta0 = src.theta.copy()
    session_calls = []
    inner_finish = RankerSession.finish

    def spy(self):
        calls = inner_finish(self)
        session_calls.extend(calls)
        return calls

    RankerSession.finish = spy
    try:
        ro = src.sample(None, None, 0)
    finally:
        RankerSession.finish = inner_finish
    m = ro.extra_metrics
    assert m["base"] == 1.0 and m["cosearch/ranker_calls"] == 8
    # per question: {company, the company, company founder} cluster (F1 1, 1, 0.8), the founder alone
    assert m["cosearch/clusters"] == 4 and m["cosearch/trained_calls"] == 6
    assert [c.outcome for c in session_calls] == [1.0, 0.0, 0.0, 0.0] * 2
    assert m["cosearch/outcome_mean"] == 0.25 and m["cosearch/evidence_frac"] == 1.0
    assert not src.session.record and src.session.rng is None  # greedy between steps
    assert np.any(src.theta != theta0)
    # the step lowered the surrogate on its own calls (with the new weights' log-probs against the behaviour's)
    feats, valid, order, logp_old = pad_calls(session_calls, 10)
    cluster = core.cluster_subqueries([c.question for c in session_calls], [c.evidence for c in session_calls],
                                      [c.query for c in session_calls])
    rewards = core.ranker_rewards([c.hit for c in session_calls], [c.evidence for c in session_calls],
                                  [c.outcome for c in session_calls])
    adv, w = core.cluster_advantages(rewards, cluster)
    before = core.ranker_loss_grad(theta0, feats, valid, order, adv, logp_old, w)[0]
    after = core.ranker_loss_grad(src.theta, feats, valid, order, adv, logp_old, w)[0]
    assert after < before
    assert m["cosearch/ranker_loss"] == pytest.approx(before)


def test_sampling_is_deterministic_and_checkpoints_round_trip(task):
    import jax

    def run():
        base = ScriptedTurns(task, _scripts)
        src = CoSearchRollouts(base, base, CoSearchConfig())
        for step in range(2):
            src.sample(None, jax.random.fold_in(jax.random.key(7), step), step)
        return src

    a, b = run(), run()
    np.testing.assert_array_equal(a.theta, b.theta)
    state = a.checkpoint_state()
    base = ScriptedTurns(task, _scripts)
    fresh = CoSearchRollouts(base, base, CoSearchConfig())
    fresh.restore_state(state)
    np.testing.assert_array_equal(fresh.theta, a.theta)
    assert fresh.adam["t"] == a.adam["t"] == 2
    base = ScriptedTurns(task, _scripts)
    fixed = CoSearchRollouts(base, base, CoSearchConfig(train_ranker=False))
    m = fixed.sample(None, jax.random.key(0), 0).extra_metrics
    assert m["cosearch/ranker_calls"] == 8 and "cosearch/ranker_loss" not in m
    assert m["cosearch/theta_bm25"] == 3.0 and m["cosearch/reordered_frac"] == 0.0  # greedy BM25 order


# ------------------------------------------------------------------------------------------ config checks
def test_option_and_config_errors_name_the_fix():
    from treejax.envs.semi_online import SemiOnlineConfig
    from treejax.rl.config import RunConfig
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.sampling import tree

    with pytest.raises(ConfigError, match="candidates must be an integer >= 2, got 1; fix: CoSearchConfig.candidates"):
        CoSearchConfig(candidates=1)
    with pytest.raises(ConfigError, match="grouping must be one of .*fix: CoSearchConfig.grouping = 'rouge1'"):
        CoSearchConfig(grouping="cosine")
    with pytest.raises(ConfigError, match="reward must be one of .*fix: CoSearchConfig.reward = 'composite'"):
        CoSearchConfig(reward="ndcg")
    with pytest.raises(ConfigError, match=r"group_threshold must be in \(0, 1\], got 1.5; fix:"):
        CoSearchConfig(group_threshold=1.5)
    with pytest.raises(ConfigError, match="hit_cutoffs must be positive integers.*fix: CoSearchConfig.hit_cutoffs"):
        CoSearchConfig(hit_cutoffs=(0, 3))
    with pytest.raises(ConfigError, match="learning_rate must be > 0.*fix: CoSearchConfig.learning_rate = 0.05"):
        CoSearchConfig(learning_rate=0.0)
    chains = tree.independent_config(4, 64, 16)
    mt = MultiTurnConfig(environment="retrieval")
    world = dict(rollout=chains, task="retrieval_multihop", estimator="grpo")
    RunConfig(rollouts=[mt, CoSearchConfig()], **world)
    with pytest.raises(ConfigError, match="CoSearchConfig ranks the retrieval world's search results, and task "
                                          "'chain_sum_2x1' has none; fix: RunConfig.task = 'retrieval_multihop'"):
        RunConfig(rollouts=[MultiTurnConfig(), CoSearchConfig()], **{**world, "task": "chain_sum_2x1"})
    with pytest.raises(ConfigError, match=r"CoSearchConfig wraps rows with \['turn_forest'\].*fix: .*MultiTurnConfig"):
        RunConfig(rollouts=[CoSearchConfig()], **world)
    with pytest.raises(ConfigError, match="not environment 'code_tool''s; fix: MultiTurnConfig.environment = "
                                          "'retrieval'"):
        check_multiturn(MultiTurnConfig())
    with pytest.raises(ConfigError, match="fix: MultiTurnConfig.roots = None"):
        check_multiturn(MultiTurnConfig(environment="retrieval", roots=2))
    with pytest.raises(ConfigError, match="fix: MultiTurnConfig.semi_online = None"):
        check_multiturn(MultiTurnConfig(environment="retrieval", semi_online=SemiOnlineConfig()))
    ctx = types.SimpleNamespace(seed=0)
    with pytest.raises(ConfigError, match=r"fix: RunConfig.rollouts = \[@MultiTurnConfig\(\), @CoSearchConfig\(\)\]"):
        CoSearchConfig().build(types.SimpleNamespace(sample=None), ctx)
    inner = types.SimpleNamespace(make_env=lambda: None, config=MultiTurnConfig(environment="retrieval", roots=2))
    with pytest.raises(ConfigError, match="fix: MultiTurnConfig.roots = None"):
        CoSearchConfig().build(inner, ctx)
    inner.config = MultiTurnConfig(environment="retrieval")
    assert isinstance(CoSearchConfig().build(inner, ctx), CoSearchRollouts)


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow  # one RL step of the whole loop on a tiny random model (about two minutes on the shared 2-core
# machine); the default run covers its parts: the wrapper on a scripted source, the ranked world, the checks
def test_the_shipped_cosearch_config_runs_one_step(tiny_checkpoint, tmp_path):
    """configs/multiturn_retrieval_cosearch.gin end to end (task, world, the ranked search environment, GRPO on the
    policy, the ranker's step, evaluation with the ranked environment) for one step on a tiny random model with
    SmolLM2's tokenizer."""
    from treejax.testing.envs import run_shipped_multiturn

    last = run_shipped_multiturn("multiturn_retrieval_cosearch.gin", tiny_checkpoint, tmp_path / "run")
    assert last["cosearch/ranker_calls"] >= 0 and last["cosearch/theta_bm25"] == pytest.approx(3.0, abs=0.06)
