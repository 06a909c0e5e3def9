"""InfoPO (treejax.rl.info_gain.feedback_gains, treejax.rl.advantages.info_gain.infopo): the counterfactual scoring
pass against one direct forward per (node, version) of the tiny model, the estimator against a slow plain-Python
reference on the hand-made turn forest (numbers written out) and on random turn forests, the multi-turn source
supplying ``feedback_gain_PxN``, and the option / config errors."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.forest import forest_from_spans
from treejax.models import presets
from treejax.models import transformer as T
from treejax.rl import info_gain as ig
from treejax.rl.advantages import InfoPOOptions, estimator_spec, infopo
from treejax.rl.advantages.info_gain import infopo_turns
from treejax.testing.forests import hand_turn_forest, lay_out_nodes, random_tree_paths
from treejax.testing.envs import run_shipped_multiturn

CFG = presets.tiny_config("qwen2.5-0.5b", true_vocab_size=250)


# ------------------------------------------------------------------------------------------- slow references
def ref_infopo(paths, policy_mask, node_length, rewards, gains, o: InfoPOOptions, weights=None):
    """Plain Python, one slot / turn at a time, from the formula in :func:`infopo`'s docstring. ``gains``: {(p, node):
    g}; ``weights`` [P, W]: the leaves' weights (``Forest.leaf_weights``; default all 1, the slot trees treejax
    samples). Returns (A [P, W, D], gate [P], ratio)."""
    P, W, D1 = paths.shape
    D = D1 - 1
    lw = np.ones((P, W)) if weights is None else np.asarray(weights, np.float64)
    turns = {(p, w): [int(n) for n in paths[p, w, 1:] if n >= 0] for p in range(P) for w in range(W)}

    def stats(xs, ws):  # weighted mean and population std
        m = sum(w * x for x, w in zip(xs, ws)) / sum(ws)
        return m, math.sqrt(sum(w * (x - m) ** 2 for x, w in zip(xs, ws)) / sum(ws))

    outcome, intr, gate = {}, {}, []
    for p in range(P):
        R = [float(rewards[p, w]) for w in range(W)]
        m, sd = stats(R, lw[p])
        std = 1.0 if W <= 1 else math.sqrt(sd ** 2 + 1e-8)
        for w in range(W):
            outcome[(p, w)] = (R[w] - m) / (std + o.eps)
        gate.append(1.0 / (1.0 + math.exp(sd / o.gate_temperature)))
        entries = [(w, t, gains[(p, ns[t + 1])]) for w in range(W) for ns in [turns[(p, w)]]
                   for t in range(len(ns) - 1) if (p, ns[t + 1]) in gains]
        if entries:
            mi, si = stats([g for _, _, g in entries], [lw[p, w] for w, _, _ in entries])
            si = 1.0 if len(entries) <= 1 else math.sqrt(si ** 2 + 1e-8)
            for w, t, g in entries:
                intr[(p, w, t)] = (g - mi) / (si + o.eps)
    # token-level stds over the policy tokens of the batch (each token weighted by its leaf's weight)
    tok_o, tok_i, tok_w = [], [], []
    for p in range(P):
        for w in range(W):
            for t, n in enumerate(turns[(p, w)]):
                start = sum(node_length[p, x] for x in turns[(p, w)][:t])
                k = int(sum(policy_mask[p, w, start + j] for j in range(node_length[p, n])))
                tok_o += [outcome[(p, w)]] * k
                tok_i += [intr.get((p, w, t), 0.0)] * k
                tok_w += [lw[p, w]] * k
    ratio = min(1.0, max(stats(tok_o, tok_w)[1] + o.eps, o.baseline_std) / (stats(tok_i, tok_w)[1] + o.eps))
    A = np.zeros((P, W, D))
    for p in range(P):
        for w in range(W):
            for t in range(len(turns[(p, w)])):
                A[p, w, t] = outcome[(p, w)] + o.intrinsic_weight * gate[p] * ratio * intr.get((p, w, t), 0.0)
    return A, np.array(gate), ratio


HAND_G = {(0, 3): 0.5, (0, 4): -0.1, (0, 5): 0.3, (0, 6): 0.2}  # n1, n2 are first turns: no gain


def _hand_gain_array():
    g = np.full((1, 7), np.nan, np.float32)
    for (p, n), v in HAND_G.items():
        g[p, n] = v
    return g


def test_infopo_hand_computed():
    """The hand forest (w0: n1 n3, w1: n1 n4, w2 = w3: n2 n5 n6), gains g(n3..n6) = 0.5, -0.1, 0.3, 0.2.

    Turn gains (turn t gets g(node_{t+1})): w0 [0.5, -], w1 [-0.1, -], w2/w3 [0.3, 0.2, -]; the six entries have
    mean 1.4 / 6 = 0.2333333, var 0.1933333 / 6 = 0.0322222, std + eps = 0.1795065, so Ĩ = 1.4855542 (0.5),
    -1.8569427 (-0.1), 0.3713885 (0.3), -0.1856943 (0.2).

    Tied outcomes (R = 1 everywhere): O = 0, gate = sigmoid(0) = 0.5, s_O = eps, so the bound's target is
    baseline_std; the 15 policy tokens (w0: 2 + 2, w1: 2 + 1, w2, w3: 1 + 1 + 2) carry Ĩ = [1.4855542 x2, 0 x2,
    -1.8569427 x2, 0, (0.3713885, -0.1856943, 0, 0) x2]: mean -0.0247592, std 0.8811297, so with baseline_std =
    1: ratio 1 and A = 0.1 * 0.5 * Ĩ; with baseline_std = 0.5: ratio = 0.5 / 0.8811307 = 0.5674527.

    Mixed outcomes (R = 1, 0, 1, 1): O = 0.5773489, -1.7320467; std_p R = 0.4330127, gate = sigmoid(-8.6602540) =
    1.7331e-4; s_O = 0.9237583 -> target 1, ratio 1."""
    paths, nl, tok, pm, forest = hand_turn_forest()
    g = _hand_gain_array()
    i_a, i_b, i_c, i_d = 1.4855542, -1.8569427, 0.3713885, -0.1856943

    tied = np.ones((1, 4), np.float32)
    out = infopo(forest, jnp.asarray(tied), feedback_gain_PxN=jnp.asarray(g))
    want = 0.05 * np.array([[[i_a, 0, 0], [i_b, 0, 0], [i_c, i_d, 0], [i_c, i_d, 0]]])
    np.testing.assert_allclose(np.asarray(out.segments), want, atol=2e-6)
    ref, gate, ratio = ref_infopo(paths, pm, nl, tied, HAND_G, InfoPOOptions())
    np.testing.assert_allclose(ref, want, atol=2e-6)
    assert gate[0] == 0.5 and ratio == 1.0
    toks = np.asarray(out.tokens)[0]
    np.testing.assert_allclose(toks[0, :5], [0.05 * i_a] * 2 + [0.0] + [0.0] * 2, atol=2e-6)
    assert np.all(toks[pm[0] == 0] == 0.0)  # observation tokens and padding

    o = InfoPOOptions(baseline_std=0.5)
    _, parts = infopo_turns(forest, jnp.asarray(tied), o, jnp.asarray(g))
    assert float(parts["ratio"]) == pytest.approx(0.5674527, abs=1e-6)
    ref, _, ratio = ref_infopo(paths, pm, nl, tied, HAND_G, o)
    assert ratio == pytest.approx(0.5674527, abs=1e-6)
    np.testing.assert_allclose(np.asarray(infopo(forest, jnp.asarray(tied), o, feedback_gain_PxN=g).segments), ref,
                               atol=2e-6)

    mixed = np.array([[1.0, 0.0, 1.0, 1.0]], np.float32)
    out = infopo(forest, jnp.asarray(mixed), feedback_gain_PxN=jnp.asarray(g))
    gate = 1.0 / (1.0 + math.exp(8.6602540))
    assert gate == pytest.approx(1.7331e-4, rel=1e-4)
    oa, ob = 0.5773489, -1.7320467
    want = np.array([[[oa + 0.1 * gate * i_a, oa, 0], [ob + 0.1 * gate * i_b, ob, 0],
                      [oa + 0.1 * gate * i_c, oa + 0.1 * gate * i_d, oa], [oa + 0.1 * gate * i_c,
                                                                         oa + 0.1 * gate * i_d, oa]]])
    np.testing.assert_allclose(np.asarray(out.segments), want, atol=2e-6)
    np.testing.assert_allclose(ref_infopo(paths, pm, nl, mixed, HAND_G, InfoPOOptions())[0], want, atol=2e-6)


def random_turn_forest(rng, P, W, D, max_len=3):
    paths = np.stack([random_tree_paths(rng, W, D) for _ in range(P)])
    N = 1 + W * D
    node_length = rng.integers(1, max_len + 1, (P, N))
    node_tok = rng.integers(3, 250, (P, N, max_len))
    node_pm = (np.arange(max_len)[None, None, :] < rng.integers(1, max_len + 1, (P, N))[:, :, None])
    tok, pm = lay_out_nodes(paths, node_length, node_tok.astype(np.int32), node_pm.astype(np.float32),
                            width=D * max_len)
    return paths, node_length, tok, pm, forest_from_spans(paths, node_length, tok, policy_mask=pm)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_infopo_matches_the_reference_on_random_forests(seed):
    """Random branching turn forests (3 prompts x 4 slots, depth 3; leaves weighted by their path mass), random gains
    on random nodes (NaN elsewhere), rewards tied on one prompt: estimator == plain-Python reference (1e-5)."""
    rng = np.random.default_rng(seed)
    paths, nl, tok, pm, forest = random_turn_forest(rng, 3, 4, 3)
    N = nl.shape[1]
    g = np.where(rng.random((3, N)) < 0.7, rng.normal(0, 0.5, (3, N)), np.nan).astype(np.float32)
    g[:, 0] = np.nan
    gains = {(p, n): float(g[p, n]) for p in range(3) for n in range(N) if np.isfinite(g[p, n])}
    R = rng.integers(0, 2, (3, 4)).astype(np.float32)
    R[0] = 1.0
    for o in (InfoPOOptions(), InfoPOOptions(intrinsic_weight=1.0, baseline_std=0.1, gate_temperature=1.0)):
        want = ref_infopo(paths, pm, nl, R, gains, o, np.asarray(forest.leaf_weights()))[0]
        got = np.asarray(infopo(forest, jnp.asarray(R), o, feedback_gain_PxN=jnp.asarray(g)).segments)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_infopo_options_and_shape_errors():
    assert estimator_spec("infopo").inputs == ("feedback_gain_PxN",)
    with pytest.raises(ValueError, match="intrinsic_weight must be a finite number >= 0"):
        InfoPOOptions(intrinsic_weight=-0.1)
    with pytest.raises(ValueError, match="gate_temperature must be > 0"):
        InfoPOOptions(gate_temperature=0.0)
    with pytest.raises(ValueError, match="eps must be > 0"):
        InfoPOOptions(eps=0.0)
    _, _, _, _, forest = hand_turn_forest()
    with pytest.raises(ValueError, match=r"feedback_gain_PxN has shape \(1, 3\), the forest has"):
        infopo(forest, jnp.ones((1, 4)), feedback_gain_PxN=jnp.zeros((1, 3)))


# ------------------------------------------------------------------------------------------- the scoring pass
def test_feedback_gains_match_direct_forwards():
    """Every node with a gain: the mean over its policy tokens of log pi(with the parent's observation) - log
    pi(the observation replaced by the placeholder, padded with its last token or cut), each sequence one direct
    fp32 forward of the tiny model; nodes without a gain (root, first turns) are NaN."""
    params = T.init_params(CFG, jax.random.key(3))
    paths, nl, tok, pm, forest = hand_turn_forest()
    prompts, plen = np.array([[5, 6, 7]], np.int32), np.array([3], np.int32)
    placeholder = np.array([90, 91], np.int32)
    got = np.asarray(ig.make_feedback_scorer(CFG, chunk_size=64)(params, prompts, plen, forest, placeholder))
    width = 16

    @jax.jit
    def seq_logp(x):
        h = T.forward(params, CFG, x, jnp.arange(width, dtype=jnp.int32)[None])
        return jax.nn.log_softmax(T.logits(params, CFG, h).astype(jnp.float32), axis=-1)[0]

    # (node, leaf slot, parent span [start, end), own span) on the hand forest
    cases = {3: (0, (0, 3), (3, 5)), 4: (1, (0, 3), (3, 4)), 5: (2, (0, 2), (2, 4)), 6: (2, (2, 4), (4, 6))}
    for n, (w, (ps, pe), (s, e)) in cases.items():
        resp = list(tok[0, w, :e])
        masked = list(resp)
        obs = [i for i in range(ps, pe) if pm[0, w, i] == 0]
        for k, i in enumerate(obs):
            masked[i] = int(placeholder[min(k, len(placeholder) - 1)])
        lp = lambda r: np.asarray(seq_logp(jnp.asarray([[5, 6, 7] + r + [0] * (width - 3 - len(r))])),  # noqa: E731
                                  np.float64)
        a, b = lp(resp), lp(masked)
        own = [i for i in range(s, e) if pm[0, w, i] > 0]
        want = np.mean([a[3 + i - 1, resp[i]] - b[3 + i - 1, resp[i]] for i in own])
        assert got[0, n] == pytest.approx(want, abs=1e-5), n
        assert abs(want) > 1e-4  # the masking changed something
    assert np.all(np.isnan(got[0, :3]))


@pytest.mark.slow  # a tiny model's multi-turn rollout and two scoring forwards: ~40 s on the shared 2-core machine;
# the default run covers the pass itself (test_feedback_gains_match_direct_forwards) and the estimator
def test_the_multiturn_source_supplies_feedback_gains():
    """Through a tiny model's rollout with the scripted tool env (two tool turns answered "OK", then the answer):
    ``feedback_gain_PxN`` is finite exactly on the nodes of depth >= 2 whose parent turn got an observation, and
    the estimator runs on it."""
    import functools

    import types

    from treejax.rl.multiturn import MultiTurnConfig, MultiTurnRollouts
    from treejax.testing.envs import ScriptedToolEnv, tiny_multiturn_base

    examples = [types.SimpleNamespace(metadata={}, ground_truth="1") for _ in range(2)]
    base, params = tiny_multiturn_base(examples)
    cfg = presets.tiny_config("smollm2-135m", vocab_size=64)
    src = MultiTurnRollouts(base, MultiTurnConfig(max_turns=3, turn_tokens=6, chunk=6),
                            make_env=functools.partial(ScriptedToolEnv, 2), estimator_inputs=("feedback_gain_PxN",),
                            model_config=cfg, feedback_placeholder="NONE")
    ro = src.sample(params, jax.random.key(0), 0)
    g = np.asarray(ro.estimator_inputs["feedback_gain_PxN"])
    f = ro.forest
    depth = np.asarray(f.node_depth)
    used = np.asarray(ig.node_leaves(f)[1])
    assert g.shape == depth.shape
    assert np.all(np.isnan(g[depth < 2]))
    deep = used & (depth >= 2)
    assert deep.any() and np.all(np.isfinite(g[deep]))  # every deeper turn follows an "OK" observation
    assert ro.extra_metrics["multiturn/feedback_turns"] == int(deep.sum())
    out = infopo(f, ro.rewards_PxW, feedback_gain_PxN=g)
    assert np.all(np.isfinite(np.asarray(out.tokens)))


def test_config_checks_name_the_fix():
    from treejax.rl.config import RunConfig
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.sampling import tree

    chains = tree.independent_config(4, 64, 16)
    RunConfig(rollouts=[MultiTurnConfig(environment="simulated_user")], rollout=chains, task="user_goals",
              estimator="infopo")
    with pytest.raises(ConfigError, match="does not supply; fix: .*MultiTurnConfig"):
        RunConfig(rollout=chains, task="user_goals", estimator="infopo")
    with pytest.raises(ConfigError, match="not 'chain_sum_2x1'; fix: RunConfig.task = 'user_goals'"):
        RunConfig(rollouts=[MultiTurnConfig(environment="simulated_user")], rollout=chains, estimator="grpo")


@pytest.mark.slow  # one RL step of the whole loop on tiny random models: ~2-3 min on the shared 2-core machine; the
# default run covers its parts (test_infopo_hand_computed, test_feedback_gains_match_direct_forwards and
# tests/envs/test_simulated_user.py::test_the_model_user_replies_through_the_sampler)
def test_the_shipped_infopo_config_runs_one_step(tiny_checkpoint, tmp_path):
    """configs/multiturn_user_infopo.gin end to end (goals, the model user loaded by load_model and decoded by the
    sampler, trees of turns with cloned environments, the counterfactual pass, the estimator, the update, the
    evaluation with the environment) for one step, the policy and the user both a tiny random model with SmolLM2's
    tokenizer."""
    options = ("{'size': 8, 'eval_size': 4, 'seed': 0, 'revealed': 1, 'user': 'model', 'user_model': "
               f"'{tiny_checkpoint}', 'user_max_tokens': 4, 'extraction': 'answer_line'}}")
    last = run_shipped_multiturn("multiturn_user_infopo.gin", tiny_checkpoint, tmp_path / "run",
                                 (f"RunConfig.task_options = {options}", "MultiTurnConfig.roots = 2",
                                  "TreeConfig.max_depth = 8", "TreeConfig.segment_length = 16"))
    assert "multiturn/feedback_turns" in last
