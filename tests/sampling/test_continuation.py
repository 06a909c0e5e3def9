"""Continuations from cut points inside leaves (treejax.sampling.continuation, SPO-chain's Monte-Carlo rollouts):
the cuts equal a per-token loop, and every continuation equals a slow reference that runs a full forward of the
prompt + the leaf's kept prefix + the continuation so far and draws each token with the documented key."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import presets, transformer
from treejax.sampling import continuation as C
from treejax.sampling import decode, tree
from treejax.sampling.strategies import Temperature, mask_vocab

CFG = presets.tiny_config("smollm2-135m", vocab_size=64)
FNS = decode.make_model_fns(CFG, attention="dense", cache_dtype="float32")  # fp32 KV: exact against a forward
PROMPTS = np.array([[1, 5, 9, 2, 7], [1, 11, 3, 4, 0]], np.int32)
LENS = np.array([5, 4], np.int32)
STOP = (7,)
WIDTH = 32
_FWD = jax.jit(lambda p, s: transformer.forward(p, CFG, s, jnp.arange(WIDTH)[None, :], jnp.ones_like(s)))


def _cuts_reference(logp, length, threshold, interval, max_cuts):
    cand = [t for t in range(length) if np.exp(logp[t]) < threshold]
    kept = cand[::interval][:max_cuts]
    return kept + [-1] * (max_cuts - len(kept))


def test_low_probability_cuts_match_a_loop():
    rng = np.random.default_rng(0)
    logp = np.log(rng.uniform(0.01, 1.0, size=(5, 40))).astype(np.float32)
    length = np.array([40, 0, 7, 25, 39], np.int32)
    for threshold, interval, max_cuts in [(0.9, 5, 4), (0.5, 1, 40), (0.3, 3, 2), (1.0, 2, 8)]:
        got = np.asarray(C.low_probability_cuts(jnp.asarray(logp), jnp.asarray(length), threshold, interval, max_cuts))
        want = [_cuts_reference(logp[r], length[r], threshold, interval, max_cuts) for r in range(5)]
        np.testing.assert_array_equal(got, np.array(want, np.int32))


def test_config_checks():
    with pytest.raises(ValueError, match="threshold"):
        C.ContinuationConfig(threshold=0.0)
    with pytest.raises(ValueError, match="samples"):
        C.ContinuationConfig(samples=0)
    with pytest.raises(ValueError, match="multiple"):
        C.ContinuationConfig(samples=3, rows_per_round=4)


@functools.partial(jax.jit, static_argnums=6)
def _draw(params, padded, last, base, row_id, t, strategy):
    """The reference's token ``t``: the full forward's logits at position ``last``, drawn with the documented key
    (one jitted program for every token, instead of eager ops per token)."""
    h = _FWD(params, padded)
    logits = transformer.logits(params, CFG, jax.lax.dynamic_index_in_dim(h, last, axis=1, keepdims=False)
                                .astype(jnp.float32))
    logits = mask_vocab(logits, FNS.sampling_vocab_size)
    k = decode.token_keys(base, jnp.reshape(row_id, (1,)), jnp.zeros((1,), jnp.int32), jnp.reshape(t, (1,)))
    return strategy.sample(k, logits)


def _reference(params, prompt, prefix, key, row_id, room, strategy):
    """One continuation by full forwards: token t drawn from pi(. | prompt + prefix + drawn so far) with
    ``token_keys(fold_in(key, CONTINUATION_STREAM), row_id, 0, t)``."""
    base = jax.random.fold_in(key, C.CONTINUATION_STREAM)
    seq, out = list(prompt) + list(prefix), []
    for t in range(room):
        padded = np.zeros((1, WIDTH), np.int32)
        padded[0, :len(seq)] = seq  # causal: the padding after the sequence does not change its last position
        tok = int(_draw(params, jnp.asarray(padded), len(seq) - 1, base, row_id, t, strategy)[0])
        out.append(tok)
        seq.append(tok)
        if tok in STOP:
            return out, True
    return out, False


def test_continuations_equal_full_forward_reference():
    """Every continuation of every cut equals the slow reference (fp32 cache); decoding one pair per round gives
    the same continuations as all pairs in one round; the counters add up."""
    params = transformer.init_params(CFG, jax.random.key(1))
    strategy = Temperature(1.0)
    tc = tree.independent_config(2, 12, segment_length=4, strategy=strategy, stop_ids=STOP)
    key = jax.random.key(5)
    outs = {}
    for rows in (0, 2):
        cc = C.ContinuationConfig(threshold=0.2, interval=2, max_cuts=3, samples=2, rows_per_round=rows)
        outs[rows] = jax.device_get(tree.make_tree_rollout(FNS, tc, continuations=cc)(params, PROMPTS, LENS, key))
    (f, info), (f2, info2) = outs[0], outs[2]
    for a, b in zip(jax.tree.leaves((f, info.continuations)), jax.tree.leaves((f2, info2.continuations))):
        np.testing.assert_array_equal(a, b)
    cont = info.continuations
    cut, toks, lens, stopped = cont.cut_PxWxB, cont.tokens_PxWxBxKxT, cont.length_PxWxBxK, cont.stopped_PxWxBxK
    T = f.tokens.shape[-1]
    checked = 0
    for p in range(2):
        for w in range(2):
            want_cuts = _cuts_reference(f.logprobs[p, w], f.leaf_length[p, w], 0.2, 2, 3)
            np.testing.assert_array_equal(cut[p, w], want_cuts)
            for b in range(3):
                s = int(cut[p, w, b])
                if s < 0:
                    assert (lens[p, w, b] == 0).all() and (toks[p, w, b] == 0).all()
                    continue
                for k in range(2):
                    row_id = ((p * 2 + w) * 3 + b) * 2 + k
                    out, stop = _reference(params, PROMPTS[p, :LENS[p]], f.tokens[p, w, :s], key, row_id, T - s,
                                           strategy)
                    n = int(lens[p, w, b, k])
                    assert toks[p, w, b, k, :n].tolist() == out and bool(stopped[p, w, b, k]) == stop
                    assert (toks[p, w, b, k, n:] == 0).all()
                    checked += 1
    assert checked >= 6
    assert int(info.continuation_tokens) == int(lens.sum()) > 0
    tree_tokens = int(np.sum(f.leaf_length))  # independent chains: every decoded token is a leaf's
    assert int(info.decoded_tokens) == tree_tokens + int(lens.sum())
