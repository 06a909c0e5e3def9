"""The tree-packed update on turn forests: nodes are token spans of any length (a multi-turn tree's turns: the
policy's tokens, then the environment's observation tokens), read from ``Forest.spans()``.

Forests from :func:`treejax.forest.forest_from_spans` with branching at every depth, nodes of 1 token and long
ones, a node with children that holds one token, a leaf that ends at a node other leaves continue through,
duplicate leaf slots (a slot tree's copies) and observation tokens (``policy_mask`` 0) inside nodes, last nodes
included. Checked: the packed rows hold each node once, at the positions, predictors and attention of the
expanded rows; the packed forward's per-token log-probs and the policy loss's value, metrics and gradients equal
the expanded batch's; observation tokens are in the forward but never in the loss; a fixed-segment forest packs
exactly as before spans existed.

Tolerance: as tests/rl/test_packing.py (fp32; ``highest`` matmul precision on a GPU, tests/conftest.py): loss and
metrics ``rtol=1e-5``, gradients ``|g_packed - g| <= 1e-5 |g|`` per parameter, log-probs ``rtol=atol=1e-5``.
Changes at masked (observation) pairs must leave the loss and gradients bit-identical: the loss replaces masked
values before any arithmetic.
"""

import dataclasses
import hashlib
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.forest import forest_from_spans
from treejax.models import presets
from treejax.models import transformer as T
from treejax.models.tree_attention import tree_mask
from treejax.rl import losses, packing
from treejax.rl.batch import TreeInputs, expanded_batch, forest_to_batch, response_to_sequence
from treejax.rl.layouts import Expanded, Packed
from treejax.rl.update import make_grad_fn
from treejax.testing.forests import lay_out_nodes, random_forest, random_tree_paths, with_copies

CFG = presets.tiny_config("qwen2.5-0.5b", true_vocab_size=250)
P, W, D, TR, LP = 2, 6, 4, 48, 6  # every span forest here has these shapes: one compile per layout
PROMPTS = np.random.RandomState(3).randint(60, 250, (P, LP)).astype(np.int32)
LENGTHS = np.array([5, 3], np.int32)
ROWS = packing.PackingConfig(row_length=160, max_trees_per_row=1, attention_impl="xla")  # R = 2, Wr = W always
EXPANDED = Expanded(CFG, attention_impl="xla")
PACKED = Packed(CFG, ROWS)
LOSS = losses.LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, kl_coef=0.05, kl_estimator="k3",
                         entropy_coef=0.01, tis_cap=1.5)
METRICS = ("loss", "pg_loss", "num_tokens", "entropy", "kl", "tis_weight_mean", "clip_frac_low", "clip_frac_high",
           "approx_kl", "ratio_mean", "ratio_max", "ratio_min")

# ----------------------------------------------------------------------------------------------- turn forests
# Prompt 0: root -> {1, 6}; 1 -> {2, 3}; 2 -> {4, 5}; 5 -> {7, 8}; leaves 2 and 3 are copies (node 3).
# Prompt 1: root -> {1, 2}; 2 -> {3, 4}; 3 -> 5; leaf 1 ends at node 3, which leaf 4 continues through (a
# one-token node with a child); leaves 2 / 3 and 0 / 5 are copies.
HAND_PATHS = np.array([
    [[0, 1, 2, 4, -1], [0, 1, 2, 5, 7], [0, 1, 3, -1, -1], [0, 1, 3, -1, -1], [0, 6, -1, -1, -1], [0, 1, 2, 5, 8]],
    [[0, 1, -1, -1, -1], [0, 2, 3, -1, -1], [0, 2, 4, -1, -1], [0, 2, 4, -1, -1], [0, 2, 3, 5, -1],
     [0, 1, -1, -1, -1]]])
