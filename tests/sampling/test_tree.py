"""Tree rollout (TreePO Algorithm 1): invariants under a scripted toy policy (property tests), KV reuse
through forks/fallbacks checked against full forwards, b = 1 == linear sampler, determinism, no recompiles,
random initial divergence, bad input.

Precision: fp32 model and caches (``highest`` matmul precision on a GPU, tests/conftest.py): tree log-probs within
1e-4 of full forwards and of the linear sampler; the scripted toy policy's within 1e-5."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treejax.forest import NodeStatus, forest_from_paths
from treejax.models import presets
from treejax.models import transformer as T
from treejax.sampling import branching, decode, tree
from treejax.sampling import strategies as S

# ----------------------------------------------------------------------------------------------- scripted toy policy
TOY_V, TOY_M, TOY_EOS = 6, 97, 1
_TABLE = np.random.RandomState(0).randn(TOY_M, TOY_V).astype(np.float32) * 1.5
PREFILL_BATCHES: list[tuple] = []


def _toy_hash(tokens_prefix: np.ndarray) -> int:
    """Hash of the whole prefix (prompt + response so far) the toy policy conditions on."""
    return int(np.sum(tokens_prefix.astype(np.int64) * (np.arange(len(tokens_prefix)) + 1)) % TOY_M)


def _toy_logits_np(prefix: np.ndarray, eos_bias: float) -> np.ndarray:
    z = _TABLE[_toy_hash(prefix)].copy()
    z[TOY_EOS] += eos_bias
    return z


def make_toy_model() -> decode.ModelFns:
    """A params-free policy whose 'KV cache' is the token at each slot: logits depend on the whole cached prefix,
    so a wrong fork copy or a wrong position shows up as a wrong log-prob. ``params = {"eos_bias": scalar}``."""
    table = jnp.asarray(_TABLE)

    def init_cache(rows, length):
        return {"tok": jnp.zeros((rows, 1, length), jnp.int32)}

    def prefill(params, tokens, positions, segment_ids, cache, rows):
        PREFILL_BATCHES.append(tokens.shape)  # trace time: one entry per compiled prefill
        L = cache["tok"].shape[2]
        slots = jnp.where(segment_ids != 0, positions, L)
        return {"tok": cache["tok"].at[rows[:, None], 0, slots].set(tokens, mode="drop")}

    def step(params, tokens, positions, cache):
        R, L = cache["tok"].shape[0], cache["tok"].shape[2]
        c = cache["tok"].at[jnp.arange(R), 0, positions].set(tokens, mode="drop")
        slot = jnp.arange(L)[None, :]
        h = jnp.sum(jnp.where(slot <= positions[:, None], c[:, 0] * (slot + 1), 0), axis=-1) % TOY_M
        z = table[h] + jnp.where(jnp.arange(TOY_V) == TOY_EOS, params["eos_bias"], 0.0)[None, :]
        return z, {"tok": c}

    return decode.ModelFns(init_cache, prefill, step, TOY_V, TOY_V, name="toy")


TOY = make_toy_model()
TOY_TREE = tree.TreeConfig(num_leaves=6, max_depth=4, segment_length=3, branch_factor=2, stop_ids=(TOY_EOS,),
                           repetition_ngram=2, repetition_count=2, max_response_length=11, row_buckets=3)
TOY_ROLLOUT = tree.make_tree_rollout(TOY, TOY_TREE)


def _prompts(seed, P=3, Lp=5):
    rng = np.random.RandomState(seed)
    lengths = rng.randint(1, Lp + 1, P)
    tokens = rng.randint(2, TOY_V, (P, Lp))
    return tokens, lengths


# ----------------------------------------------------------------------------------------------- invariant checks
def check_forest(forest, info, tc: tree.TreeConfig, prompts, lengths, logprob_ref=None, atol=1e-5):
    """Every structural promise of the rollout, checked on the host."""
    P, W, S = len(lengths), tc.num_leaves, tc.segment_length
    path = np.asarray(forest.leaf_path)
    llen = np.asarray(forest.leaf_length)
    status = np.asarray(forest.leaf_status)
    toks = np.asarray(forest.tokens)
    assert bool(info.complete)
    assert path.shape == (P, W, tc.max_depth + 1)
    assert np.all(path[:, :, 0] == 0)
    assert np.all(llen > 0) and np.all(llen <= tc.max_length)
    ended = {int(NodeStatus.FINISHED), int(NodeStatus.EOS), int(NodeStatus.TRUNCATED), int(NodeStatus.REPETITION)}
    assert set(np.unique(status).tolist()) <= ended
    # paths, parents and depths agree with a host rebuild from the paths (raises on gaps / two parents / bad lengths)
    ref = forest_from_paths(path, llen, S, leaf_status=status)
    n_ref = ref.node_parent.shape[1]
    np.testing.assert_array_equal(np.asarray(forest.node_parent)[:, :n_ref], np.asarray(ref.node_parent))
    np.testing.assert_array_equal(np.asarray(forest.node_depth)[:, :n_ref], np.asarray(ref.node_depth))
    # every created node lies on some leaf's path (no orphans)
    for p in range(P):
        used = set(path[p][path[p] >= 0].tolist())
        assert used == set(range(int(info.num_nodes_P[p])))
    depth = np.asarray(forest.leaf_depth())
    decoded = 0
    for p in range(P):
        node_tokens = {}
        for w in range(W):
            n, d = llen[p, w], depth[p, w]
            if status[p, w] == NodeStatus.EOS:
                assert toks[p, w, n - 1] in tc.stop_ids
            if status[p, w] == NodeStatus.TRUNCATED:
                assert n >= tc.max_length or d == tc.max_depth
            if status[p, w] != NodeStatus.EOS and status[p, w] != NodeStatus.FINISHED:
                assert not np.isin(toks[p, w, :n], tc.stop_ids).any()
            for k in range(1, d + 1):
                node = path[p, w, k]
                node_tokens[node] = max(node_tokens.get(node, 0), min(n, k * S) - (k - 1) * S)
            # children equal their parents up to the fork point: leaves sharing the depth-k node share tokens
            for v in range(w):
                shared = int(np.sum((path[p, w, 1:] == path[p, v, 1:]) & (path[p, w, 1:] >= 0)))
                upto = min(n, llen[p, v], shared * S)
                np.testing.assert_array_equal(toks[p, w, :upto], toks[p, v, :upto])
            if logprob_ref is not None:
                ref_lp = logprob_ref(prompts[p, : lengths[p]], toks[p, w, :n])
                np.testing.assert_allclose(np.asarray(forest.logprobs[p, w, :n]), ref_lp, atol=atol)
        decoded += sum(node_tokens.values())
    assert int(info.decoded_tokens) == decoded  # decoded-token counter == unique tree tokens
    assert int(info.prefilled_tokens) == int(np.sum(lengths - 1))
    assert sum(int(v) for v in info.stops.values()) == P * W
    np.testing.assert_array_equal(np.asarray(forest.segment_index)[forest.loss_mask > 0],
                                  (np.arange(tc.response_capacity)[None, None, :] // S
                                   * np.ones((P, W, 1), int))[np.asarray(forest.loss_mask) > 0])


def _toy_logprobs(eos_bias):
    def ref(prompt, response):
        seq = np.concatenate([prompt, response])
        out = []
        for t in range(len(response)):
            z = _toy_logits_np(seq[: len(prompt) + t], eos_bias)
            z = z - z.max()
            out.append(z[response[t]] - np.log(np.exp(z).sum()))
        return np.array(out)
    return ref


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), eos_bias=st.sampled_from([-3.0, 0.0, 1.0, 2.5]))
def test_toy_policy_invariants(seed, eos_bias):
    prompts, lengths = _prompts(seed)
    forest, info = TOY_ROLLOUT({"eos_bias": jnp.float32(eos_bias)}, prompts, lengths, jax.random.key(seed))
    check_forest(forest, info, TOY_TREE, prompts, lengths, _toy_logprobs(eos_bias))


def test_fallback_exercised_and_no_recompiles():
    before = decode.TRACE_COUNTS.get("tree_rollout", 0)
    n_prefill = len(PREFILL_BATCHES)
    totals = dict(fallbacks=0, fallback_from_root=0)
    for seed in range(4):  # frequent EOS: fallbacks re-enter from resident EOS leaves
        prompts, lengths = _prompts(seed)
        forest, info = TOY_ROLLOUT({"eos_bias": jnp.float32(2.0)}, prompts, lengths, jax.random.key(seed))
        check_forest(forest, info, TOY_TREE, prompts, lengths, _toy_logprobs(2.0))
        for k in totals:
            totals[k] += int(getattr(info, k))
    assert totals["fallbacks"] > 0 and totals["fallback_from_root"] == 0
    # one compiled program for all calls (nothing recompiles between segments, steps or calls) ...
    assert decode.TRACE_COUNTS["tree_rollout"] - before <= 1
    # ... and each prompt batch is prefilled by one prefill pass of P rows (traced at most once here)
    assert all(shape[0] == 3 for shape in PREFILL_BATCHES[n_prefill:])
    assert len(PREFILL_BATCHES) - n_prefill <= 1
    # no EOS and aggressive repetition stops: no finished/EOS leaf to re-enter from, so fallbacks restart at the root
    tc = dataclasses.replace(TOY_TREE, repetition_ngram=1, repetition_count=2)
    rollout = tree.make_tree_rollout(TOY, tc)
    from_root = 0
    for seed in range(3):
        prompts, lengths = _prompts(seed)
        forest, info = rollout({"eos_bias": jnp.float32(-30.0)}, prompts, lengths, jax.random.key(seed))
        check_forest(forest, info, tc, prompts, lengths, _toy_logprobs(-30.0))
        assert int(info.fallbacks) == int(info.fallback_from_root)
        from_root += int(info.fallback_from_root)
    assert from_root > 0


def test_same_key_same_forest_and_different_key_differs():
    prompts, lengths = _prompts(3)
    params = {"eos_bias": jnp.float32(1.0)}
    a, ia = TOY_ROLLOUT(params, prompts, lengths, jax.random.key(11))
    b, ib = TOY_ROLLOUT(params, prompts, lengths, jax.random.key(11))
    c, _ = TOY_ROLLOUT(params, prompts, lengths, jax.random.key(12))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert int(ia.decoded_tokens) == int(ib.decoded_tokens)
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))


def test_row_compaction_gives_the_same_forest():
    """Packing live rows into a smaller decode batch changes cost, never results."""
    plain = tree.make_tree_rollout(TOY, dataclasses.replace(TOY_TREE, row_buckets=1))
    for seed, bias in [(0, 0.0), (1, 2.0), (2, -4.0)]:
        prompts, lengths = _prompts(seed)
        params = {"eos_bias": jnp.float32(bias)}
        a, ia = TOY_ROLLOUT(params, prompts, lengths, jax.random.key(seed))
        b, ib = plain(params, prompts, lengths, jax.random.key(seed))
        for x, y in zip(jax.tree.leaves((a, ia)), jax.tree.leaves((b, ib))):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("rule", [branching.FixedAverage(remainder="last"),
                                  branching.LogProbWeighted(scope="segment", sign=-1.0),
                                  branching.LogProbWeighted(scope="path", sign=-1.0, schedule=(5.0, 1.0, 100))],
                         ids=["fixed_average_official", "logprob_segment", "logprob_path"])
def test_branching_rules_keep_invariants(rule):
    tc = dataclasses.replace(TOY_TREE, branching=rule)
    rollout = tree.make_tree_rollout(TOY, tc)
    for seed in range(3):
        prompts, lengths = _prompts(seed)
        forest, info = rollout({"eos_bias": jnp.float32(0.5)}, prompts, lengths, jax.random.key(seed), step=seed * 40)
        check_forest(forest, info, tc, prompts, lengths, _toy_logprobs(0.5))


def test_random_initial_divergence():
    tc = dataclasses.replace(TOY_TREE, num_leaves=8, init_divergence_range=(1, 5), repetition_ngram=0,
                             repetition_count=0, max_response_length=None)
    rollout = tree.make_tree_rollout(TOY, tc)
    prompts, lengths = _prompts(0, P=16)
    forest, info = rollout({"eos_bias": jnp.float32(-30.0)}, prompts, lengths, jax.random.key(0))
    check_forest(forest, info, tc, prompts, lengths)
    n_init = np.asarray(info.init_divergence_P)
    assert n_init.min() >= 1 and n_init.max() <= 5 and len(np.unique(n_init)) > 1
    # the first segment opens exactly n_init depth-1 nodes: ids 1..n_init
    depth = np.asarray(forest.node_depth)
    for p in range(16):
        assert np.all(depth[p, 1: n_init[p] + 1] == 1)


# ----------------------------------------------------------------------------------------------- real transformer
def _tiny():
    cfg = presets.tiny_config("qwen2.5-0.5b", true_vocab_size=250)
    params = T.init_params(cfg, jax.random.key(0))
    return cfg, jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, params)


def _full_forward_ref(params, cfg, width=32):
    """Log-probs of ``response`` after ``prompt`` from one full forward over prompt + response, right-padded to
    ``width`` with segment id 0 (padding attends to nothing and nothing attends to it: the real tokens' forward is
    the unpadded one), so one jitted program serves every leaf instead of an eager forward per sequence length."""
    @jax.jit
    def log_probs(seq, seg):
        h = T.forward(params, cfg, seq, jnp.arange(width)[None], seg)
        return jax.nn.log_softmax(T.logits(params, cfg, h), axis=-1)[0]

    def ref(prompt, response):
        n, m = len(prompt), len(prompt) + len(response)
        assert m <= width, (m, width)
        seq, seg = np.zeros((1, width), np.int32), np.zeros((1, width), np.int32)
        seq[0, :m], seg[0, :m] = np.concatenate([prompt, response]), 1
        lp = np.asarray(log_probs(jnp.asarray(seq), jnp.asarray(seg)))
        return lp[np.arange(n - 1, n - 1 + len(response)), response]
    return ref


def test_tree_b1_equals_linear_sampler():
    cfg, params = _tiny()
    fns = decode.make_model_fns(cfg, block_size=16, cache_dtype="float32")
    W, D, S_ = 3, 3, 4
    tc = tree.TreeConfig(num_leaves=W, max_depth=D, segment_length=S_, branch_factor=1, init_divergence=W,
                         stop_ids=(), strategy=S.TopP(p=0.9, temperature=1.1))
    rng = np.random.RandomState(0)
    lengths = np.array([5, 2])
    prompts = rng.randint(3, 250, (2, 6))
    forest, info = tree.make_tree_rollout(fns, tc)(params, prompts, lengths, jax.random.key(5))
    lin = decode.generate(params, fns, np.repeat(prompts, W, 0), np.repeat(lengths, W), jax.random.key(5), D * S_,
                          tc.strategy, stop_ids=())
    # identical sequences; log-probs agree to fp32 rounding (the tree prefills P rows, the linear sampler P*W)
    np.testing.assert_array_equal(np.asarray(forest.tokens).reshape(2 * W, -1), np.asarray(lin.tokens))
    np.testing.assert_allclose(np.asarray(forest.logprobs).reshape(2 * W, -1), np.asarray(lin.logprobs), atol=1e-4)
    np.testing.assert_allclose(np.asarray(info.sampling_logprobs_PxWxT).reshape(2 * W, -1),
                               np.asarray(lin.sampling_logprobs), atol=1e-4)
    assert int(info.forks) == 0 and int(info.decoded_tokens) == int(lin.decoded_tokens)
    # the independent-sampling API is this same tree
    ind = tree.make_independent_rollout(fns, W, D * S_, segment_length=S_, stop_ids=(), strategy=tc.strategy)
    f2, _ = ind(params, prompts, lengths, jax.random.key(5))
    np.testing.assert_array_equal(np.asarray(f2.tokens), np.asarray(forest.tokens))


def test_transformer_tree_kv_reuse_matches_full_forward():
    """Forks copy KV rows and fallbacks re-enter at cuts: every leaf's log-probs must still equal a full forward
    over prompt + leaf tokens (fp32)."""
    cfg, params = _tiny()
    fns = decode.make_model_fns(cfg, block_size=16, cache_dtype="float32")
    tc = tree.TreeConfig(num_leaves=4, max_depth=3, segment_length=4, branch_factor=2,
                         stop_ids=tuple(range(3, 60)), with_entropy=True)
    rng = np.random.RandomState(1)
    lengths = np.array([6, 3])
    prompts = rng.randint(60, 250, (2, 6))
    rollout = tree.make_tree_rollout(fns, tc)
    fallbacks = 0
    for seed in range(2):
        forest, info = rollout(params, prompts, lengths, jax.random.key(seed))
        check_forest(forest, info, tc, prompts, lengths, _full_forward_ref(params, cfg), atol=1e-4)
        fallbacks += int(info.fallbacks)
        ent = np.asarray(info.entropy_PxWxT)[np.asarray(forest.loss_mask) > 0]
        assert np.all(ent > 0)
    assert fallbacks > 0


def test_bad_input_errors():
    with pytest.raises(ValueError, match=r"num_leaves \(W=2\) must be >= branch_factor \(b=4\)"):
        tree.TreeConfig(num_leaves=2, branch_factor=4)
    with pytest.raises(ValueError, match="segment_length"):
        tree.TreeConfig(segment_length=0)
    with pytest.raises(ValueError, match="init_divergence_range"):
        tree.TreeConfig(num_leaves=4, init_divergence_range=(3, 9))
    rollout = tree.make_tree_rollout(TOY, dataclasses.replace(TOY_TREE, max_prompt_length=4))
    params = {"eos_bias": jnp.float32(0.0)}
    with pytest.raises(ValueError, match="exceed max_prompt_length=4"):
        rollout(params, np.ones((2, 6), np.int32), np.array([6, 2]), jax.random.key(0))
    with pytest.raises(ValueError, match="empty prompt"):
        rollout(params, np.ones((2, 4), np.int32), np.array([0, 2]), jax.random.key(0))
