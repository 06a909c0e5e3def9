"""Sampling strategies: small frozen (hashable, jit-static) objects that turn logits into a sampling distribution.

Every strategy maps fp32 policy logits ``z [B, V]`` to *processed* logits ``z' [B, V]`` (``-inf`` on ids that
may not be sampled) and draws ``y ~ softmax(z')``:

  * :class:`Greedy`       ``y = argmax z`` (the sampling distribution is a point mass: its log-prob is 0);
  * :class:`Temperature`  ``z' = z / tau``;
  * :class:`TopK`         ``z' = z / tau`` on the ``k`` largest logits (ties at the k-th value are all kept), else -inf;
  * :class:`TopP`         nucleus sampling (Holtzman et al. 2020): keep the smallest set of most probable ids
    (under ``softmax(z / tau)``) whose mass reaches ``p`` — id ``i`` is kept iff the mass of the ids strictly
    more probable than it (sorted order) is ``< p``;
  * :class:`MinP`         keep ids with ``p_i >= p_min * max_j p_j`` under ``softmax(z / tau)`` (Nguyen et al. 2024).

Ids at or above the tokenizer's true vocabulary size (``ModelConfig.sampling_vocab_size``; Qwen pads its
embedding matrix) are always masked before any strategy runs (:func:`mask_vocab`): sampling such an id breaks
detokenization (TreePO issue #6).

Strategies are looked up by name once when a config is built (:func:`get_strategy`), never inside compute.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def mask_vocab(logits_BxV: jax.Array, sampling_vocab_size: int) -> jax.Array:
    """Sets logits of ids ``>= sampling_vocab_size`` to -inf."""
    V = logits_BxV.shape[-1]
    if sampling_vocab_size >= V:
        return logits_BxV
    valid = jnp.arange(V) < sampling_vocab_size
    return jnp.where(valid[None, :], logits_BxV, NEG_INF)


class Strategy:
    """Base class: ``process(logits) -> processed logits``; ``sample(key, logits) -> ids``."""

    greedy: bool = False

    def process(self, logits_BxV: jax.Array) -> jax.Array:
        raise NotImplementedError

    def sample(self, keys_B: jax.Array, logits_BxV: jax.Array) -> jax.Array:
        """One id per row, row ``b`` drawn with its own key ``keys_B[b]`` (so rows are independent of batching)."""
        processed = self.process(logits_BxV)
        return jax.vmap(lambda k, z: jax.random.categorical(k, z))(keys_B, processed).astype(jnp.int32)


def _check_temperature(name: str, temperature: float):
    if not temperature > 0:
        raise ValueError(f"{name}.temperature must be > 0, got {temperature}")


@dataclasses.dataclass(frozen=True)
class Greedy(Strategy):
    """Arg-max decoding (ties -> lowest id, like ``torch.argmax``)."""

    greedy = True

    def process(self, logits_BxV):
        best = jnp.argmax(logits_BxV, axis=-1)
        return jnp.where(jnp.arange(logits_BxV.shape[-1])[None, :] == best[:, None], 0.0, NEG_INF)

    def sample(self, keys_B, logits_BxV):
        del keys_B
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Temperature(Strategy):
    """Ancestral sampling from ``softmax(z / temperature)`` (temperature 1 = the policy itself)."""

    temperature: float = 1.0

    def __post_init__(self):
        _check_temperature("Temperature", self.temperature)

    def process(self, logits_BxV):
        return logits_BxV / self.temperature


@dataclasses.dataclass(frozen=True)
class TopK(Strategy):
    """Top-k sampling: the ``k`` largest logits (and any tied with the k-th), at ``temperature``."""

    k: int = 50
    temperature: float = 1.0

    def __post_init__(self):
        _check_temperature("TopK", self.temperature)
        if self.k < 1:
            raise ValueError(f"TopK.k must be >= 1, got {self.k}")

    def process(self, logits_BxV):
        z = logits_BxV / self.temperature
        k = min(self.k, z.shape[-1])
        kth = jax.lax.top_k(z, k)[0][:, k - 1]
        return jnp.where(z >= kth[:, None], z, NEG_INF)


@dataclasses.dataclass(frozen=True)
class TopP(Strategy):
    """Nucleus sampling: the smallest most-probable set with mass >= ``p`` (always >= 1 id), at ``temperature``."""

    p: float = 0.95
    temperature: float = 1.0

    def __post_init__(self):
        _check_temperature("TopP", self.temperature)
        if not 0 < self.p <= 1:
            raise ValueError(f"TopP.p must be in (0, 1], got {self.p}")

    def process(self, logits_BxV):
        z = logits_BxV / self.temperature
        order = jnp.argsort(-z, axis=-1)
        z_sorted = jnp.take_along_axis(z, order, axis=-1)
        probs = jax.nn.softmax(z_sorted, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = mass_before < self.p
        keep_sorted = keep_sorted.at[:, 0].set(True)
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(z.shape[0])[:, None], order].set(keep_sorted)
        return jnp.where(keep, z, NEG_INF)


@dataclasses.dataclass(frozen=True)
class MinP(Strategy):
    """Min-p sampling: ids with probability ``>= p * max probability``, at ``temperature``."""

    p: float = 0.05
    temperature: float = 1.0

    def __post_init__(self):
        _check_temperature("MinP", self.temperature)
        if not 0 <= self.p <= 1:
            raise ValueError(f"MinP.p must be in [0, 1], got {self.p}")

    def process(self, logits_BxV):
        z = logits_BxV / self.temperature
        # p_i >= p * p_max  <=>  z_i - z_max >= log p
        zmax = jnp.max(z, axis=-1, keepdims=True)
        return jnp.where(z - zmax >= jnp.log(self.p), z, NEG_INF)


_REGISTRY = {"greedy": Greedy, "temperature": Temperature, "top_k": TopK, "top_p": TopP, "min_p": MinP}


def get_strategy(name: str, **kwargs) -> Strategy:
    """Builds a strategy by name (``greedy``, ``temperature``, ``top_k``, ``top_p``, ``min_p``)."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown sampling strategy {name!r}; valid: {sorted(_REGISTRY)}")
    return _REGISTRY[name](**kwargs)


def token_statistics(logits_BxV: jax.Array, processed_BxV: jax.Array, tokens_B: jax.Array, greedy: bool):
    """Per-row ``(policy logprob, sampling logprob, policy entropy)`` of ``tokens_B``.

    policy logprob   ``log softmax(z)[y]`` (the policy at temperature 1, on the true vocabulary);
    sampling logprob ``log softmax(z')[y]`` (0 for greedy: a point mass);
    entropy          ``H = -sum_v p_v log p_v`` of the policy at temperature 1.
    """
    logp_all = jax.nn.log_softmax(logits_BxV, axis=-1)
    policy = jnp.take_along_axis(logp_all, tokens_B[:, None], axis=-1)[:, 0]
    if greedy:
        sampling = jnp.zeros_like(policy)
    else:
        sampling = jnp.take_along_axis(jax.nn.log_softmax(processed_BxV, axis=-1), tokens_B[:, None], axis=-1)[:, 0]
    p = jnp.exp(logp_all)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp_all, 0.0), axis=-1)
    return policy, sampling, entropy
