"""Search-R2: the evidence-density terms (the paper's useful new collections, and the documents the later turns
use) against slow pure-Python references and hand-computed numbers, the Trimmer's cut, the meta-refiner's cut and
regeneration of a multi-turn episode on tiny random models (the refiner's tokens with their behaviour log-probs,
the policy's continuation with its own), the config checks, and (slow) one loop step of the shipped config."""

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.rl.judges.evidence import (chunk_usage, collection_density, collection_usage, evidence_density,
                                        hybrid_rewards, usage_arrays, useful_document, words)
from treejax.rl.judges.search_r2 import SearchR2Config, SearchR2Rollouts, cut_at_stop, cut_turn, node_lengths

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
SHIPPED = "multiturn_retrieval_search_r2.gin"


# ------------------------------------------------------------------------------------- the evidence-density term
def reference_density(turns, min_overlap=1):
    """Slow, plain Python: every ``[n] doc`` line of every observation is a chunk; it is used when a word of it (3+
    letters or digits, not a stop word, not in the turn that retrieved it) is in a later turn's action; density =
    distinct used documents / chunks."""
    import re

    chunks = []
    for i, (action, obs) in enumerate(turns):
        later = set()
        for a, _ in turns[i + 1:]:
            later |= set(words(a))
        for line in obs.split("\n"):
            m = re.match(r"^\s*\[\d+\]\s*(.+?)\s*$", line)
            if m:
                mine = set(words(m.group(1))) - set(words(action))
                chunks.append((m.group(1), len(mine & later) >= min_overlap))
    if not chunks:
        return 0.0
    return len({doc for doc, used in chunks if used}) / len(chunks)


VELOR = "[{}] Velor Systems: Velor Systems is a maker of pumps founded in 1987 by Ana Brik."
EPISODES = [
    # A: 4 chunks; Velor (used: "founded ana brik" later), Tolsa (unused), Ana Brik (used: "born mirel"), Velor again
    # (nothing new of it used after it): distinct used {Velor, Ana Brik} / 4 = 0.5
    [("First the company.\n<search>Velor Systems</search>",
      f"\n<output>\n{VELOR.format(1)}\n[2] Tolsa Corp: Tolsa Corp sells glass.\n</output>\n"),
     ("Ana Brik founded it.\n<search>Ana Brik</search>",
      f"\n<output>\n[1] Ana Brik: Ana Brik was born in Mirel.\n{VELOR.format(2)}\n</output>\n"),
     ("She was born in Mirel.\nAnswer: Mirel", "")],
    [("Answer: Mirel", "")],  # B: no retrieval, a guess: 0
    [("<search>zzz</search>", "\n<output>\n[error] no document matches 'zzz'\n</output>\n"),  # C: no evidence: 0
     ("Answer: Tolsa", "")],
    # D: the same document twice, both copies used: 1 distinct / 2 chunks = 0.5
    [("<search>Velor</search>", f"\n<output>\n{VELOR.format(1)}\n</output>\n"),
     ("<search>Velor again</search>", f"\n<output>\n{VELOR.format(1)}\n</output>\n"),
     ("Founded by Ana Brik in 1987.\nAnswer: Ana Brik", "")],
]


def test_evidence_density_hand_made_case_matches_the_reference_and_the_numbers():
    usage = [chunk_usage(e) for e in EPISODES]
    assert usage[0] == ([True, False, True, False], [0, 1, 2, 0])
    assert usage[1] == ([], []) and usage[2] == ([], []) and usage[3] == ([True, True], [0, 0])
    used, doc, valid = usage_arrays([usage[:2], usage[2:]])  # P = 2 prompts x W = 2 slots
    rho = np.asarray(evidence_density(jnp.asarray(used), jnp.asarray(doc), jnp.asarray(valid)))
    np.testing.assert_allclose(rho, [[0.5, 0.0], [0.0, 0.5]])
    np.testing.assert_allclose(rho.ravel(), [reference_density(e) for e in EPISODES])
    # +-1 rewards: A and B correct, C and D wrong; coef 0.2
    r, c = jnp.asarray([[1.0, 1.0], [-1.0, -1.0]]), jnp.asarray([[True, True], [False, False]])
    np.testing.assert_allclose(hybrid_rewards(r, c, jnp.asarray(rho), 0.2, "correct"), [[1.1, 1.0], [-1.0, -1.0]])
    np.testing.assert_allclose(hybrid_rewards(r, c, jnp.asarray(rho), 0.2, "none"), [[1.1, 1.0], [-1.0, -0.9]])
    assert reference_density(EPISODES[0], min_overlap=3) == chunk_usage(EPISODES[0], min_overlap=3)[0].count(True) / 4


