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
        return inverse_cdf_sample(keys_B, self.process(logits_BxV))


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
        # At temperature 1 the processed logits *are* the policy's: token_statistics then skips a second softmax.
        return logits_BxV if self.temperature == 1.0 else logits_BxV / self.temperature


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


def inverse_cdf_sample(keys_B: jax.Array, logits_BxV: jax.Array, block: int = 128) -> jax.Array:
    """Exact draw ``y_b ~ softmax(z_b)`` with one uniform per row (two-level inverse CDF).

    ``jax.random.categorical`` draws one Gumbel variate per vocabulary entry (``B x V`` threefry hashes, e.g.
    39M per step at 256 rows of Qwen's 151,936 ids). Here a row needs one ``u ~ U(0, 1)``:

        e_v = exp(z_v - max z),   the vocabulary cut into blocks of ``block`` ids with masses s_j = sum_{v in j} e_v,
        c_j = s_0 + ... + s_j,    t = u * c_last,
        j*  = first block with c_j >= t (and s_j > 0),   then inside it
        y   = first id v of j* with (c_{j*} - s_{j*}) + e_{j*,0} + ... + e_v >= t (and e_v > 0),

    i.e. ``y = F^{-1}(u)`` for the CDF ``F`` of ``softmax(z)`` in vocabulary order, so ``P(y = v) = p_v`` up to
    fp32 rounding of the partial sums (relative ~1e-7). Ids with ``z = -inf`` have ``e = 0`` and are never picked:
    the ``> 0`` conditions also guard against rounding (a block/id chosen past the last cumulative sum falls back
    to the last one with mass). Cost: one ``exp`` pass and one block reduction over ``[B, V]``, then work on
    ``[B, V / block]`` and ``[B, block]``.
    """
    B, V = logits_BxV.shape
    nb = -(-V // block)
    z = logits_BxV.astype(jnp.float32)
    if nb * block != V:
        z = jnp.pad(z, ((0, 0), (0, nb * block - V)), constant_values=NEG_INF)
    m = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - m).reshape(B, nb, block)  # [B, nb, C]; the max entry has e = 1, so every row has mass
    mass = jnp.sum(e, axis=-1)  # [B, nb]
    cum = jnp.cumsum(mass, axis=-1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys_B)
    target = jnp.maximum(u, jnp.finfo(jnp.float32).tiny) * cum[:, -1]  # (0, total]

    def first_or_last(hit, positive):
        """Index of the first ``hit & positive`` entry per row, else of the last ``positive`` one."""
        n = hit.shape[-1]
        idx = jnp.arange(n, dtype=jnp.int32)[None, :]
        first = jnp.min(jnp.where(hit & positive, idx, n), axis=-1)
        last = jnp.max(jnp.where(positive, idx, -1), axis=-1)
        return jnp.where(first < n, first, last)

    j = first_or_last(cum >= target[:, None], mass > 0)  # [B]
    inside = jnp.take_along_axis(e, j[:, None, None], axis=1)[:, 0]  # [B, C]
    before = jnp.take_along_axis(cum - mass, j[:, None], axis=1)[:, 0]
    within = first_or_last(jnp.cumsum(inside, axis=-1) >= (target - before)[:, None], inside > 0)
    return (j * block + within).astype(jnp.int32)


def token_statistics(logits_BxV: jax.Array, processed_BxV: jax.Array, tokens_B: jax.Array, greedy: bool,
                     with_entropy: bool = True):
    """Per-row ``(policy logprob, sampling logprob, policy entropy)`` of ``tokens_B``.

    policy logprob   ``z_y - logsumexp(z)`` (the policy at temperature 1, on the true vocabulary);
    sampling logprob ``z'_y - logsumexp(z')`` (0 for greedy: a point mass; the policy's when ``z' is z``);
    entropy          ``H = lse - sum_v p_v z_v`` of the policy at temperature 1 (zeros unless ``with_entropy``).
    Only reductions over ``[B, V]`` plus a gather: no ``[B, V]`` log-softmax is materialised.
    """
    tok = tokens_B[:, None]
    lse = jax.nn.logsumexp(logits_BxV, axis=-1)
    policy = jnp.take_along_axis(logits_BxV, tok, axis=-1)[:, 0] - lse
    if greedy:
        sampling = jnp.zeros_like(policy)
    elif processed_BxV is logits_BxV:
        sampling = policy
    else:
        sampling = (jnp.take_along_axis(processed_BxV, tok, axis=-1)[:, 0]
                    - jax.nn.logsumexp(processed_BxV, axis=-1))
    if not with_entropy:
        return policy, sampling, jnp.zeros_like(policy)
    p = jnp.exp(logits_BxV - lse[:, None])
    entropy = lse - jnp.sum(jnp.where(p > 0, p * logits_BxV, 0.0), axis=-1)
    return policy, sampling, entropy
