"""TRACE's fork rule (treejax.rl.trace): the scoring rows, the predicted success equal to a direct forward of the
prompt + prefix + answer, the rank allocation, and trees of turns built with it by the multi-turn source."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import presets, transformer
from treejax.rl.trace import TraceRule, make_prefix_scorer, prefix_rows
from treejax.sampling.multiturn import Episode, ForkRequest
from treejax.testing.envs import ScriptedToolEnv

CFG = presets.tiny_config("smollm2-135m", vocab_size=64)


def _episode(tokens):
    ep = Episode()
    ep._add(tokens, [-1.0] * len(tokens), policy=True)
    return ep


def test_prefix_rows_and_scores_match_a_direct_forward():
    params = transformer.init_params(CFG, jax.random.key(3))
    prompts, responses = [np.array([1, 2, 3]), np.array([4])], [[5, 6, 7, 8], []]
    answers, scored = [np.array([9, 10, 11]), np.array([12, 13])], [np.array([0, 1, 1]), np.array([1, 1])]
    tok, pos, seg, sc = prefix_rows(prompts, responses, answers, scored, width=16, rows=4)
    assert tok.shape == (4, 16) and seg[2:].sum() == 0 and sc[2:].sum() == 0
    np.testing.assert_array_equal(tok[0, :10], [1, 2, 3, 5, 6, 7, 8, 9, 10, 11])
    np.testing.assert_array_equal(sc[0, :10], [0, 0, 0, 0, 0, 0, 0, 0, 1, 1])
    got = np.asarray(make_prefix_scorer(CFG)(params, *(jnp.asarray(x) for x in (tok, pos, seg, sc))))
    for i in range(2):
        seq = list(prompts[i]) + responses[i] + list(answers[i])
        t = jnp.asarray(np.array(seq, np.int32)[None])
        h = transformer.forward(params, CFG, t, jnp.arange(len(seq))[None], jnp.ones_like(t))
        lp = np.asarray(jax.nn.log_softmax(transformer.logits(params, CFG, h[0]).astype(jnp.float32), -1))
        start = len(prompts[i]) + len(responses[i])
        want = np.mean([lp[start + j - 1, answers[i][j]] for j in range(len(answers[i])) if scored[i][j]])
        np.testing.assert_allclose(got[i], want, atol=1e-5)
    with pytest.raises(ValueError, match="exceeds the width"):
        prefix_rows(prompts, responses, answers, scored, width=6, rows=2)


def test_rank_allocation_forks_the_most_mixed_prefixes():
    p_hat = np.array([0.5, 0.01, 0.9, 0.3])  # u = .25, .0099, .09, .21: the 1st and 4th are the most mixed

    def score(params, tokens, positions, segment_ids, scored):
        out = np.zeros(tokens.shape[0], np.float32)
        k = min(4, len(out))
        out[:k] = np.log(p_hat)[:k]
        return out

    rule = TraceRule(score, None, [np.array([1])] * 4, [np.array([2])] * 4, [np.array([1.0])] * 4, width=8,
                     branch_factor=3, fraction=0.5)
    reqs = [ForkRequest(i, _episode([3]), slots) for i, slots in enumerate([4, 4, 4, 2])]
    assert rule(reqs) == [3, 1, 1, 2]
    np.testing.assert_allclose([h[0] for h in rule.history], p_hat, rtol=1e-6)
    assert TraceRule(score, None, [np.array([1])] * 4, [np.array([2])] * 4, [np.array([1.0])] * 4, width=8,
                     fraction=0.1)(reqs[:1]) == [2]  # at least one request forks
    with pytest.raises(ValueError, match="fraction"):
        TraceRule(score, None, [], [], [], width=8, fraction=0.0)


def _base():
    from treejax.sampling import tree
    from treejax.sampling.strategies import Temperature
    from treejax.sampling import decode
    from treejax.testing.tokenizers import CharTokenizer

    base = types.SimpleNamespace(cfg=types.SimpleNamespace(), pipeline=None, task=None, tokenizer=CharTokenizer(),
                                 sampler_fns=decode.make_model_fns(CFG, attention="dense", cache_dtype="float32"))
    base.rollout = types.SimpleNamespace(tree_config=tree.independent_config(4, 32, 8, strategy=Temperature(1.0),
                                                                             stop_ids=(63,)))
    base.draw = lambda: ([types.SimpleNamespace(ground_truth="3"), types.SimpleNamespace(ground_truth="42")],
                         np.array([[1, 2, 3], [1, 4, 0]], np.int32), np.array([3, 2], np.int32))
    base.rewards = lambda scores, lengths: (2.0 * scores - 1.0).astype(np.float32)
    return base


def test_source_builds_trace_trees():
    from treejax.rl.multiturn import MultiTurnConfig, MultiTurnRollouts

    params = transformer.init_params(CFG, jax.random.key(5))
    cfg = MultiTurnConfig(max_turns=3, turn_tokens=10, chunk=4, roots=1, branch_factor=2, fork_turns=2,
                          fork_rule="trace", trace_fraction=0.5)
    src = MultiTurnRollouts(_base(), cfg, make_env=ScriptedToolEnv, model_config=CFG, truth_prefix="A")
    ro = src.sample(params, jax.random.key(1), 0)
    m = ro.extra_metrics
    assert m["multiturn/trace_requests"] >= 2 and 0.0 < m["multiturn/trace_p_hat_mean"] < 1.0
    assert 0.0 < m["multiturn/trace_forked_frac"] < 1.0  # round 1: the single path forks; later rounds: half
    np.testing.assert_array_equal(np.asarray(ro.forest.leaf_weights()), 1.0)
    with pytest.raises(Exception, match="trace"):
        MultiTurnRollouts(_base(), cfg, make_env=ScriptedToolEnv)