def _example(answer, searches):
    return types.SimpleNamespace(ground_truth=answer, metadata={"reference_calls": [
        {"name": "search", "args": {"query": q}} for q in searches] + [{"name": "calculate", "args": {"expr": "1"}}]})


def reference_collections(turns, useful):
    """Slow, plain Python (Appendix K of the paper): each <search> turn's [n] documents are one collection; it
    counts when one of them is useful and no earlier collection returned it; density = counted / searches."""
    import re

    seen, flags = [], []
    for action, obs in turns:
        if not re.search(r"<search>[^<]*</search>\s*$", action):
            continue
        docs = [m.group(1) for m in (re.match(r"^\s*\[\d+\]\s*(.+?)\s*$", ln) for ln in obs.split("\n")) if m]
        flags.append(any(useful(d) and d not in seen for d in docs))
        seen += docs
    return sum(flags) / len(flags) if flags else 0.0


def test_collection_density_hand_made_case_and_the_papers_coupling():
    ex = _example("Mirel", ["Velor Systems", "Ana Brik"])  # the evidence pages: Velor Systems and Ana Brik
    by_pages, by_answer = useful_document("evidence", ex), useful_document("answer", ex)
    assert by_pages(VELOR.format(1)[4:]) and not by_pages("Tolsa Corp: Tolsa Corp sells glass.")
    assert by_answer("Ana Brik: Ana Brik was born in Mirel.") and not by_answer("Mirelle Corp: a maker of pumps.")
    # A: searches 1 (Velor: an evidence page, new) and 2 (Ana Brik new; Velor repeated): 2 of 2 useful and new
    # C: one search, an error (no documents): 0 of 1; D: Velor, then Velor again (nothing new): 1 of 2
    # B: no search: 0 (M = 0); the calculator is not a search
    turns = [EPISODES[0], EPISODES[1], EPISODES[2], EPISODES[3],
             [("<calculate>1 + 1</calculate>", "\n<output>\n2\n</output>\n"), ("Answer: 2", "")]]
    assert [collection_usage(t, by_pages) for t in turns] == [[True, True], [], [False], [True, False], []]
    assert collection_usage(EPISODES[0], by_answer) == [False, True]  # only Ana Brik's page names Mirel
    usage = [[(collection_usage(t, by_pages), []) for t in turns[:2]], [(collection_usage(t, by_pages), [])
                                                                       for t in turns[2:4]]]
    used, _, valid = usage_arrays(usage)
    rho = np.asarray(collection_density(jnp.asarray(used), jnp.asarray(valid)))
    np.testing.assert_allclose(rho, [[1.0, 0.0], [0.0, 0.5]])
    np.testing.assert_allclose(rho.ravel(), [reference_collections(t, by_pages) for t in turns[:4]])
    # R = r_outcome (1 + rho) with a 0/1 outcome: coef 1, gated: A correct 2.0, B correct 1.0, C and D wrong 0
    r, c = jnp.asarray([[1.0, 1.0], [0.0, 0.0]]), jnp.asarray([[True, True], [False, False]])
    np.testing.assert_allclose(hybrid_rewards(r, c, jnp.asarray(rho), 1.0, "correct"), [[2.0, 1.0], [0.0, 0.0]])
    np.testing.assert_allclose(r * (1 + rho), [[2.0, 1.0], [0.0, 0.0]])
    with pytest.raises(ConfigError, match="useful = 'evidence' needs each problem's evidence pages.*fix:"):
        useful_document("evidence", types.SimpleNamespace(ground_truth="x", metadata={}))
    with pytest.raises(ConfigError, match="useful = 'answer' needs each problem's gold answer.*fix:"):
        useful_document("answer", types.SimpleNamespace(ground_truth=" ", metadata={}))