# per node: (length, policy tokens first; the rest are observation tokens)
HAND_NODES = [{1: (7, 5), 2: (1, 1), 3: (12, 4), 4: (3, 3), 5: (6, 3), 6: (1, 1), 7: (9, 9), 8: (2, 1)},
              {1: (15, 15), 2: (4, 2), 3: (1, 1), 4: (5, 5), 5: (8, 3)}]


def _node_arrays(paths, nodes, seed):
    """Per node: length, policy count, token ids and sampler log-probs (leaves through a node share them)."""
    num_nodes = int(paths.max()) + 1
    rng = np.random.default_rng(seed)
    length = np.zeros((P, num_nodes), np.int64)
    policy = np.zeros((P, num_nodes), np.int64)
    for p in range(P):
        for n, (m, k) in nodes[p].items():
            length[p, n], policy[p, n] = m, k
    return {"path": paths, "length": length, "policy": policy,
            "tokens": rng.integers(3, 250, (P, num_nodes, TR)), "logp": -rng.exponential(1.0, (P, num_nodes, TR))}


def _forest(arr):
    """The turn forest of node arrays: each leaf's response is its path's nodes' tokens in order; policy_mask 1
    on each node's first ``policy`` tokens, 0 on its observation tokens."""
    paths, length = arr["path"], arr["length"]
    node_pm = (np.arange(arr["tokens"].shape[2])[None, None, :] < arr["policy"][:, :, None]).astype(np.float32)
    tokens, logp, pm = lay_out_nodes(paths, length, arr["tokens"].astype(np.int32), arr["logp"].astype(np.float32),
                                     node_pm, width=TR)
    return forest_from_spans(paths, length, tokens, logp, pm)


def _random_nodes(seed):
    """Random trees (branching at any depth, early stops, copied leaves) with random node lengths in
    {1, 2, 3, 5, 8, 12} and at least one policy token per node (sometimes all)."""
    rng = np.random.default_rng(seed)
    paths = np.stack([random_tree_paths(rng, W, D, max_branch=3, stop_prob=0.3) for _ in range(P)])
    for p in range(P):
        for w in range(1, W):
            if rng.random() < 0.3:
                paths[p, w] = paths[p, w - 1]
    nodes = []
    for p in range(P):
        ids = np.unique(paths[p][paths[p] > 0])
        m = rng.choice([1, 2, 3, 5, 8, 12], len(ids))
        k = np.where(rng.random(len(ids)) < 0.3, m, rng.integers(1, m + 1))
        nodes.append({int(n): (int(a), int(b)) for n, a, b in zip(ids, m, k)})
    return _node_arrays(paths, nodes, seed + 100)


def _hand():
    return _node_arrays(HAND_PATHS, HAND_NODES, 0)


def _inputs(forest, seed=0):
    """Per-token advantages (a different value on every pair, 0 off the loss mask) and per-pair old / reference /
    sampler log-probs that differ (so every ratio, KL and TIS term is active), a per-leaf clip scale."""
    rng = np.random.default_rng(seed)
    mask = np.asarray(forest.loss_mask)
    adv = (rng.normal(0, 1, mask.shape) * mask).astype(np.float32)
    smp = np.asarray(forest.logprobs)
    noise = lambda s: (smp + rng.normal(0, s, smp.shape)).astype(np.float32)  # noqa: E731
    return adv, noise(0.3), noise(0.2), noise(0.1), rng.uniform(0.5, 2.0, (P, W)).astype(np.float32)


