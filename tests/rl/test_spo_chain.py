"""SPO-chain (treejax.rl.advantages.spo_chain): the estimator against a per-token loop on hand-made cuts and values,
the continuations' scoring against the texts it builds, and the configuration checks."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.forest import Forest
from treejax.rl.advantages import SPOChainOptions, estimator_spec
from treejax.rl.advantages.spo_chain import chain_token_advantages
from treejax.rl.config import RunConfig
from treejax.rl.scoring import continuation_rewards
from treejax.sampling.continuation import Continuations
from treejax.sampling.tree import TreeConfig


def _forest(lengths, logprobs):
    P, W, T = logprobs.shape
    mask = (np.arange(T)[None, None] < lengths[:, :, None]).astype(np.float32)
    return Forest(node_parent=jnp.zeros((P, 2), jnp.int32), node_depth=jnp.zeros((P, 2), jnp.int32),
                  node_status=jnp.zeros((P, 2), jnp.int32), leaf_path=jnp.zeros((P, W, 2), jnp.int32),
                  leaf_status=jnp.zeros((P, W), jnp.int32), leaf_length=jnp.asarray(lengths),
                  tokens=jnp.zeros((P, W, T), jnp.int32), logprobs=jnp.asarray(logprobs * mask),
                  segment_index=jnp.zeros((P, W, T), jnp.int32), loss_mask=jnp.asarray(mask), segment_length=T)


def _reference(cuts, values, reward, length, T):
    """The code's backward fill: tokens s_{k} .. s_{k+1}-1 get V(s_{k+1}) - V(s_k), the last segment r - V(s_last),
    tokens before the first cut 0."""
    c = [int(x) for x in cuts if x >= 0]
    v = [float(values[i]) for i in range(len(c))] + [float(reward)]
    out = np.zeros(T)
    for k in range(len(c)):
        end = c[k + 1] if k + 1 < len(c) else length
        out[c[k]:end] = v[k + 1] - v[k]
    return out


def test_spo_chain_matches_reference():
    T = 10
    lengths = np.array([[10, 6, 3], [8, 10, 1]], np.int32)
    rng = np.random.default_rng(0)
    logprobs = np.log(rng.uniform(0.05, 1.0, size=(2, 3, T))).astype(np.float32)
    cuts = np.array([[[0, 4, 7], [2, -1, -1], [-1, -1, -1]], [[1, 3, 5], [6, 8, -1], [0, -1, -1]]], np.int32)
    values = rng.uniform(-1, 1, size=(2, 3, 3)).astype(np.float32)
    values[cuts < 0] = 0.0
    rewards = np.array([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]], np.float32)
    forest = _forest(lengths, logprobs)
    raw = np.asarray(chain_token_advantages(jnp.asarray(cuts), jnp.asarray(values), jnp.asarray(rewards), T))
    for p in range(2):
        for w in range(3):
            want = _reference(cuts[p, w], values[p, w], rewards[p, w], lengths[p, w], T)
            valid = np.arange(T) < lengths[p, w]
            np.testing.assert_allclose(raw[p, w][valid], want[valid], rtol=1e-6, atol=1e-7)

    spec = estimator_spec("spo_chain")
    opts = SPOChainOptions(threshold=0.6)
    adv = spec.fn(forest, jnp.asarray(rewards), opts, cut_PxWxB=jnp.asarray(cuts), cut_value_PxWxB=jnp.asarray(values))
    mask = (np.arange(T)[None, None] < lengths[:, :, None]) & (np.exp(logprobs) < 0.6)
    np.testing.assert_array_equal(np.asarray(adv.loss_mask), mask.astype(np.float32))
    a = np.stack([[_reference(cuts[p, w], values[p, w], rewards[p, w], lengths[p, w], T) for w in range(3)]
                  for p in range(2)])
    x = a[mask]
    want = np.zeros_like(a)
    want[mask] = (x - x.mean()) / np.sqrt(x.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(np.asarray(adv.tokens), want, rtol=1e-5, atol=1e-6)
    # without whitening and mask: the raw advantages on every response token
    plain = spec.fn(forest, jnp.asarray(rewards), dataclasses.replace(opts, whiten=False, prob_mask=False),
                    cut_PxWxB=jnp.asarray(cuts), cut_value_PxWxB=jnp.asarray(values))
    valid = np.arange(T)[None, None] < lengths[:, :, None]
    np.testing.assert_allclose(np.asarray(plain.tokens), np.where(valid, a, 0.0), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="cut_PxWxB"):
        spec.fn(forest, jnp.asarray(rewards), opts, cut_PxWxB=jnp.asarray(cuts[:1]),
                cut_value_PxWxB=jnp.asarray(values[:1]))


def test_continuation_rewards_score_prefix_plus_continuation():
    class Tok:  # one character per token id
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(i) for i in ids)

    class Task:  # correct iff the text ends with the example's answer
        def score(self, text, example):
            return float(text.endswith(example))

    T = 6
    leaf = np.zeros((1, 2, T), np.int32)
    leaf[0, 0, :4] = [ord(c) for c in "12+3"]
    leaf[0, 1, :3] = [ord(c) for c in "ab="]
    cut = np.array([[[2, 3], [0, -1]]], np.int32)  # leaf 0: keep "12" and "12+"; leaf 1: from the prompt
    toks = np.zeros((1, 2, 2, 2, T), np.int32)
    lens = np.zeros((1, 2, 2, 2), np.int32)

    def put(w, b, k, text):
        toks[0, w, b, k, :len(text)] = [ord(c) for c in text]
        lens[0, w, b, k] = len(text)

    put(0, 0, 0, "+3=15")  # "12+3=15" ends with "15": correct
    put(0, 0, 1, "+4")  # "12+4": wrong
    put(0, 1, 0, "3=15")  # "12+3=15": correct
    put(0, 1, 1, "9=15")  # "12+9=15": correct
    put(1, 0, 0, "x15")  # leaf 1 from its start: "x15": correct
    put(1, 0, 1, "x")
    cont = Continuations(cut_PxWxB=cut, tokens_PxWxBxKxT=toks, length_PxWxBxK=lens,
                         stopped_PxWxBxK=np.ones_like(lens, bool), decoded_tokens=np.int32(lens.sum()))
    seen = []

    def reward_fn(scores, lengths):
        seen.append(lengths.tolist())
        return 2.0 * scores - 1.0  # pm1

    v = continuation_rewards(Tok(), Task(), ["15"], leaf, cont, reward_fn)
    np.testing.assert_allclose(v, [[[0.0, 1.0], [0.0, 0.0]]])
    assert seen == [[7, 4, 7, 7, 3, 1]]  # whole-response lengths: kept prefix + continuation


def _chain_run(**kw):
    tc = TreeConfig(num_leaves=4, max_depth=2, segment_length=4, branch_factor=1, init_divergence=4, fallback=False)
    return RunConfig(rollout=tc, estimator="spo_chain", **kw)


def test_config_builds_continuations_and_refuses_what_cannot_work():
    cfg = _chain_run(estimator_options=SPOChainOptions(samples=3, max_cuts=2))
    cc = cfg.continuation_config()
    assert (cc.samples, cc.max_cuts, cc.threshold, cc.interval) == (3, 2, 0.9, 5)
    assert RunConfig().continuation_config() is None
    with pytest.raises(ConfigError, match="independent chains"):
        RunConfig(estimator="spo_chain")  # the default rollout branches
    with pytest.raises(ConfigError, match="reward_source"):
        _chain_run(reward_source="majority")
    with pytest.raises(ConfigError, match="SPOChainOptions"):
        _chain_run(estimator_options=estimator_spec("grpo").default_options())
    with pytest.raises(ValueError, match="multiple"):
        SPOChainOptions(samples=4, rows_per_round=6)