def test_trimmers_cut():
    assert cut_turn([0.9, 0.3, 0.2], 0.5, always=False) == 1  # the first turn below the threshold
    assert cut_turn([0.9, 0.6, 0.7], 0.5, always=False) == -1  # none below: left alone
    assert cut_turn([0.9, 0.6, 0.7], 0.5, always=True) == 1  # the paper cuts every flagged episode: the lowest
    assert cut_turn([0.6, float("nan"), 0.6], 0.5, always=True) == 0  # ties: the earliest; NaN ignored
    assert cut_turn([float("nan")] * 2, 0.5, always=True) == -1


def test_jitted_density_matches_a_loop_on_random_chunks():
    rng = np.random.default_rng(0)
    for _ in range(20):
        P, W, M = rng.integers(1, 3), rng.integers(1, 4), rng.integers(1, 7)
        used, doc = rng.random((P, W, M)) < 0.5, rng.integers(0, 3, (P, W, M)).astype(np.int32)
        n = rng.integers(0, M + 1, (P, W))
        valid = np.arange(M)[None, None] < n[..., None]
        got = np.asarray(evidence_density(jnp.asarray(used), jnp.asarray(doc), jnp.asarray(valid)))
        for p in range(P):
            for w in range(W):
                k = int(n[p, w])
                want = len({int(d) for u, d in zip(used[p, w, :k], doc[p, w, :k]) if u}) / k if k else 0.0
                assert abs(got[p, w] - want) < 1e-6


def test_cut_at_stop_and_node_lengths():
    text = {1: "a", 2: "</sea", 3: "rch>", 4: "b"}
    decode = lambda ids: "".join(text[i] for i in ids)  # noqa: E731
    t, q = cut_at_stop([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0], decode, ("</search>",))
    assert t.tolist() == [1, 2, 3] and q.tolist() == [-1.0, -2.0, -3.0]  # through the token that completes it
    assert cut_at_stop([1, 4], [-1.0, -4.0], decode, ("</search>",))[0].tolist() == [1, 4]
    ep = types.SimpleNamespace(turns=[(0, 0, "env"), (0, 3, "policy"), (3, 5, "env"), (5, 9, "policy")])
    assert node_lengths(ep) == [5, 4]


# ------------------------------------------------------------------------------------- config checks
@pytest.mark.parametrize("kw,match", [(dict(threshold=0.0), "threshold must be in"),
                                      (dict(discriminator_threshold=1.0), "discriminator_threshold must be in"),
                                      (dict(select="some"), "select must be one of"),
                                      (dict(regenerate="judge"), "regenerate must be one of"),
                                      (dict(correction="drop"), "correction must be one of"),
                                      (dict(gate="wrong"), "gate must be one of"),
                                      (dict(density="chunks"), "density must be one of"),
                                      (dict(useful="judge"), "useful must be one of"),
                                      (dict(refines_per_prompt=0), "refines_per_prompt >= 1"),
                                      (dict(density_coef=1.5), "density_coef must be in"),
                                      (dict(evidence_pattern=r"\[\d+\]"), "one group"),
                                      (dict(evidence_pattern="(("), "one group"),
                                      (dict(scorer="smollm2"), "scorer must be a ScorerConfig"),
                                      (dict(refiner="policy"), "refiner must be a RefinerConfig")])
def test_stage_errors_are_one_line_with_the_fix(kw, match):
    with pytest.raises(ConfigError, match=match) as e:
        SearchR2Config(**kw)
    assert "fix:" in str(e.value) and "\n" not in str(e.value)


