"""Branching kernels vs slow Python references on random inputs."""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treejax.sampling.kernels import allocate_budget, divergence_weights, ngram_repetition, temperature_schedule


def ngram_ref(row, length, n, count):
    grams = [tuple(row[i : i + n]) for i in range(0, length - n + 1)]
    return any(grams.count(g) >= count for g in grams)


_ngram = jax.jit(ngram_repetition, static_argnames=("n", "count"))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(2, 4), st.integers(2, 5))
def test_ngram_repetition_matches_reference(seed, n, count, vocab):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (6, 16))
    lengths = rng.integers(0, 17, 6)
    got = np.asarray(_ngram(jnp.asarray(tokens), jnp.asarray(lengths), n=n, count=count))
    want = [ngram_ref(list(tokens[b]), int(lengths[b]), n, count) for b in range(6)]
    assert got.tolist() == want


def test_ngram_repetition_examples():
    tokens = jnp.array([[1, 2, 1, 2, 1, 2, 9, 9], [1, 1, 1, 1, 0, 0, 0, 0], [5, 6, 7, 8, 5, 6, 7, 8]])
    assert ngram_repetition(tokens, jnp.array([8, 4, 8]), n=2, count=3).tolist() == [True, True, False]
    assert ngram_repetition(tokens, jnp.array([5, 3, 8]), n=2, count=3).tolist() == [False, False, False]
    assert ngram_repetition(tokens, jnp.array([8, 8, 8]), n=4, count=2).tolist() == [True, False, True]
    with pytest.raises(ValueError, match="n >= 1"):
        ngram_repetition(tokens, jnp.array([8, 8, 8]), n=0, count=2)


def allocate_ref(weights, live, budget, minimum):
    """Exact largest remainder with Fractions."""
    live_idx = [i for i, l in enumerate(live) if l]
    out = [0] * len(weights)
    if not live_idx:
        return out
    total = max(int(budget), minimum * len(live_idx))
    rest = total - minimum * len(live_idx)
    w = [Fraction(max(int(weights[i]), 0)) for i in live_idx]
    if sum(w) == 0:
        w = [Fraction(1)] * len(live_idx)
    quotas = [rest * x / sum(w) for x in w]
    base = [int(q) for q in quotas]
    left = rest - sum(base)
    order = sorted(range(len(live_idx)), key=lambda k: (-(quotas[k] - base[k]), live_idx[k]))
    for k in order[:left]:
        base[k] += 1
    for k, i in enumerate(live_idx):
        out[i] = minimum + base[k]
    return out


_alloc = jax.jit(allocate_budget, static_argnames=("minimum",))


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 3))
def test_allocate_budget_matches_exact_reference(seed, minimum):
    rng = np.random.default_rng(seed)
    P, B = 4, 7
    weights = rng.integers(0, 6, (P, B))
    live = rng.random((P, B)) < 0.7
    budget = rng.integers(0, 30, P)
    got = np.asarray(_alloc(jnp.asarray(weights, jnp.float32), jnp.asarray(live), jnp.asarray(budget), minimum=minimum))
    want = np.array([allocate_ref(weights[p], live[p], budget[p], minimum) for p in range(P)])
    np.testing.assert_array_equal(got, want)
    n_live = live.sum(1)
    np.testing.assert_array_equal(got.sum(1), np.where(n_live > 0, np.maximum(budget, minimum * n_live), 0))
    assert np.all(got[~live] == 0) and np.all(got[live] >= minimum)


def test_allocate_budget_float_weights_and_ties():
    w = jnp.array([[0.3, 0.3, 0.3, 0.1], [1.0, 1.0, 1.0, 1.0]])
    live = jnp.array([[True, True, True, True], [True, False, True, True]])
    out = allocate_budget(w, live, jnp.array([8, 5]), minimum=1)
    # row 0: rest 4 -> quotas 1.2 1.2 1.2 0.4 -> floors 1 1 1 0, leftover 1 to the largest remainder (0.4, idx 3)
    # row 1: rest 2 over 3 equal items -> ties broken by index
    assert out.tolist() == [[2, 2, 2, 2], [2, 0, 2, 1]]


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0.5, 1.0, 2.0, 5.0]), st.sampled_from([1.0, -1.0]))
def test_divergence_weights_matches_reference(seed, temperature, sign):
    rng = np.random.default_rng(seed)
    x = rng.normal(-2.0, 1.5, (3, 6))
    live = rng.random((3, 6)) < 0.6
    got = np.asarray(divergence_weights(jnp.asarray(x, jnp.float32), jnp.asarray(live), temperature, sign))
    for p in range(3):
        idx = np.flatnonzero(live[p])
        want = np.zeros(6)
        if len(idx):
            z = sign * (x[p, idx] - x[p, idx].min()) / temperature
            want[idx] = np.exp(z) / np.exp(z).sum()
        np.testing.assert_allclose(got[p], want, rtol=1e-5, atol=1e-6)
        assert abs(got[p].sum() - (1.0 if len(idx) else 0.0)) < 1e-5


def test_temperature_schedule():
    assert float(temperature_schedule(0, 100)) == 5.0
    assert float(temperature_schedule(50, 100)) == 3.0
    assert float(temperature_schedule(100, 100)) == 1.0 and float(temperature_schedule(500, 100)) == 1.0
    np.testing.assert_allclose(float(temperature_schedule(50, 100, kind="exponential")), np.sqrt(5.0), rtol=1e-6)
    assert float(jax.jit(lambda s: temperature_schedule(s, 10, 2.0, 1.0))(5)) == 1.5
    with pytest.raises(ValueError, match="kind"):
        temperature_schedule(0, 10, kind="cosine")