def _batches(forest, adv, old, ref, smp, eps, loss_mask=None):
    """The expanded and the packed batch of the same leaves and per-pair inputs."""
    lens = jnp.asarray(LENGTHS)
    mask = None if loss_mask is None else jnp.asarray(loss_mask)
    batch = forest_to_batch(jnp.asarray(PROMPTS), lens, forest, jnp.asarray(adv), mask, eps_scale_PxW=jnp.asarray(eps))
    L = batch["tokens"].shape[1]
    for k, v in (("old_logp", old), ("ref_logp", ref), ("sampler_logp", smp)):
        batch[k] = response_to_sequence(jnp.asarray(v), lens, L)
    packed = packing.forest_to_packed(PROMPTS, LENGTHS, forest, jnp.asarray(adv), mask, eps_scale_PxW=eps,
                                      config=ROWS)
    flat = lambda x: jnp.asarray(x).reshape(P * W, TR)  # noqa: E731
    packed = packed.replace(old_logp=packing.pack_pairs(packed.inputs, flat(old)),
                            ref_logp=packing.pack_pairs(packed.inputs, flat(ref)),
                            sampler_logp=packing.pack_pairs(packed.inputs, flat(smp)))
    return expanded_batch(batch), packed


_GRAD_FNS = {}


def _grads(params, batch):
    lay = PACKED if isinstance(batch.inputs, TreeInputs) else EXPANDED
    if lay not in _GRAD_FNS:
        _GRAD_FNS[lay] = jax.jit(make_grad_fn(lay, LOSS))
    loss, metrics, grads = _GRAD_FNS[lay](params, batch)
    return jax.device_get((dict(metrics, loss=loss), grads))