def test_shipped_config_and_the_chain_checks():
    from treejax import train
    from treejax.rl.multiturn import MultiTurnConfig

    path = os.path.join(CONFIGS, SHIPPED)
    cfg = train.parse([path], [])
    planner, stage = cfg.rollouts
    assert isinstance(planner, MultiTurnConfig) and isinstance(stage, SearchR2Config)
    assert planner.environment == "retrieval" and not cfg.dynamic_sampling and cfg.reward_style == "01"
    assert (stage.meta, stage.regenerate, stage.select, stage.refines_per_prompt) == ("index", "policy", "all", None)
    assert stage.shared_weights and stage.scorer.model == "policy"
    assert (stage.density, stage.useful, stage.density_coef, stage.gate) == ("collections", "evidence", 1.0, "correct")
    refiner = ["SearchR2Config.regenerate = 'refiner'"]  # the refiner's tokens are off-policy: IS needs the trainer
    for bad, match in ((refiner, "or SearchR2Config.regenerate = 'policy'"),
                       (["RunConfig.packed_update = True"], "fix: RunConfig.packed_update = False"),
                       (["SearchR2Config.refines_per_prompt = 9"], "exceeds the 8 episodes.*= None \\(no cap\\)"),
                       (["RunConfig.rollouts = [@SearchR2Config()]"], "turn_forest"),
                       (["RunConfig.estimator = 'matchtir'"], "does not supply")):
        with pytest.raises(ConfigError, match=match) as e:
            train.parse([path], bad)
        assert "\n" not in str(e.value)
    measured = train.parse([path], refiner + ["RunConfig.old_logp = 'trainer'", "LossConfig.tis_cap = 2.0",
                                              "SearchR2Config.meta = 'judge_prm'", "SearchR2Config.shared_weights = False",
                                              "SearchR2Config.select = 'failed'", "SearchR2Config.density = 'documents'"])
    assert measured.rollouts[1].regenerate == "refiner" and measured.loss.tis_cap == 2.0


def test_trees_of_turns_are_refused_at_build():
    from treejax.rl.multiturn import MultiTurnConfig

    inner = types.SimpleNamespace(config=MultiTurnConfig(roots=2), make_env=lambda: None)
    ctx = types.SimpleNamespace(cfg=types.SimpleNamespace(rollout=types.SimpleNamespace(num_leaves=4)))
    with pytest.raises(ConfigError, match="fix: MultiTurnConfig.roots = None"):
        SearchR2Config().build(inner, ctx)


# ------------------------------------------------------------------------------------- cut and regenerate
class _Tok:
    """CharTokenizer without a chat template whose encode drops newlines (the refiner's plain-text context)."""

    chat_template = None

    def __init__(self):
        from treejax.testing.tokenizers import CharTokenizer

        self.inner, self.eos_ids, self.pad_id = CharTokenizer(), (63,), 0

    def decode(self, ids, skip_special_tokens=True):
        return self.inner.decode(ids, skip_special_tokens)

    def encode(self, text):
        return self.inner.encode(text.replace("\n", ""))


@pytest.fixture(scope="module")
def tiny():
    from treejax.models import presets, transformer

    cfg = presets.tiny_config("smollm2-135m", vocab_size=64, eos_token_ids=(63,))
    return cfg, transformer.init_params(cfg, jax.random.key(5)), transformer.init_params(cfg, jax.random.key(9))


PROMPT = [1, 2, 3]
#: slot 0 fails (turns "A15" OK, "B25" OK, answer "C4"), slot 1 is right ("A15" OK, "B5" OK, answer "35")
SLOTS = [[("A15", "OK"), ("B25", "OK"), ("C4", "")], [("A15", "OK"), ("B5", "OK"), ("35", "")]]


