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

from treejax.registry import Registry

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


#: Every strategy class by name (gin knows each by its class name: ``TreeConfig.strategy = @TopP()``).
STRATEGIES: Registry[type] = Registry("sampling strategy", base=Strategy)
for _name, _cls in (("greedy", Greedy), ("temperature", Temperature), ("top_k", TopK), ("top_p", TopP),
                    ("min_p", MinP)):
    STRATEGIES.add(_name, _cls)
del _name, _cls


def get_strategy(name: str, **kwargs) -> Strategy:
    """Builds a strategy by name (``greedy``, ``temperature``, ``top_k``, ``top_p``, ``min_p``)."""
    return STRATEGIES.get(name)(**kwargs)


def inverse_cdf_sample(keys_B: jax.Array, logits_BxV: jax.Array, block: int = 128) -> jax.Array:
    """Draw ``y_b ~ softmax(z_b)``, right to a relative ~1e-6 for every id of probability >~ 1e-13 (see Precision).

    (The name is historical: the draw was a one-uniform inverse CDF until it was found to be biased at small
    probabilities, see below. The signature and the per-row keys are unchanged.)

    **Method: a two-level exponential race.** With ``e_v = exp(z_v - max z)``, the vocabulary cut into blocks of
    ``block`` ids with masses ``s_j = sum_{v in j} e_v`` and ``S = sum_j s_j``, and independent ``Exp(1)`` variates
    ``E_j`` (one per block) and ``E'_c`` (one per position inside a block)::

        J = argmin_j E_j / s_j            P(J = j)         = s_j / S     (E_j / s_j ~ Exp(s_j): the first of
        y = J*block + argmin_c E'_c / e_{J,c}   P(y = v | J = j) = e_v / s_j  independent exponential clocks rings
                                                                          with probability rate / total rate)

    so ``P(y = v) = e_v / S = p_v`` exactly in real arithmetic — for every id, wherever it sits in the vocabulary.
    It is Gumbel-max (``-log E`` is a Gumbel variate) done block-wise: ``jax.random.categorical`` needs ``B x V``
    variates (39M per step at 256 rows of Qwen's 151,936 ids), this needs ``B x (V/block + block)`` (2x32 random
    bits each). There are no cumulative sums, hence no position-dependent rounding.

    **Precision.** (1) Each ``E`` comes from 64 random bits ``K``: ``W = (K + 1/2) 2^-64`` (never 0 or 1);
    ``E = -log1p(-W)`` when ``W < 1/2``, else ``E = -log(1 - W)`` with ``1 - W = (~K + 1/2) 2^-64`` formed from the
    complemented bits, so the argument of either branch is a number in ``(0, 1/2]`` known to fp32 *relative*
    precision (~2^-23, not to an absolute 2^-24 as a float32 uniform in [0, 1) is). Hence ``|P(E <= x) - (1 -
    e^-x)| <= 2^-65 + ~1e-7 x`` and ``|P(E > x) - e^-x| <= 2^-65 + ~1e-7 x e^-x``: both tails are right to a
    relative ~1e-6 over ``3e-14 <= x <= 10`` (3e-6 at ``x = 30``). Small ``E`` is what matters: a light id beats a
    heavy one when ``E_light < (p_light / p_heavy) E_heavy``, an event of probability ~``p_light / p_heavy``. (2) The
    keys ``E / s`` are rounded to fp32 (relative 2^-24): the order of two keys flips only when they agree to ~2^-23,
    which moves each probability by a relative ~1e-7. (3) ``e_v`` and ``s_j`` carry the relative error of any fp32
    softmax (~1e-7 times ``|z_v - max z|``, plus the block sum's). Together: ``P(y = v) = p_v (1 + d) + a`` with
    ``|d| <~ 1e-6`` and ``|a| <~ (V/block + block) 2^-64 < 1e-16`` (the grid of ``W``), for every id whose ``e_v`` is
    a normal fp32 number (``p_v >~ 1e-38 max p``); smaller ones flush to 0 and, like ids with ``z = -inf``, are never
    drawn. An id of probability 1e-9 is drawn with probability 1e-9 (1 +- 1e-6), also at id 0 and right after a
    dominant id (``tests/sampling/test_decode.py`` integrates the exact preimage of such ids: relative error ~1e-6).

    The previous one-uniform inverse CDF ``y = F^{-1}(u)`` claimed "``P(y = v) = p_v`` up to fp32 rounding
    (relative ~1e-7)", but its errors were *absolute*, ~2^-24 of the total mass, i.e. relative ``6e-8 / p_v``:
    ``u`` had a 2^-23 grid and ``u = 0`` (probability 2^-23) returned the first id with any mass, so an id of
    probability 1e-9 at the front was drawn ~1.2e-7 of the time, and an id of probability 5e-8 right after a
    dominant one was lost in the rounding of the cumulative sum (``fl(1 + 5e-8) = 1``) and never drawn.

    Cost: one fused ``exp``-and-block-sum reduction over ``[B, V]`` (``exp(z - max z)`` is not stored: the chosen
    block's ``e`` is recomputed from its ``block`` logits), ``2 B (V/block + block)`` random words, then divisions
    and arg-mins over ``[B, V/block]`` and ``[B, block]``. Rows with no finite logit are undefined (as for
    ``jax.random.categorical``).
    """
    B, V = logits_BxV.shape
    nb = -(-V // block)
    bits = jax.vmap(lambda k: jax.random.bits(k, (2, nb + block), jnp.uint32))(keys_B)  # [B, 2, nb + block]
    exps = _exponentials_from_bits(bits[:, 0], bits[:, 1])
    return _draw_from_exponentials(logits_BxV, exps[:, :nb], exps[:, nb:])


def _exponentials_from_bits(hi: jax.Array, lo: jax.Array) -> jax.Array:
    """``Exp(1)`` variates (fp32, finite, > 0) from 64 random bits ``K = hi * 2^32 + lo`` (``uint32`` arrays).

    ``W = (K + 1/2) 2^-64``; ``E = -log1p(-W)`` if ``W < 1/2`` (top bit 0), else ``E = -log(1 - W)`` where
    ``1 - W = (~K + 1/2) 2^-64`` uses the complemented bits: both branches see a number in ``(0, 1/2]`` with fp32
    relative precision, so small and large ``E`` are both resolved (``E`` ranges over ``[2^-65, 45.1]``) and ``E``
    is non-decreasing in ``K`` up to fp32 rounding (relative ~2^-23).
    """
    hi, lo = hi.astype(jnp.uint32), lo.astype(jnp.uint32)
    upper = hi >= jnp.uint32(1 << 31)
    h = jnp.where(upper, ~hi, hi)  # < 2^31
    l = jnp.where(upper, ~lo, lo)
    w = h.astype(jnp.float32) * jnp.float32(2.0 ** -32) + (l.astype(jnp.float32) + 0.5) * jnp.float32(2.0 ** -64)
    return jnp.where(upper, -jnp.log(w), -jnp.log1p(-w))


def _draw_from_exponentials(logits_BxV: jax.Array, exp_blocks_BxN: jax.Array, exp_ids_BxC: jax.Array) -> jax.Array:
    """The race of :func:`inverse_cdf_sample` for given ``Exp(1)`` variates: ``exp_blocks [B, ceil(V / C)]`` (one
    per block) and ``exp_ids [B, C]`` (one per position inside the chosen block; ``C`` is the block size).

    Ties (fp32-equal keys) go to the lowest index. A block/id with zero mass has key ``+inf`` and is never chosen;
    finite keys are clipped to the largest float, so a chosen block always yields an id with ``e_v > 0``.
    """
    B, V = logits_BxV.shape
    C = exp_ids_BxC.shape[-1]
    nb = exp_blocks_BxN.shape[-1]
    if nb != -(-V // C):
        raise ValueError(f"{nb} block variates for V={V} in blocks of {C}: expected {-(-V // C)}")
    z = logits_BxV.astype(jnp.float32)
    if nb * C != V:
        z = jnp.pad(z, ((0, 0), (0, nb * C - V)), constant_values=NEG_INF)
    z = z.reshape(B, nb, C)
    m = jnp.max(z, axis=(1, 2))[:, None, None]  # the max entry has e = 1, so every row has mass
    mass = jnp.sum(jnp.exp(z - m), axis=-1)  # [B, nb]: a reduction, e = exp(z - m) is never stored
    big = jnp.finfo(jnp.float32).max

    def race(clocks, rates):
        keys = jnp.where(rates > 0, jnp.minimum(clocks / rates, big), jnp.inf)
        return jnp.argmin(keys, axis=-1).astype(jnp.int32)

    j = race(exp_blocks_BxN.astype(jnp.float32), mass)  # [B]
    inside = jnp.exp(jnp.take_along_axis(z, j[:, None, None], axis=1) - m)[:, 0]  # [B, C]: e of the chosen block
    return j * C + race(exp_ids_BxC.astype(jnp.float32), inside)


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