def _assert_grads_close(g_packed, g_ref, rtol=1e-5):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_packed), jax.tree.leaves(g_ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err, norm = np.linalg.norm(a - b), np.linalg.norm(b)
        assert err <= rtol * norm + 1e-12, (jax.tree_util.keystr(path), err, norm)


def _assert_same(m, g, m_ref, g_ref, exact=False):
    for k in METRICS:
        if exact:
            assert np.array_equal(m[k], m_ref[k]), (k, m[k], m_ref[k])
        else:
            np.testing.assert_allclose(float(m[k]), float(m_ref[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    if exact:
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            np.testing.assert_array_equal(a, b)
    else:
        _assert_grads_close(g, g_ref)


@pytest.fixture(scope="module")
def params():
    return T.init_params(CFG, jax.random.key(1))


# ----------------------------------------------------------------------------------------------- the layout
def test_hand_forest_is_a_turn_forest():
    """The fixture's forest is what the tests claim: spans of 1 to 15 tokens, observation tokens in the loss
    mask's zeros, a one-token node with a child, copies, T not a multiple of any segment length."""
    f = _forest(_hand())
    span = np.asarray(f.spans())
    assert not f.fixed_segments and span[0, 3, 1] == 12 and span[0, 2, 1] == 1 and span[1, 1, 1] == 15
    np.testing.assert_array_equal(span[0, 7], [14, 9])  # 7 + 1 + 6 tokens before node 7
    np.testing.assert_array_equal(np.asarray(f.leaf_length), [[11, 23, 19, 19, 1, 16], [15, 5, 9, 9, 13, 15]])
    mask, pm = np.asarray(f.loss_mask), np.asarray(f.policy_mask)
    np.testing.assert_array_equal(mask, pm)
    np.testing.assert_array_equal(mask[0, 2, :19], [1] * 5 + [0] * 2 + [1] * 4 + [0] * 8)
    assert not np.asarray(f.distinct_leaves()).all()


@pytest.mark.parametrize("arrays", [_hand, lambda: _random_nodes(1), lambda: _random_nodes(2)],
                         ids=["hand", "random1", "random2"])
@pytest.mark.parametrize("align", [1, 4])
def test_packed_rows_match_the_expanded_rows(arrays, align):
    """Each node's tokens are stored once; every (leaf, token) pair, observation tokens included, has the token,
    RoPE position and predictor of the expanded row, and its packed mask row is exactly {the prompt} + {the leaf's
    tokens up to it}; the trained pairs are the policy tokens."""
    f = _forest(arrays())
    host = packing.host_forest(PROMPTS, LENGTHS, f, f.loss_mask.reshape(P * W, TR))
    plan = packing.plan_packing(host["prompts"], host["lengths"], host["path"], host["length"], host["tokens"],
                                host["segment_length"], dataclasses.replace(ROWS, align=align),
                                node_parent_PxN=host["node_parent"], node_depth_PxN=host["node_depth"],
                                node_span_PxNx2=host["spans"])
    span, paths = host["spans"], host["path"]
    on_path = [np.unique(paths[p][paths[p] > 0]) for p in range(P)]
    assert plan.unique_tokens == int(LENGTHS.sum() + sum(span[p, on_path[p], 1].sum() for p in range(P)))
    mask = np.asarray(tree_mask(jnp.asarray(plan.node_lo), jnp.asarray(plan.node_hi)))
    tokens, length, pm = host["tokens"], host["length"], np.asarray(f.policy_mask)
    for r in range(plan.shape[0]):
        for s in range(plan.shape[2]):
            b = plan.leaf_id[r, s]
            if b < 0:
                continue
            p, w = divmod(int(b), W)
            idx, valid = plan.pair_index[r, s], plan.pair_valid[r, s]
            assert valid.sum() == length[p, w]
            lo0 = plan.node_lo[r, idx[0]]
            prompt_idx = np.nonzero((plan.node_lo[r] <= lo0) & (lo0 <= plan.node_hi[r])
                                    & (plan.positions[r] < LENGTHS[p]))[0]
            np.testing.assert_array_equal(plan.tokens[r, prompt_idx], PROMPTS[p, :LENGTHS[p]])
            for t in range(length[p, w]):
                i = idx[t]
                assert plan.tokens[r, i] == tokens[p, w, t] and plan.positions[r, i] == LENGTHS[p] + t
                assert plan.prev[r, i] == (idx[t - 1] if t else prompt_idx[-1])
                visible = set(prompt_idx) | set(idx[: t + 1])
                assert set(np.nonzero(mask[r, i])[0]) == visible, (p, w, t)
    pairs = packing.forest_pairs(f, jnp.zeros((P, W, TR)))
    batch = packing.packed_batch(plan, pairs)
    got = packing.unpack_pairs(batch.inputs, batch.loss_mask, P * W).reshape(P, W, TR)
    np.testing.assert_array_equal(np.asarray(got), pm)  # observation pairs carry loss_mask 0


def test_plan_rejects_inconsistent_spans():
    f = _forest(_hand())
    args = (PROMPTS, LENGTHS, np.asarray(f.leaf_path), np.asarray(f.leaf_length), np.asarray(f.tokens),
            f.segment_length, ROWS)
    span = np.asarray(f.spans()).copy()
    span[0, 2, 0] += 1  # node 2 no longer starts where node 1 ends
    with pytest.raises(ValueError, match="starts at response token 8 but its parent 1 ends at 7"):
        packing.plan_packing(*args, node_span_PxNx2=span)
    span = np.asarray(f.spans()).copy()
    span[1, 1, 1] = 14  # node 1 of prompt 1 shorter than the leaves through it
    with pytest.raises(ValueError, match="runs past its path's last node"):
        packing.plan_packing(*args, node_span_PxNx2=span)
    bad = np.asarray(f.tokens).copy()
    bad[0, 1, 3] += 1  # leaf 1 disagrees with leaves 0 and 5 on node 1's token 3
    with pytest.raises(ValueError, match="disagree on its token 3"):
        packing.plan_packing(*args[:4], bad, *args[5:], node_span_PxNx2=np.asarray(f.spans()))


# ----------------------------------------------------------------------------------------------- the forward
def test_packed_logprobs_equal_expanded_on_every_response_token(params):
    """Per-token log-probs and entropies of the packed forward, gathered to (leaf, token) pairs, equal the
    expanded forward's at every response token, observation tokens included (they are in both forwards)."""
    f = _forest(_hand())
    adv, *_ = _inputs(f)
    ro = SimpleNamespace(forest=f, prompts_PxLp=PROMPTS, lengths_P=LENGTHS)
    eps = jnp.ones((P, W), jnp.float32)
    e_pool = EXPANDED.pool(ro, jnp.asarray(adv), f.loss_mask, eps)
    p_pool = PACKED.pool(ro, jnp.asarray(adv), f.loss_mask, eps)
    e_batch = EXPANDED.assemble(e_pool, EXPANDED.plan(e_pool, jnp.arange(e_pool.units)))
    p_batch = PACKED.assemble(p_pool, PACKED.plan(p_pool, np.arange(p_pool.units)))
    e_out = jax.jit(lambda x: EXPANDED.pair_logprobs(params, x, with_entropy=True))(e_batch.inputs)
    p_out = jax.jit(lambda x: PACKED.pair_logprobs(params, x, with_entropy=True))(p_batch.inputs)
    valid = np.arange(TR)[None, :] < np.asarray(f.leaf_length).reshape(P * W, 1)
    for name, e, pk in zip(("logp", "entropy"), e_out, p_out):
        want = np.where(valid, np.asarray(EXPANDED.to_response(e, LENGTHS, TR)), 0.0)
        got = np.where(valid, np.asarray(packing.unpack_pairs(p_batch.inputs, pk, P * W)), 0.0)
        assert np.all(np.abs(want[valid]) > 0.1), name  # real values at every response token
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


# ----------------------------------------------------------------------------------------------- loss and gradients
@pytest.mark.parametrize("arrays", [_hand, pytest.param(lambda: _random_nodes(1), marks=pytest.mark.slow),
                                    lambda: _random_nodes(2)], ids=["hand", "random1", "random2"])
def test_packed_loss_and_gradients_equal_expanded(arrays, params):
    """PPO-clip with dual clip, KL (k3), TIS and entropy on, per-pair clip scales: the packed batch's loss,
    metrics and gradients equal the expanded batch's on a turn forest."""
    f = _forest(arrays())
    e, pk = _batches(f, *_inputs(f))
    m, g = _grads(params, e)
    pm, pg = _grads(params, pk)
    assert float(m["num_tokens"]) == float(np.asarray(f.policy_mask).sum())  # every policy token, no other
    _assert_same(pm, pg, m, g)


def test_layout_protocol_trains_the_same_pairs(params):
    """Through the learner's seam (``Layout.pool / plan / assemble``, as :func:`treejax.rl.step.learn` calls it):
    packed and expanded give the same loss and gradients on a turn forest (sampler log-probs as pi_old, a
    reference policy's added for the KL term)."""
    f = _forest(_random_nodes(2))
    adv, _, ref, _, eps = _inputs(f, seed=3)
    ro = SimpleNamespace(forest=f, prompts_PxLp=PROMPTS, lengths_P=LENGTHS)
    e_pool = EXPANDED.pool(ro, jnp.asarray(adv), f.loss_mask, jnp.asarray(eps))
    p_pool = PACKED.pool(ro, jnp.asarray(adv), f.loss_mask, jnp.asarray(eps))
    e_batch = EXPANDED.assemble(e_pool, EXPANDED.plan(e_pool, jnp.arange(e_pool.units)))
    p_batch = PACKED.assemble(p_pool, PACKED.plan(p_pool, np.arange(p_pool.units)))
    e_batch = e_batch.replace(ref_logp=response_to_sequence(jnp.asarray(ref), jnp.asarray(LENGTHS),
                                                            e_batch.inputs.tokens.shape[1]))
    p_batch = p_batch.replace(ref_logp=packing.pack_pairs(p_batch.inputs, jnp.asarray(ref).reshape(P * W, TR)))
    m, g = _grads(params, e_batch)
    pm, pg = _grads(params, p_batch)
    for k in ("loss", "pg_loss", "num_tokens", "entropy", "ratio_mean"):
        np.testing.assert_allclose(float(pm[k]), float(m[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    _assert_grads_close(pg, g)


def test_observation_tokens_are_inputs_not_actions(params):
    """Garbage advantages and old / reference / sampler log-probs (NaN, +-inf, 1e4) at observation pairs, and a
    caller's loss mask of 1 on them, leave the loss, metrics and gradients bit-identical in both layouts; new
    observation token ids (the same in every leaf through their node) change them: they are in the forward.
    Packed still equals expanded on the changed forest."""
    arr = _hand()
    f = _forest(arr)
    adv, old, ref, smp, eps = _inputs(f)
    clean = [_grads(params, b) for b in _batches(f, adv, old, ref, smp, eps)]
    obs = (np.asarray(f.segment_index) >= 0) & (np.asarray(f.policy_mask) == 0)
    assert obs.sum() >= 20
    rng = np.random.default_rng(7)
    junk = lambda x: np.where(obs, rng.choice([np.nan, np.inf, -np.inf, 1e4, -1e4], x.shape), x)  # noqa: E731
    f_junk = f.replace(logprobs=jnp.asarray(junk(np.asarray(f.logprobs)), jnp.float32))
    all_ones = (np.asarray(f.segment_index) >= 0).astype(np.float32)  # a loss mask that forgot the observations
    junked = [_grads(params, b) for b in _batches(f_junk, junk(adv).astype(np.float32), junk(old), junk(ref),
                                                  junk(smp), eps, loss_mask=all_ones)]
    for (m, g), (m0, g0) in zip(junked, clean):
        _assert_same(m, g, m0, g0, exact=True)
    arr2 = dict(arr, tokens=arr["tokens"].copy())
    for p in range(P):
        for n, (m_len, k) in HAND_NODES[p].items():
            arr2["tokens"][p, n, k:m_len] = (arr2["tokens"][p, n, k:m_len] + 17) % 247 + 3  # observations only
    f2 = _forest(arr2)
    np.testing.assert_array_equal(np.asarray(f2.tokens)[~obs], np.asarray(f.tokens)[~obs])
    assert np.all(np.asarray(f2.tokens)[obs] != np.asarray(f.tokens)[obs])
    changed = [_grads(params, b) for b in _batches(f2, adv, old, ref, smp, eps)]
    for (m, g), (m0, g0) in zip(changed, clean):
        assert float(m["num_tokens"]) == float(m0["num_tokens"])
        assert not np.isclose(float(m["loss"]), float(m0["loss"]), rtol=1e-4)
        assert any(not np.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)))
    (m, g), (pm, pg) = changed
    _assert_same(pm, pg, m, g)


# ----------------------------------------------------------------------------------------------- fixed segments
def _consistent(forest, vocab=97):
    """Token ids that depend only on (node, position): leaves through a node agree on its tokens."""
    nodes = np.asarray(forest.token_nodes())
    t = np.arange(nodes.shape[2])[None, None, :]
    return forest.replace(tokens=jnp.asarray(np.where(nodes >= 0, (nodes * 31 + t * 7) % vocab + 3, 0), jnp.int32))


def _fixed_case(seed):
    """A fixed-segment forest of ``random_forest`` (copies for odd seeds), its prompts, lengths and trained mask."""
    P_, W_, D_, S_ = [(3, 4, 3, 4), (4, 6, 4, 3), (2, 8, 3, 5), (3, 5, 2, 1)][seed]
    rng = np.random.default_rng(seed)
    f = random_forest(rng, P_, W_, D_, S_, max_branch=3, stop_prob=0.3)
    if seed % 2:
        f, _ = with_copies(rng, f, np.zeros((P_, W_), np.float32), 0.4)
    f = _consistent(f)
    prompts = rng.integers(3, 90, (P_, 6)).astype(np.int32)
    lens = rng.integers(1, 7, P_).astype(np.int32)
    trained = np.ones((P_, W_), bool)
    trained[-1] = False
    return f, prompts, lens, trained


def _digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


# (seed, config, plan kwargs) -> (digest of the forest, digest of the plan arrays, plan sizes), recorded with the
# packer of commit a533ec3 (before spans: segments of S tokens assumed)
GOLDEN = [
    (0, packing.PackingConfig(granule=4, max_trees_per_row=1), "trained", ("d0ef526b3dd594d0", "ca586b274136b66a",
                                                                           [12, 18, 54, 174])),
    (1, packing.PackingConfig(granule=8), None, ("c41b6a9f71bffa44", "4ab8f68b2994ce0d", [24, 18, 107, 337])),
    (1, packing.PackingConfig(granule=8, align=4), dict(row_multiple=2),
     ("c41b6a9f71bffa44", "f1f8b4c293a618d1", [24, 18, 107, 337])),
    (2, packing.PackingConfig(granule=8, align=3), dict(floor=(4, 64, 32)),
     ("e9d447d321b2f279", "b72023864368216b", [16, 21, 106, 236])),
    (3, packing.PackingConfig(row_length=256), dict(prompts=[2, 0]), ("418a759848dceecf", "77262dc3907387af",
                                                                     [10, 8, 22, 60])),
]


@pytest.mark.parametrize("case", [pytest.param(i, marks=pytest.mark.slow) if i >= 3 else i  # 3, 4: new shapes
                                  for i in range(len(GOLDEN))])
def test_fixed_segments_pack_exactly_as_before(case):
    """A fixed-segment forest gives byte-identical plans (i) from ``segment_length`` alone, (ii) from the forest's
    derived spans (``Forest.spans()``, what the learner passes), (iii) from the same forest rebuilt as a span
    forest (``forest_from_spans``), and all three equal the plan recorded before spans existed."""
    seed, cfg, kw, (f_digest, plan_digest, sizes) = GOLDEN[case]
    f, prompts, lens, trained = _fixed_case(seed)
    kw = dict(trained_PxW=trained) if kw == "trained" else (kw or {})
    path, length, tokens = np.asarray(f.leaf_path), np.asarray(f.leaf_length), np.asarray(f.tokens)
    assert _digest([np.concatenate([path.ravel(), length.ravel(), tokens.ravel()])]) == f_digest, \
        "the random forest changed (NumPy's generator?): re-record GOLDEN with the pre-span packer"
    nodes = dict(node_parent_PxN=np.asarray(f.node_parent), node_depth_PxN=np.asarray(f.node_depth))
    spans = np.asarray(f.spans())
    as_spans = forest_from_spans(path, spans[:, :, 1], tokens, np.asarray(f.logprobs))
    plans = [packing.plan_packing(prompts, lens, path, length, tokens, f.segment_length, cfg, **kw, **nodes),
             packing.plan_packing(prompts, lens, path, length, tokens, f.segment_length, cfg, **kw, **nodes,
                                  node_span_PxNx2=spans),
             packing.plan_packing(prompts, lens, np.asarray(as_spans.leaf_path), np.asarray(as_spans.leaf_length),
                                  np.asarray(as_spans.tokens), as_spans.segment_length, cfg, **kw,
                                  node_span_PxNx2=np.asarray(as_spans.spans()))]
    for pl in plans:
        # padding has been its own node per column since (PAD_NODE + column); the recording had PAD_NODE for all
        pad = pl.node_lo >= packing.PAD_NODE
        np.testing.assert_array_equal(pl.node_lo[pad], (packing.PAD_NODE + np.nonzero(pad)[1]))
        np.testing.assert_array_equal(pl.node_hi[pad], pl.node_lo[pad])
        recorded = {k: np.where(pad, packing.PAD_NODE, getattr(pl, k)) if k in ("node_lo", "node_hi")
                    else getattr(pl, k) for k in packing.PLAN_ARRAYS}
        assert _digest([recorded[k] for k in packing.PLAN_ARRAYS]) == plan_digest
        assert [pl.num_sequences, pl.sequence_length, pl.unique_tokens, pl.expanded_tokens] == sizes