def _rollouts(tok, T):
    """The hand-made turn forest of :data:`SLOTS` (policy log-probs -1, observations 0) as the chain's rollouts."""
    from treejax.forest import NodeStatus
    from treejax.rl.rapo import episodes_forest
    from treejax.rl.rollouts import Rollouts
    from treejax.rl.spear import Trajectory

    rows = []
    for slot in SLOTS:
        toks, pm, nodes = [], [], []
        for action, obs in slot:
            a, o = tok.encode(action), tok.encode(obs)
            toks, pm, nodes = toks + a + o, pm + [1.0] * len(a) + [0.0] * len(o), nodes + [len(a) + len(o)]
        rows.append(Trajectory(0, np.array(PROMPT), 3, np.array(nodes), np.array(toks, np.int32), -np.array(pm, np.float32),
                               np.array(pm, np.float32), int(NodeStatus.FINISHED), 0.0, 0.0))
    forest = episodes_forest([rows], T, 1 + 2 * 3, 3).replace(segment_length=8)
    ex = types.SimpleNamespace(metadata={"question": "ABC"}, ground_truth="3")
    return Rollouts(forest=forest, rewards_PxW=jnp.asarray([[-1.0, 1.0]]), scores_PxW=np.array([[0.0, 1.0]], np.float32),
                    prompts_PxLp=np.array([PROMPT], np.int32), lengths_P=np.array([3]), examples=[ex],
                    reward_scores_PxW=np.array([[0.0, 1.0]], np.float32), tool_calls_PxW=np.array([[2, 2]], np.int32))


def _source(tiny, monkeypatch, T=32, **kw):
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.sampling import decode, tree_config
    from treejax.sampling.strategies import Temperature
    from treejax.scorers.refiner import Refiner, RefinerConfig
    from treejax.testing.envs import ScriptedToolEnv

    cfg_m, params, ref_params = tiny
    tok = _Tok()
    tc = tree_config.independent_config(2, T, 8, strategy=Temperature(1.0), stop_ids=(63,))
    base = types.SimpleNamespace(sample=lambda params, key, step: _rollouts(tok, T), pipeline=None,
                                 make_env=lambda: ScriptedToolEnv(tool_turns=2), tree_config=tc,
                                 config=MultiTurnConfig(max_turns=3, turn_tokens=6, chunk=4), observation_format=None)
    cfg = types.SimpleNamespace(model="unused", rollout=tc, reward_style="pm1", overlong_buffer=0, overlong_factor=1.0)
    ctx = types.SimpleNamespace(cfg=cfg, tokenizer=tok, sampler_fns=decode.make_model_fns(cfg_m, attention="dense",
                                                                                        cache_dtype="float32"),
                                pad_id=0, mesh=None)
    stage = SearchR2Config(refiner=RefinerConfig(template="Q{question}P{prefix}S{step}", max_new_tokens=4,
                                                 stop_at_newline=False), refines_per_prompt=1, **kw)
    src = SearchR2Rollouts(base, stage, ctx)
    refiner = Refiner(stage.refiner, cfg_m, ref_params, tok)

    def load():  # the judge's and the PRM's scores are set below; the refiner is a tiny model unlike the policy
        src.scorer, src.refiner = object(), refiner
    monkeypatch.setattr(src, "_load", load)
    monkeypatch.setattr("treejax.scorers.judge.judge_scores", lambda s, qs, texts, answers: np.array([0.2]))
    monkeypatch.setattr("treejax.scorers.prm.step_scores", lambda s, qs, steps: np.array([[0.9, 0.3, 0.1]]))
    return src, refiner, tok


