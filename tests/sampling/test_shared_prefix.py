"""Shared-prefix ("cascade") KV cache of the tree sampler (``TreeConfig.prefix_cache``): the cascade attention equals
dense softmax attention over the equivalent per-row cache, and whole rollouts on the shared layout reproduce the
per-row ones (fp32 caches: identical tokens, log-probs to fp32 rounding)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.models import presets
from treejax.models import transformer as T
from treejax.sampling import attention as A
from treejax.sampling import cache as cache_lib
from treejax.sampling import decode, tree
from treejax.sampling.continuation import ContinuationConfig
from treejax.sampling.partial import make_partial_rollout
from treejax.sampling.tree_config import SHARED_PREFIX_MIN_PROMPT, SHARED_PREFIX_MIN_PROMPT_PALLAS


# ----------------------------------------------------------------------------------------------- attention
def _reference(q_RxQxH, k_pre, v_pre, k_suf, v_suf, n_P, prompt_R, j_R):
    """float64 softmax attention of each row over prefix[prompt, :n] ++ suffix[row, :j+1] (GQA: head h reads
    KV head h // G)."""
    R, Q, H = q_RxQxH.shape
    K = k_pre.shape[1]
    G = Q // K
    out = np.zeros((R, Q, H))
    for r in range(R):
        p, n, j = prompt_R[r], n_P[prompt_R[r]], j_R[r]
        for h in range(Q):
            kv = h // G
            keys = np.concatenate([k_pre[p, kv, :n], k_suf[r, kv, :j + 1]]).astype(np.float64)
            vals = np.concatenate([v_pre[p, kv, :n], v_suf[r, kv, :j + 1]]).astype(np.float64)
            s = keys @ q_RxQxH[r, h].astype(np.float64) / np.sqrt(H)
            w = np.exp(s - s.max())
            out[r, h] = (w / w.sum()) @ vals
    return out


@pytest.mark.parametrize("block", [8, 64])
def test_cascade_attention_matches_dense_over_per_row_cache(block):
    """Random prompts of different lengths (one empty prefix, one full), GQA (4 query / 2 KV heads), rows in a
    random physical order, a sub-batch holding only some rows of some prompts, and dead rows."""
    rng = np.random.default_rng(0)
    P, W, K, Q, H, Lp, Ls = 4, 4, 2, 4, 16, 32, 16
    R = P * W
    n_P = np.array([0, 7, 20, 32], np.int32)
    k_pre, v_pre = (rng.normal(size=(P, K, Lp, H)).astype(np.float32) for _ in range(2))
    k_suf, v_suf = (rng.normal(size=(R, K, Ls, H)).astype(np.float32) for _ in range(2))
    q = rng.normal(size=(R, Q, H)).astype(np.float32)
    logical = np.arange(R)
    prompt, rank = logical // W, logical % W
    j = rng.integers(0, Ls, size=R).astype(np.int32)
    dead = np.zeros(R, bool)
    dead[[1, 6, 11]] = True
    j_in = np.where(dead, Lp + Ls - n_P[prompt], j).astype(np.int32)  # a dead row's position is Lp + Ls
    perm = rng.permutation(R)[:11]  # physical row i holds logical row perm[i]; a sub-batch of 11 rows
    fn = jax.jit(lambda *a: A.cascade_decode_attention(
        a[0], a[1], a[2], a[3], a[4], a[5], prefix_len_P=a[6], row_prompt_R=a[7], row_rank_R=a[8],
        rows_per_prompt=W, block_size=block))
    got = np.asarray(fn(jnp.asarray(q[perm][:, None]), k_suf[perm], v_suf[perm], j_in[perm], k_pre, v_pre,
                        jnp.asarray(n_P), jnp.asarray(prompt[perm], jnp.int32), jnp.asarray(rank[perm], jnp.int32)))
    assert got.shape == (11, 1, Q, H)
    want = _reference(q[perm], k_pre, v_pre, k_suf[perm], v_suf[perm], n_P, prompt[perm], j[perm])
    live = ~dead[perm]
    assert live.sum() >= 6 and (~live).sum() >= 1
    np.testing.assert_allclose(got[live, 0], want[live], atol=1e-5)
    assert np.all(np.isfinite(got))
    # the same through the expanded per-row cache and the dense decode attention of the per-row layout
    cache = cache_lib.SharedPrefixCache(
        rows=dict(k=(jnp.asarray(k_suf),), v=(jnp.asarray(v_suf),), row_prompt=jnp.asarray(prompt, jnp.int32),
                  row_rank=jnp.asarray(rank, jnp.int32)),
        prefix=dict(k=(jnp.asarray(k_pre),), v=(jnp.asarray(v_pre),), length=jnp.asarray(n_P)), rows_per_prompt=W)
    flat = cache_lib.per_row_rows(cache, jnp.asarray(perm, jnp.int32))
    assert flat["k"][0].shape == (11, K, Lp + Ls, H)
    pos = (n_P[prompt] + j)[perm]
    dense = np.asarray(A.dense_decode_attention(jnp.asarray(q[perm][:, None]), flat["k"][0], flat["v"][0],
                                                jnp.asarray(pos)))
    np.testing.assert_allclose(dense[live, 0], want[live], atol=1e-5)


def test_ragged_lse_merges_exactly():
    """Splitting one row's slots into two disjoint ranges and merging by LSE gives the one-pass result; the public
    ragged attention is unchanged by the refactor (its output is the internal loop's)."""
    rng = np.random.default_rng(1)
    B, K, G, H, L = 3, 2, 2, 8, 32
    k, v = (jnp.asarray(rng.normal(size=(B, K, L, H)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(B, 1, K * G, H)), jnp.float32)
    pos = jnp.asarray([5, 31, 17])
    whole = A.ragged_decode_attention(q, k, v, pos, block_size=8)
    np.testing.assert_allclose(np.asarray(whole), np.asarray(A.dense_decode_attention(q, k, v, pos)), atol=1e-5)
    qg = q[:, 0].reshape(B, K, G, H) / np.sqrt(H)
    cut = 4  # slots 0..3 then 4..pos
    o1, l1 = A._ragged_attention_lse(qg, k[:, :, :cut], v[:, :, :cut], jnp.full((B,), cut - 1), 4)
    o2, l2 = A._ragged_attention_lse(qg, k[:, :, cut:], v[:, :, cut:], pos - cut, 4)
    merged = A.merge_attention(o1, l1, o2, l2).reshape(B, 1, K * G, H)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(whole), atol=1e-5)
    # no slot at all on one side: lse = -inf, weight 0
    o0, l0 = A._ragged_attention_lse(qg, k, v, jnp.full((B,), -1), 8)
    assert np.all(np.isneginf(np.asarray(l0))) and np.all(np.asarray(o0) == 0)
    np.testing.assert_allclose(np.asarray(A.merge_attention(o0, l0, o2, l2)), np.asarray(o2), atol=1e-6)


# ----------------------------------------------------------------------------------------------- rollouts
CFG = presets.tiny_config("qwen2.5-0.5b", true_vocab_size=250)
PARAMS = T.init_params(CFG, jax.random.key(0))
FNS = decode.make_model_fns(CFG, block_size=16, cache_dtype="float32")  # fp32 KV: the two layouts agree to rounding
PROMPTS = np.random.RandomState(1).randint(60, 250, (3, 20)).astype(np.int32)
LENGTHS = np.array([6, 1, 19], np.int32)  # different lengths, one prompt with an empty prefix
STOP = tuple(range(3, 40))


def test_shared_decode_steps_equal_per_row():
    """The model fns on the two layouts after the same prefill: rows permuted and sliced to a sub-batch (as the
    tree's row buckets do), one dead row, greedy steps: the same logits to fp32 rounding."""
    P, W, T_ = 3, 4, 8
    R = P * W
    Lb = PROMPTS.shape[1]
    step = jax.jit(FNS.step)
    per_row = FNS.init_cache(R, A.round_cache_length(Lb + T_, FNS.cache_multiple))
    per_row, tok_P, pos_P = decode.prefill_prompts(FNS, PARAMS, per_row, jnp.asarray(PROMPTS), jnp.asarray(LENGTHS),
                                                   jnp.arange(P, dtype=jnp.int32) * W)
    per_row = cache_lib.broadcast_prompt_rows(per_row, (jnp.arange(R) // W) * W)
    shared = FNS.init_shared_cache(P, W, A.round_cache_length(Lb, FNS.cache_multiple),
                                   A.round_cache_length(T_ + 1, FNS.cache_multiple))
    shared, tok2, pos2 = decode.prefill_prompts(FNS, PARAMS, shared, jnp.asarray(PROMPTS), jnp.asarray(LENGTHS),
                                                jnp.arange(P, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(shared.prefix_length), LENGTHS - 1)
    perm = jnp.asarray(np.random.default_rng(3).permutation(R)[:9], jnp.int32)  # physical i = logical perm[i]
    caches = [cache_lib.map_rows(lambda x: x[perm], cache_lib.fork_rows(c, jnp.arange(R))) for c in (per_row, shared)]
    tok = tok_P[perm // W]
    pos = pos_P[perm // W]
    live = jnp.arange(9) != 4
    for _ in range(T_):
        outs = []
        for i, c in enumerate(caches):
            logits, caches[i] = step(PARAMS, tok, jnp.where(live, pos, cache_lib.dead_position(c)), c)
            outs.append(np.asarray(logits))
        np.testing.assert_allclose(outs[1][np.asarray(live)], outs[0][np.asarray(live)], atol=1e-5)
        tok, pos = jnp.argmax(outs[0], axis=-1).astype(jnp.int32), pos + 1
    assert caches[1].rows["k"][0].shape[2] == 16 and caches[1].rows["row_prompt"].shape == (9,)


def _both(tc, cc=None, seeds=(0,)):
    """(per_row, shared) outputs of the same rollout for each seed."""
    out = []
    for pc in ("per_row", "shared"):
        rollout = tree.make_tree_rollout(FNS, dataclasses.replace(tc, prefix_cache=pc), continuations=cc)
        out.append([rollout(PARAMS, PROMPTS, LENGTHS, jax.random.key(s)) for s in seeds])
    return out


def _assert_same(a, b):
    (fa, ia), (fb, ib) = a, b
    np.testing.assert_array_equal(np.asarray(fa.tokens), np.asarray(fb.tokens))
    np.testing.assert_array_equal(np.asarray(fa.leaf_length), np.asarray(fb.leaf_length))
    np.testing.assert_array_equal(np.asarray(fa.node_parent), np.asarray(fb.node_parent))
    np.testing.assert_allclose(np.asarray(fa.logprobs), np.asarray(fb.logprobs), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ia.entropy_PxWxT), np.asarray(ib.entropy_PxWxT), atol=1e-5)
    assert int(ia.forks) == int(ib.forks) and int(ia.fallbacks) == int(ib.fallbacks)
    assert int(ia.decoded_tokens) == int(ib.decoded_tokens)


@pytest.mark.slow
def test_shared_tree_rollout_equals_per_row_transfer():
    """TreePO allocation with row buckets (rows permuted and sliced), forks and fallbacks (rows duplicated)."""
    tc = tree.TreeConfig(num_leaves=4, max_depth=3, segment_length=4, branch_factor=2, stop_ids=STOP,
                         with_entropy=True, row_buckets=2)
    per_row, shared = _both(tc, seeds=(0, 1))
    for a, b in zip(per_row, shared):
        _assert_same(a, b)
    assert sum(int(i.forks) for _, i in per_row) > 0 and sum(int(i.fallbacks) for _, i in per_row) > 0


@pytest.mark.slow
def test_shared_tree_rollout_equals_per_row_slots():
    tc = tree.TreeConfig(num_leaves=4, max_depth=3, segment_length=4, branch_factor=2, stop_ids=STOP,
                         with_entropy=True, row_buckets=3, allocation="slots")
    (a,), (b,) = _both(tc)
    _assert_same(a, b)
    assert int(a[1].forks) > 0


@pytest.mark.slow
def test_shared_continuations_equal_per_row():
    """Continuations gather leaf rows many times per prompt: their work cache is the shared cache expanded per
    row (cache.per_row_rows), so they must reproduce the per-row continuations token for token."""
    tc = tree.TreeConfig(num_leaves=2, max_depth=2, segment_length=4, branch_factor=1, init_divergence=2,
                         stop_ids=STOP, row_buckets=1)
    cc = ContinuationConfig(threshold=0.5, interval=1, max_cuts=2, samples=2)
    (a,), (b,) = _both(tc, cc)
    _assert_same(a, b)
    ca, cb = a[1].continuations, b[1].continuations
    assert int(ca.decoded_tokens) > 0
    for name in ("cut_PxWxB", "tokens_PxWxBxKxT", "length_PxWxBxK", "stopped_PxWxBxK"):
        np.testing.assert_array_equal(np.asarray(getattr(ca, name)), np.asarray(getattr(cb, name)))


# ----------------------------------------------------------------------------------------------- selection
def test_auto_selection_and_bad_input():
    tc = tree.TreeConfig(num_leaves=4, branch_factor=2, prefix_cache="auto")
    assert tc.resolved_prefix_cache(SHARED_PREFIX_MIN_PROMPT) == "shared"
    assert tc.resolved_prefix_cache(SHARED_PREFIX_MIN_PROMPT // 2) == "per_row"
    assert tc.resolved_prefix_cache(SHARED_PREFIX_MIN_PROMPT, supports_shared=False) == "per_row"
    # the per-row Pallas kernel beat the XLA cascade at every length measured on the GPU: auto keeps it ...
    assert tc.resolved_prefix_cache(4 * SHARED_PREFIX_MIN_PROMPT, per_row_attention="pallas") == "per_row"
    # ... and the Pallas cascade beat the per-row kernel from 256-token prompts on
    pallas = dict(per_row_attention="pallas", cascade_attention="pallas")
    assert tc.resolved_prefix_cache(SHARED_PREFIX_MIN_PROMPT_PALLAS, **pallas) == "shared"
    assert tc.resolved_prefix_cache(SHARED_PREFIX_MIN_PROMPT_PALLAS // 2, **pallas) == "per_row"
    one = tree.TreeConfig(num_leaves=1, branch_factor=1, prefix_cache="auto")
    assert one.resolved_prefix_cache(4 * SHARED_PREFIX_MIN_PROMPT) == "per_row"  # W = 1: nothing to share
    assert one.resolved_prefix_cache(1 << 16, **pallas) == "per_row"
    assert tree.TreeConfig().prefix_cache == "auto"
    assert tree.TreeConfig().resolved_prefix_cache(1 << 16) == "shared"
    assert tree.TreeConfig(prefix_cache="per_row").resolved_prefix_cache(1 << 16) == "per_row"
    assert tree.TreeConfig(prefix_cache="shared").resolved_prefix_cache(16) == "shared"
    with pytest.raises(ConfigError, match="TreeConfig.prefix_cache='sharde' is not one of 'shared'"):
        tree.TreeConfig(prefix_cache="sharde")
    # model fns without a shared-prefix cache (a scripted policy): "shared" fails when the rollout is built
    toy = dataclasses.replace(FNS, init_shared_cache=None)
    with pytest.raises(ValueError, match="needs model fns with a shared-prefix cache"):
        tree.make_tree_rollout(toy, tree.TreeConfig(num_leaves=4, prefix_cache="shared"))
    tree.make_tree_rollout(toy, tree.TreeConfig(num_leaves=4, prefix_cache="auto"))  # auto: per-row, no error
    chains = dict(num_leaves=2, branch_factor=1, init_divergence=2, max_depth=1, segment_length=4)
    with pytest.raises(ValueError, match="prefix_cache='shared' is not supported here"):
        make_partial_rollout(FNS, tree.TreeConfig(prefix_cache="shared", **chains))
    assert make_partial_rollout(FNS, tree.TreeConfig(prefix_cache="auto", **chains)).tree_config.prefix_cache == \
        "per_row"
    # the shared cache is refused by the per-row-only append path
    cache = FNS.init_shared_cache(1, 2, 16, 16)
    with pytest.raises(ValueError, match="per-row cache"):
        FNS.extend(PARAMS, jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1), bool),
                   cache, jnp.arange(2))
