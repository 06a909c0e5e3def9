"""Search-R2: the evidence-density term against a slow pure-Python reference, the meta-refiner's cut and
regeneration of a multi-turn episode on tiny random models (the refiner's tokens with their behaviour log-probs,
the policy's continuation with its own), the config checks, and (slow) one loop step of the shipped config."""

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.rl.judges.evidence import chunk_usage, evidence_density, hybrid_rewards, usage_arrays, words
from treejax.rl.judges.search_r2 import SearchR2Config, SearchR2Rollouts, cut_at_stop, node_lengths

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
    assert planner.environment == "retrieval" and stage.regenerate == "refiner" and stage.density_coef == 0.2
    assert cfg.loss.tis_cap == 2.0 and cfg.old_logp == "trainer" and not cfg.dynamic_sampling
    for bad, match in ((["LossConfig.tis_cap = None"], "or SearchR2Config.regenerate = 'policy'"),
                       (["RunConfig.packed_update = True"], "fix: RunConfig.packed_update = False"),
                       (["SearchR2Config.refines_per_prompt = 9"], "exceeds the 8 episodes"),
                       (["RunConfig.rollouts = [@SearchR2Config()]"], "turn_forest"),
                       (["RunConfig.estimator = 'matchtir'"], "does not supply")):
        with pytest.raises(ConfigError, match=match) as e:
            train.parse([path], bad)
        assert "\n" not in str(e.value)
    on_policy = train.parse([path], ["LossConfig.tis_cap = None", "RunConfig.old_logp = 'sampler'",
                                     "SearchR2Config.regenerate = 'policy'"])
    assert on_policy.rollouts[1].regenerate == "policy"


def test_trees_of_turns_are_refused_at_build():
    from treejax.rl.multiturn import MultiTurnConfig

    inner = types.SimpleNamespace(config=MultiTurnConfig(roots=2), make_env=lambda: None)
    ctx = types.SimpleNamespace(cfg=types.SimpleNamespace(rollout=types.SimpleNamespace(num_leaves=4)))
    with pytest.raises(ConfigError, match="fix: MultiTurnConfig.roots = None"):
        SearchR2Config().build(inner, ctx)