def test_the_cut_episode_keeps_its_prefix_the_refiners_turn_and_the_policys_continuation(tiny, monkeypatch):
    """Judge 0.2 (flawed), PRM (0.9, 0.3, 0.1): slot 0 is cut at turn 2 ("B25"). The row keeps turn 1 ("A15" OK)
    with its log-probs, then the refiner's turn (log q = a direct forward of the refiner over its context), the
    world's "OK" (out of the loss), then the policy's answer turn (its own teacher-forced log-probs); 3 turn nodes;
    the reward is the world's score of that answer; slot 1 is unchanged."""
    from treejax.sampling.decode import score_tokens
    from treejax.scorers.refiner import refiner_context
    from tests.scorers.test_refiner import teacher_forced_logp

    cfg_m, params, ref_params = tiny
    src, refiner, tok = _source(tiny, monkeypatch)
    ro = src.sample(params, jax.random.key(3), 0)
    m = ro.extra_metrics
    assert (m["search_r2/selected"], m["search_r2/flagged"], m["search_r2/located"], m["search_r2/refined"]) == (1,) * 4
    assert m["search_r2/first_turn_mean"] == 1.0
    f = jax.device_get(ro.forest)
    tokens, logp, n = np.asarray(f.tokens)[0, 0], np.asarray(f.logprobs)[0, 0], int(f.leaf_length[0, 0])
    pm, mask = np.asarray(f.policy_tokens())[0, 0], np.asarray(f.loss_mask)[0, 0]
    a = len("A15OK")
    assert tok.decode(tokens[:a].tolist()) == "A15OK" and logp[:3].tolist() == [-1.0] * 3 and not logp[3:a].any()
    span = np.flatnonzero(ro.refined_PxWxT[0, 0])
    assert span[0] == a and 1 <= len(span) <= 4 and len(span) == m["search_r2/refined_tokens"]
    z = tokens[span].tolist()
    q = teacher_forced_logp(cfg_m, ref_params, refiner_context(refiner, "ABC", "A15OK", "B25"), z)
    np.testing.assert_allclose(logp[span], q, rtol=1e-4, atol=1e-5)
    assert mask[span].all()  # correction "is": the refiner's tokens are trained, importance-weighted
    b = span[-1] + 1
    assert tok.decode(tokens[b:b + 2].tolist()) == "OK" and not mask[b:b + 2].any() and not logp[b:b + 2].any()
    c = b + 2
    assert n > c and pm[c:n].all()  # the policy's answer turn
    pi = np.asarray(score_tokens(params, src.ctx.sampler_fns, ro.prompts_PxLp, ro.lengths_P, tokens[None], [n]))[0]
    np.testing.assert_allclose(logp[c:n], pi[c:n], rtol=1e-4, atol=1e-5)
    path = np.asarray(f.leaf_path)[0, 0]
    spans = np.asarray(f.spans())[0][path[1:][path[1:] >= 0]]
    assert spans[:, 1].tolist() == [a, b + 2 - a, n - c]
    score = float("3" in tok.decode(tokens[c:n].tolist()))
    assert ro.reward_scores_PxW.tolist() == [[score, 1.0]] and ro.scores_PxW.tolist() == [[0.0, 1.0]]
    np.testing.assert_allclose(np.asarray(ro.rewards_PxW), [[2 * score - 1, 1.0]])  # no "[n] doc" lines: rho = 0
    assert ro.tool_calls_PxW.tolist() == [[2, 2]] and m["search_r2/density_mean"] == 0.0
    np.testing.assert_array_equal(np.asarray(f.tokens)[0, 1], np.asarray(_rollouts(tok, 32).forest.tokens)[0, 1])


def test_policy_regeneration_is_an_on_policy_fork_and_mask_keeps_the_refiner_out(tiny, monkeypatch):
    from treejax.sampling.decode import score_tokens

    cfg_m, params, _ = tiny
    src, _, tok = _source(tiny, monkeypatch, regenerate="policy")
    monkeypatch.setattr("treejax.scorers.refiner.refine", lambda *a: pytest.fail("the refiner ran"))
    ro = src.sample(params, jax.random.key(3), 0)
    f = jax.device_get(ro.forest)
    tokens, logp, n = np.asarray(f.tokens)[0, 0], np.asarray(f.logprobs)[0, 0], int(f.leaf_length[0, 0])
    pm = np.asarray(f.policy_tokens())[0, 0] > 0
    assert not ro.refined_PxWxT.any() and tok.decode(tokens[:5].tolist()) == "A15OK" and n > 5
    pi = np.asarray(score_tokens(params, src.ctx.sampler_fns, ro.prompts_PxLp, ro.lengths_P, tokens[None], [n]))[0]
    np.testing.assert_allclose(logp[5:n][pm[5:n]], pi[5:n][pm[5:n]], rtol=1e-4, atol=1e-5)

    monkeypatch.undo()  # the refiner may run again
    src, _, _ = _source(tiny, monkeypatch, correction="mask")
    ro = src.sample(params, jax.random.key(3), 0)
    refined, mask = ro.refined_PxWxT[0, 0] > 0, np.asarray(ro.forest.loss_mask)[0, 0]
    assert refined.any() and not mask[refined].any() and mask[:3].all()


