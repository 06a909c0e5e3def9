"""Ground-truth scoring pass (IGPO's pi(a | q, o_<=t)) and the igpo / a2tgpo estimators on hand-made turn forests.

The scoring pass is checked against one direct fp32 forward of the tiny model per (prompt, node) sequence; the
estimators against the loop references of ``info_gain_references`` on random turn forests (branching, duplicate
slots, observation tokens) and against hand-computed numbers.
"""

from __future__ import annotations

import functools

import info_gain_references as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.forest import forest_from_spans
from treejax.models import presets
from treejax.models import transformer as T
from treejax.rl import advantages as adv
from treejax.rl import info_gain as ig
from treejax.rl import losses
from treejax.rl.advantages.info_gain import A2TGPOOptions, IGPOOptions, a2tgpo_clip_scale
from treejax.rl.layouts import sequence_logprobs
from treejax.testing.forests import hand_turn_forest, lay_out_nodes, random_tree_paths

CFG = presets.tiny_config("qwen2.5-0.5b", true_vocab_size=250)
TOL = dict(rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- turn forests


def random_turn_forest(rng, P, W, D, max_len=3, T_len=None):
    """Random turn trees (:func:`random_tree_paths`: branching, early stops; plus duplicate slots) with random node
    lengths 1..max_len, tokens and policy masks (each node: >= 1 policy token, then maybe observation tokens)."""
    paths = np.stack([random_tree_paths(rng, W, D) for _ in range(P)])
    for p in range(P):  # duplicate slots: a slot copies another slot's path (both end at one node)
        for w in np.flatnonzero(rng.random(W) < 0.3):
            paths[p, w] = paths[p, rng.integers(W)]
    N = 1 + W * D  # static capacity (one compilation for every draw)
    node_length = rng.integers(1, max_len + 1, (P, N))
    node_tok = rng.integers(3, 250, (P, N, max_len))
    node_pm = (np.arange(max_len)[None, None, :] < rng.integers(1, max_len + 1, (P, N))[:, :, None])
    tok, pm = lay_out_nodes(paths, node_length, node_tok.astype(np.int32), node_pm.astype(np.float32),
                            width=T_len or D * max_len)
    return paths, node_length, tok, pm, forest_from_spans(paths, node_length, tok, policy_mask=pm)


# ------------------------------------------------------------------------------------------- scoring pass
@pytest.fixture(scope="module")
def params():
    return T.init_params(CFG, jax.random.key(3))


def _logprob_fn(params, tokens, positions, segment_ids):
    return sequence_logprobs(params, CFG, tokens, positions, segment_ids, chunk_size=64, attention_impl="xla")


@pytest.fixture(scope="module")
def scoring_case(params):
    """Two prompts (the hand tree and a random one padded to the same N), prompts and answers of different lengths,
    a prefix token that is not scored, and the reference values (one direct forward per used node)."""
    paths0, nl0, tok0, pm0, _ = hand_turn_forest()
    paths1, nl1, tok1, pm1, _ = random_turn_forest(np.random.default_rng(5), 1, 4, 3, T_len=8)
    N = max(nl0.shape[1], nl1.shape[1])
    pad = lambda x: np.pad(x, ((0, 0), (0, N - x.shape[1])))  # noqa: E731
    paths, nl = np.concatenate([paths0, paths1]), np.concatenate([pad(nl0), pad(nl1)])
    tok, pm = np.concatenate([tok0, tok1]), np.concatenate([pm0, pm1])
    forest = forest_from_spans(paths, nl, tok, policy_mask=pm)
    prompts = np.array([[5, 6, 7, 8], [9, 10, 0, 0]], np.int32)
    plen = np.array([4, 2], np.int32)
    answers, alen, scored = ig.answer_tokens(lambda s: [ord(c) for c in s], ["xyz", "q"], prefix="!")
    assert scored.tolist() == [[0, 1, 1, 1], [0, 1, 0, 0]]
    args = (prompts, plen, forest, answers, alen, scored)
    return args, ref.truth_logp(params, CFG, prompts, plen, paths, nl, tok, answers, alen, scored, N)


@pytest.mark.parametrize("how", ["scorer", pytest.param("chunks", marks=pytest.mark.slow)])
def test_truth_logprobs_match_direct_forwards(params, scoring_case, how):
    """Every used node's value equals a direct forward of its sequence (fp32, 1e-5); unused node slots are 0.
    ``scorer``: :func:`make_truth_scorer` (all rows at once); ``chunks``: rows in chunks of 5 under ``lax.map``."""
    args, want = scoring_case
    fn = (ig.make_truth_scorer(CFG, chunk_size=64) if how == "scorer"
          else jax.jit(functools.partial(ig.truth_logprobs, _logprob_fn, rows_per_call=5)))
    got = np.asarray(fn(params, *args))
    np.testing.assert_allclose(got, want, **TOL)
    used = np.asarray(ig.node_leaves(args[2])[1])
    assert np.all(got[~used] == 0.0) and np.all(got[used] < 0.0)


def test_truth_sequences_rows():
    """Rows hold prompt ++ path through the node ++ answer, right-padded to Lp + T + La; only answer tokens scored."""
    paths, nl, tok, pm, forest = hand_turn_forest()
    prompts, plen = np.array([[5, 6, 7]], np.int32), np.array([3], np.int32)
    answers, alen = np.array([[40, 41]], np.int32), np.array([2], np.int32)
    b = ig.truth_sequences(prompts, plen, forest, answers, alen)
    rows = np.asarray(b.tokens).reshape(1, 7, -1)
    assert rows.shape[-1] == 3 + 8 + 2
    assert rows[0, 0, :6].tolist() == [5, 6, 7, 40, 41, 0]  # root: prompt + answer
    assert rows[0, 3, :10].tolist() == [5, 6, 7, 70, 71, 72, 73, 74, 40, 41]  # n3 = w0's whole path
    assert rows[0, 5, :9].tolist() == [5, 6, 7, 80, 81, 82, 83, 40, 41]  # n5: through n2 and n5
    scored = np.asarray(b.scored).reshape(1, 7, -1)
    assert scored[0, 5].tolist() == [0] * 7 + [1, 1] + [0] * 4
    assert np.asarray(b.segment_ids).reshape(1, 7, -1)[0, 5].sum() == 9


# ------------------------------------------------------------------------------------------- estimators
HAND_V = np.array([[0.2, 0.5, 0.1, 0.6, 0.4, 0.3, 0.7]])  # pi(a | ...) of root, n1 .. n6
HAND_R = np.array([[1.0, 0.0, 1.0, 1.0]])


def test_igpo_hand_computed():
    """Turn rewards: w0 [IG(n1)=0.3, R=1], w1 [0.3, 0], w2/w3 [IG(n2)=-0.1, IG(n5)=0.2, 1]. Joint statistics of the
    10 entries: mean 0.38, var 0.1836, std + eps = sqrt(0.1836 + 1e-8) + 1e-6 = 0.4284867; r_hat(0.3) = -0.1867036,
    r_hat(1) = 1.4469527, r_hat(0) = -0.8868420, r_hat(-0.1) = -1.1202214, r_hat(0.2) = -0.4200830; gamma = 1 sums
    to go."""
    paths, nl, tok, pm, forest = hand_turn_forest()
    out = adv.get_estimator("igpo")(forest, jnp.asarray(HAND_R, jnp.float32), IGPOOptions(),
                                    truth_logp_PxN=jnp.log(jnp.asarray(HAND_V, jnp.float32)))
    a, one, zero, neg, b = -0.1867036, 1.4469527, -0.8868420, -1.1202214, -0.4200830
    want = np.array([[[a + one, one, 0.0], [a + zero, zero, 0.0], [neg + b + one, b + one, one],
                      [neg + b + one, b + one, one]]])
    np.testing.assert_allclose(np.asarray(out.segments), want, atol=2e-6)
    toks = np.asarray(out.tokens)[0]
    np.testing.assert_allclose(toks[0, :5], [want[0, 0, 0]] * 2 + [0.0] + [want[0, 0, 1]] * 2, atol=2e-6)
    assert np.all(toks[pm[0] == 0] == 0.0)  # observation tokens and padding
    np.testing.assert_array_equal(np.asarray(out.loss_mask), pm)


def test_a2tgpo_hand_computed():
    """Outcome: R = [1, 0, 1, 1], mean 0.75, std 0.433013 -> O = [0.5773489, -1.7320468, 0.5773489, 0.5773489]. Turn
    0 group IG = [0.3, 0.3, -0.1, -0.1] -> z = +-0.999995 (std 0.2 + eps); turn 1 group IG(n5) twice -> z = 0
    exactly. A(w0, 0) = O + 0.3 z; A(w2, 0) = O + 0.3 (z0 + z1) / sqrt(2); clip = 1 + 0.3 (2 sigmoid(z) - 1)."""
    paths, nl, tok, pm, forest = hand_turn_forest()
    R, truth = jnp.asarray(HAND_R, jnp.float32), jnp.log(jnp.asarray(HAND_V, jnp.float32))
    out = adv.get_estimator("a2tgpo")(forest, R, A2TGPOOptions(), truth_logp_PxN=truth)
    O, z = np.array([0.5773489, -1.7320468, 0.5773489, 0.5773489]), 0.2 / (0.2 + 1e-6)
    want = np.array([[[O[0] + 0.3 * z, O[0], 0.0], [O[1] + 0.3 * z, O[1], 0.0],
                      [O[2] - 0.3 * z / np.sqrt(2), O[2], O[2]], [O[3] - 0.3 * z / np.sqrt(2), O[3], O[3]]]])
    np.testing.assert_allclose(np.asarray(out.segments), want, atol=2e-6)
    c = 1 + 0.3 * (2 / (1 + np.exp(-z)) - 1)
    per_turn, per_token = a2tgpo_clip_scale(forest, R, A2TGPOOptions(), truth)
    np.testing.assert_allclose(np.asarray(per_turn), [[[c, 1, 1], [c, 1, 1], [2 - c, 1, 1], [2 - c, 1, 1]]],
                               atol=2e-6)
    np.testing.assert_allclose(np.asarray(per_token)[0, 0], [c, c, 1, 1, 1, 1, 1, 1], atol=2e-6)
    assert np.all(np.asarray(out.tokens)[0][pm[0] == 0] == 0.0)


IGPO_CASES = [IGPOOptions(), IGPOOptions(normalization="separate", gamma=0.8),
              IGPOOptions(info_gain="log_prob_diff", scale_by_std=False, info_gain_coef=0.5)]
A2TGPO_CASES = [A2TGPOOptions(), A2TGPOOptions(gamma=0.9, alpha=1.0, clip_beta=0.2, info_gain="log_prob_diff"),
                A2TGPOOptions(scale_by_std=False)]


@functools.lru_cache(maxsize=None)
def _jitted(name, options):
    fn = adv.get_estimator(name)
    return jax.jit(lambda f, r, t: fn(f, r, options, truth_logp_PxN=t))


@pytest.mark.parametrize("case", range(3))
def test_estimators_match_reference_on_random_turn_forests(case):
    """Random turn forests (3 prompts x 6 slots, depth <= 3: branching, early stops, duplicate slots, observation
    tokens), random truth log-probs and rewards (ties included), transfer-allocation leaf weights: jitted igpo and
    a2tgpo (advantages, tokens, clip scales) equal the loop references."""
    rng = np.random.default_rng(100 + case)
    for _ in range(4):
        paths, nl, tok, pm, forest = random_turn_forest(rng, 3, 6, 3)
        P, N = forest.node_parent.shape
        truth = np.log(rng.uniform(0.05, 0.95, (P, N))).astype(np.float32)
        R = rng.choice([0.0, 0.5, 1.0], (P, 6)).astype(np.float32)
        lw = np.asarray(forest.leaf_weights())
        T_len = forest.tokens.shape[-1]
        o = IGPO_CASES[case]
        out = _jitted("igpo", o)(forest, jnp.asarray(R), jnp.asarray(truth))
        want = ref.igpo_turns(paths, R, truth.astype(np.float64), lw, o)
        np.testing.assert_allclose(np.asarray(out.segments), want, **TOL)
        np.testing.assert_allclose(np.asarray(out.tokens), ref.turn_tokens(paths, nl, pm, want, T_len), **TOL)
        o = A2TGPO_CASES[case]
        out = _jitted("a2tgpo", o)(forest, jnp.asarray(R), jnp.asarray(truth))
        want, clip = ref.a2tgpo_turns(paths, R, truth.astype(np.float64), lw, o)
        np.testing.assert_allclose(np.asarray(out.segments), want, **TOL)
        np.testing.assert_allclose(np.asarray(out.tokens), ref.turn_tokens(paths, nl, pm, want, T_len), **TOL)
        per_turn, per_token = jax.jit(a2tgpo_clip_scale, static_argnums=2)(forest, jnp.asarray(R), o,
                                                                          jnp.asarray(truth))
        np.testing.assert_allclose(np.asarray(per_turn), clip, **TOL)
        np.testing.assert_allclose(np.asarray(per_token), ref.turn_tokens(paths, nl, pm, clip, T_len, fill=1.0),
                                   **TOL)


def test_registry_and_option_validation():
    for name in ("igpo", "a2tgpo"):
        assert adv.estimator_spec(name).inputs == ("truth_logp_PxN",)
    for bad in (dict(info_gain="ratio"), dict(gamma=1.5), dict(eps=0.0), dict(normalization="turn-group")):
        with pytest.raises(ValueError):
            IGPOOptions(**bad)
    for bad in (dict(alpha=-0.1), dict(clip_beta=1.0), dict(gamma=-0.1), dict(info_gain="x")):
        with pytest.raises(ValueError):
            A2TGPOOptions(**bad)
    *_, forest = hand_turn_forest()
    with pytest.raises(ValueError, match="truth_logp_PxN"):
        adv.get_estimator("igpo")(forest, jnp.zeros((1, 4)), IGPOOptions(), truth_logp_PxN=jnp.zeros((1, 5)))
    with pytest.raises(ValueError, match="no tokens"):
        ig.answer_tokens(lambda s: [ord(c) for c in s], ["ok", ""])
    with pytest.raises(ValueError, match="max_length"):
        ig.answer_tokens(lambda s: [ord(c) for c in s], ["long"], max_length=3)


# ------------------------------------------------------------------------------------------- loss
def test_policy_loss_per_token_clip_scale():
    """eps_scale_BxT scales each token's clip range: equals a hand-written per-token PPO-clip; all-ones equals none;
    a row-constant BxT equals eps_scale_B."""
    rng = np.random.default_rng(0)
    B, L = 3, 6
    logp = jnp.asarray(rng.normal(-1, 0.5, (B, L)), jnp.float32)
    old = logp + jnp.asarray(rng.normal(0, 0.3, (B, L)), jnp.float32)
    A = jnp.asarray(rng.normal(0, 1, (B, L)), jnp.float32)
    mask = jnp.asarray(rng.random((B, L)) < 0.8, jnp.float32)
    scale = jnp.asarray(rng.uniform(0.7, 1.3, (B, L)), jnp.float32)
    cfg = losses.LossConfig(eps_low=0.2, eps_high=0.28)
    loss, m = losses.policy_loss(logp, old, A, mask, cfg, eps_scale_BxT=scale)
    r = np.exp(np.asarray(logp - old, np.float64))
    s, a, mk = np.asarray(scale, np.float64), np.asarray(A, np.float64), np.asarray(mask, np.float64)
    pg = np.maximum(-a * r, -a * np.clip(r, 1 - 0.2 * s, 1 + 0.28 * s))
    np.testing.assert_allclose(float(loss), (pg * mk).sum() / mk.sum(), rtol=1e-5)
    assert float(m["clip_frac_high"]) == pytest.approx(((a > 0) & (r > 1 + 0.28 * s) & (mk > 0)).sum() / mk.sum())
    base, _ = losses.policy_loss(logp, old, A, mask, cfg)
    ones, _ = losses.policy_loss(logp, old, A, mask, cfg, eps_scale_BxT=jnp.ones((B, L)))
    assert float(ones) == float(base)
    row = jnp.asarray([0.5, 1.0, 1.5], jnp.float32)
    by_row, _ = losses.policy_loss(logp, old, A, mask, cfg, eps_scale_B=row)
    by_tok, _ = losses.policy_loss(logp, old, A, mask, cfg, eps_scale_BxT=jnp.broadcast_to(row[:, None], (B, L)))
    assert float(by_row) == float(by_tok)
    with pytest.raises(ValueError, match="eps_scale_BxT"):
        losses.policy_loss(logp, old, A, mask, cfg, eps_scale_BxT=jnp.ones((B,)))
