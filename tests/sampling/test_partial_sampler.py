"""Partial rollouts (treejax.sampling.partial, APRIL): run to the end they equal the tree sampler's independent
chains token for token; stopped early they stop at the first segment boundary where enough groups are complete;
a stopped row resumed from its prefix (re-prefilled) draws exactly what it would have drawn uninterrupted."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from treejax.forest import NodeStatus
from treejax.models import presets, transformer
from treejax.sampling import decode, partial, tree
from treejax.sampling.strategies import Temperature

CFG = presets.tiny_config("smollm2-135m", vocab_size=64)
FNS = decode.make_model_fns(CFG, attention="dense", cache_dtype="float32")
W, S, D = 4, 4, 6
TC = tree.independent_config(W, S * D, S, strategy=Temperature(1.0), stop_ids=(7, 8, 9, 10), repetition_ngram=2,
                             repetition_count=4)
PROMPTS = np.array([[1, 5, 9, 2, 7], [1, 11, 3, 4, 0], [1, 2, 3, 0, 0]], np.int32)
LENS = np.array([5, 4, 3], np.int32)
ALIVE = int(NodeStatus.ALIVE)
SAMPLER = partial.make_partial_rollout(FNS, TC)  # one compiled program for every test here


@pytest.fixture(scope="module")
def params():
    return transformer.init_params(CFG, jax.random.key(3))


def _rows(n_groups):
    idx = np.repeat(np.arange(n_groups), W)
    return PROMPTS[idx], LENS[idx]


def _empty(R):
    z = np.zeros((R, TC.response_capacity))
    return z.astype(np.int32), z.astype(np.float32), z.astype(np.float32), np.zeros(R, np.int32)


def test_to_the_end_equals_the_tree_samplers_chains(params):
    key = jax.random.key(11)
    forest, _ = tree.make_tree_rollout(FNS, TC)(params, PROMPTS, LENS, key)
    sampler = SAMPLER
    prompts, lens = _rows(3)
    R = 3 * W
    out = sampler(params, prompts, lens, *_empty(R), np.ones(R, bool), np.zeros(R, np.int32), key, 3)
    # the tree's leaf store is in end order; match each leaf to its row by tokens
    got_len = np.asarray(out.length_R).reshape(3, W)
    got_tok = np.asarray(out.tokens_RxT).reshape(3, W, -1)
    got_status = np.asarray(out.status_R).reshape(3, W)
    assert not (got_status == ALIVE).any()
    for p in range(3):
        want = sorted((tuple(np.asarray(forest.tokens)[p, w, :int(forest.leaf_length[p, w])]),
                       int(forest.leaf_status[p, w])) for w in range(W))
        have = sorted((tuple(got_tok[p, w, :got_len[p, w]]), int(got_status[p, w])) for w in range(W))
        assert want == have
    assert int(out.decoded_tokens) == int(np.sum(got_len))
    assert int(out.complete_groups) == 3


def test_stops_at_the_first_boundary_with_enough_complete_groups(params):
    sampler = SAMPLER
    prompts, lens = _rows(3)
    R = 3 * W
    key = jax.random.key(1)
    full = sampler(params, prompts, lens, *_empty(R), np.ones(R, bool), np.zeros(R, np.int32), key, 3)
    full_len = np.asarray(full.length_R).reshape(3, W)
    # a group is complete after ceil(max length / S) segments: the first stop comes after the earliest of them
    seg_done = np.ceil(full_len.max(axis=1) / S).astype(int)
    out = sampler(params, prompts, lens, *_empty(R), np.ones(R, bool), np.zeros(R, np.int32), key, 1)
    assert int(out.segments) == seg_done.min()
    assert int(out.complete_groups) >= 1
    status = np.asarray(out.status_R)
    length = np.asarray(out.length_R)
    live = status == ALIVE
    assert live.any() and np.all(length[live] == S * seg_done.min())
    # what was decoded agrees with the uninterrupted call
    for r in range(R):
        n = length[r]
        np.testing.assert_array_equal(np.asarray(out.tokens_RxT)[r, :n], np.asarray(full.tokens_RxT)[r, :n])


def test_a_resumed_row_draws_what_it_would_have_uninterrupted(params):
    sampler = SAMPLER
    prompts, lens = _rows(3)
    R = 3 * W
    key = jax.random.key(1)
    full = sampler(params, prompts, lens, *_empty(R), np.ones(R, bool), np.zeros(R, np.int32), key, 3)
    first = sampler(params, prompts, lens, *_empty(R), np.ones(R, bool), np.zeros(R, np.int32), key, 1)
    status = np.asarray(first.status_R)
    live = status == ALIVE
    assert live.any() and (~live).any()
    second = sampler(params, prompts, lens, np.asarray(first.tokens_RxT), np.asarray(first.logprobs_RxT),
                     np.asarray(first.sampling_logprobs_RxT), np.asarray(first.length_R), live, status, key, 3)
    np.testing.assert_array_equal(np.asarray(second.length_R), np.asarray(full.length_R))
    np.testing.assert_array_equal(np.asarray(second.tokens_RxT), np.asarray(full.tokens_RxT))
    np.testing.assert_array_equal(np.asarray(second.status_R), np.asarray(full.status_R))
    np.testing.assert_allclose(np.asarray(second.logprobs_RxT), np.asarray(full.logprobs_RxT), atol=1e-5)
    # only the resumed rows decoded, and only their new tokens count
    new = np.asarray(second.length_R) - np.asarray(first.length_R)
    assert int(second.decoded_tokens) == int(new.sum())
    assert int(first.decoded_tokens) + int(second.decoded_tokens) == int(full.decoded_tokens)


def test_refuses_trees_and_bad_prefixes(params):
    with pytest.raises(ValueError, match="branch_factor=2"):
        partial.make_partial_rollout(FNS, dataclasses.replace(TC, branch_factor=2, init_divergence=2))
    sampler = SAMPLER
    prompts, lens = _rows(1)
    tok, lp, slp, k = _empty(W)
    with pytest.raises(ValueError, match="whole number of segments"):
        sampler(params, prompts, lens, tok, lp, slp, k + 3, np.ones(W, bool), np.zeros(W, np.int32),
                jax.random.key(0), 1)
    with pytest.raises(ValueError, match="whole groups"):
        sampler(params, prompts[:3], lens[:3], tok[:3], lp[:3], slp[:3], k[:3], np.ones(3, bool),
                np.zeros(3, np.int32), jax.random.key(0), 1)