def test_nothing_is_cut_when_the_discriminator_finds_no_flaw(tiny, monkeypatch):
    cfg_m, params, _ = tiny
    src, _, tok = _source(tiny, monkeypatch)
    monkeypatch.setattr("treejax.scorers.judge.judge_scores", lambda s, qs, texts, answers: np.array([0.9]))
    monkeypatch.setattr("treejax.scorers.prm.step_scores", lambda *a: pytest.fail("the PRM ran"))
    ro, ref = src.sample(params, jax.random.key(3), 0), _rollouts(tok, 32)
    assert ro.extra_metrics["search_r2/flagged"] == 0 and ro.extra_metrics["search_r2/refined"] == 0
    for name in ("tokens", "logprobs", "loss_mask", "leaf_length", "leaf_status"):
        np.testing.assert_array_equal(np.asarray(getattr(ro.forest, name)), np.asarray(getattr(ref.forest, name)))
    np.testing.assert_array_equal(np.asarray(ro.rewards_PxW), np.asarray(ref.rewards_PxW))


def test_index_cuts_by_hand():
    from treejax.rl.judges.search_r2 import index_cuts

    lp = [[-1.0, -0.5, -2.0, -9.0],   # K = 2: step 1 beats 0 -> cut at turn 0
          [-0.1, -0.5, -0.2, -9.0],   # 0 is the best: not flagged
          [-3.0, -1.0, -1.0, -0.1],   # K = 2: choice 3 is past the episode, ignored; ties: the earliest -> turn 0
          [-3.0, -2.0, -1.0, -0.5]]   # K = 3: step 3 -> turn 2
    assert index_cuts(lp, [2, 2, 2, 3]) == [0, -1, 0, 2]
    assert index_cuts([[-1.0, -0.5]], [0]) == [-1]


def test_index_mode_flags_and_cuts_with_one_prompt(tiny, monkeypatch):
    """``meta = "index"``: one prompt per selected episode (the numbered turns), the judge and the PRM not run;
    choice log-probs that favour step 2 cut slot 0 at turn 2 as the judge + PRM path does; favouring 0 cuts
    nothing."""
    cfg_m, params, _ = tiny
    seen = []

    def choices(scorer, rows, options):
        seen.append((len(rows), options))
        return np.array([[-2.0, -1.5, -0.5] + [-9.0] * 7] * len(rows), np.float32)
    src, _, tok = _source(tiny, monkeypatch, meta="index", regenerate="policy")
    monkeypatch.setattr(src, "_load", lambda: setattr(src, "scorer", types.SimpleNamespace(
        config=types.SimpleNamespace(max_length=512), tokenizer=tok)))
    texts = []
    monkeypatch.setattr("treejax.scorers.judge.chat_ids", lambda scorer, text: texts.append(text) or [1, 2, 3])
    monkeypatch.setattr("treejax.scorers.judge.choice_logprobs", choices)
    monkeypatch.setattr("treejax.scorers.judge.judge_scores", lambda *a: pytest.fail("the judge ran"))
    monkeypatch.setattr("treejax.scorers.prm.step_scores", lambda *a: pytest.fail("the PRM ran"))
    ro = src.sample(params, jax.random.key(3), 0)
    m = ro.extra_metrics
    assert seen == [(1, tuple("0123456789"))]
    assert "Question: ABC" in texts[0] and "Step 2:\nB25OK" in texts[0] and "between 0 and 3" in texts[0]
    assert (m["search_r2/flagged"], m["search_r2/refined"], m["search_r2/first_turn_mean"]) == (1, 1, 1.0)
    f = jax.device_get(ro.forest)
    assert tok.decode(np.asarray(f.tokens)[0, 0, :5].tolist()) == "A15OK"  # turn 1 kept, the rest regenerated
    monkeypatch.setattr("treejax.scorers.judge.choice_logprobs",
                        lambda scorer, rows, options: np.array([[-0.1, -1.5, -0.5] + [-9.0] * 7], np.float32))
    ro = src.sample(params, jax.random.key(3), 0)
    assert ro.extra_metrics["search_r2/flagged"] == 0 and ro.extra_metrics["search_r2/refined"] == 0
    with pytest.raises(ConfigError, match="meta = 'index' reads one prompt.*fix:"):
        SearchR2Config(meta="index", index_template="{question} {steps}")


def test_shared_weights_read_the_meta_refiner_with_the_policys_current_weights(tiny, monkeypatch):
    """``shared_weights``: the Meta-Refiner's forward gets the params the step samples with (the paper's shared
    LLM), and no copy of the scorer is loaded; another scorer model is refused."""
    from treejax.scorers import ScorerConfig

    cfg_m, params, _ = tiny
    got = []
    src, _, tok = _source(tiny, monkeypatch, meta="index", regenerate="policy", shared_weights=True,
                          scorer=ScorerConfig(model="policy", yes_tokens=("Y",), no_tokens=("N",)))
    src.ctx.model_config = cfg_m
    monkeypatch.setattr("treejax.scorers.model.load_scorer", lambda *a: pytest.fail("a scorer copy was loaded"))
    monkeypatch.setattr(src, "_load", type(src)._load.__get__(src))  # the real loader: nothing to load here
    monkeypatch.setattr("treejax.scorers.judge.chat_ids", lambda scorer, text: [1, 2, 3])
    monkeypatch.setattr("treejax.scorers.judge.choice_logprobs", lambda scorer, rows, options: got.append(
        scorer.params) or np.array([[-0.1] + [-9.0] * 9] * len(rows), np.float32))
    src.sample(params, jax.random.key(3), 0)
    assert got and got[0] is params
    with pytest.raises(ConfigError, match="shared_weights .*ScorerConfig.model = 'policy'.*fix:"):
        SearchR2Config(shared_weights=True, scorer=ScorerConfig(model="smollm2-135m-instruct"))


# ------------------------------------------------------------------------------------- the whole loop
@pytest.mark.slow  # one step of the shipped config through treejax.train.main on the tiny model (92 s on 2 shared
# cores; judge, PRM and refiner the policy's frozen copy); the cut row's log-probs and masks are covered above
@pytest.mark.parametrize("meta", ["index", "judge_prm"])
def test_one_loop_step_of_the_shipped_config(tiny_checkpoint, tmp_path, meta):
    """The shipped config (meta = "index": the flag and the cut from one prompt's choice log-probs), and with
    meta = "judge_prm" and thresholds near 1 so that every episode is cut."""
    from treejax.testing.envs import run_shipped_multiturn

    forced = ("SearchR2Config.meta = 'judge_prm'", "SearchR2Config.discriminator_threshold = 0.99",
              "SearchR2Config.threshold = 0.99") if meta == "judge_prm" else ()
    last = run_shipped_multiturn(SHIPPED, tiny_checkpoint, tmp_path / "run", extra=forced + (
        "ScorerConfig.batch_size = 4", "MultiTurnConfig.max_turns = 2", "RunConfig.eval_every = 0"))
    assert last["search_r2/selected"] == 8 and last["search_r2/flagged"] == last["search_r2/refined"]
    assert meta == "index" or last["search_r2/refined"] >= 1
    assert np.isfinite(last["update/loss"]) and np.isfinite(last["search_r2/density_mean"])
