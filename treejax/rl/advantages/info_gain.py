"""Information-gain turn advantages over a turn forest: IGPO and A2TGPO (from the ground truth's probability), and
InfoPO (from the counterfactual shift of the next action when a turn's feedback is masked, :func:`infopo`).

Both read ``truth_logp_PxN [P, N]`` (:func:`treejax.rl.info_gain.truth_logprobs`): for every node ``n`` the
length-normalised log-probability of the ground-truth answer after the response through ``n`` (the root: after
the prompt alone). A node at depth ``d >= 1`` is one turn; leaf ``w``'s turns are the nodes of its path,
``t = 0 .. K_w - 1`` (``K_w`` its depth, turn ``t`` at depth ``t + 1``), the last one its final (answer) turn.

Turn value and information gain (``info_gain`` option; IGPO's official ``info_gain_type``)::

    v(n) = exp(truth_logp[n])   ("prob_diff", the paper's pi(a | q, o_<=t); default)
         = truth_logp[n]        ("log_prob_diff")
    IG(n) = v(n) - v(parent(n))

A node's IG is canonical (one number per node, the same on every leaf through it); the per-leaf advantages differ
where the leaves' futures differ. Group statistics count each leaf slot's turns once, weighted by
``Forest.leaf_weight`` (all ones for slot trees and independent samples, where this is exactly the official
codes' statistics over independent rollouts; a node shared by k leaves then counts k times, as its turn does in
each of those k trajectories). Statistics use the official codes' convention::

    mean = sum(w x) / sum(w),  std = sqrt(sum(w (x - mean)^2) / sum(w) + 1e-8)  (std = 1 if the group has <= 1
    entry),  normalised x = (x - mean) / (std + eps)   (or x - mean with scale_by_std=False)

Per-token advantages are each turn's advantage on the turn's *policy* tokens (``loss_mask``; observation tokens
get 0) via ``segment_index``; ``Advantages.segments`` holds the per-turn values ``[P, W, D]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from treejax.forest import Forest
from treejax.rl.advantages.common import broadcast_segments, check_rewards, pairwise_sum
from treejax.rl.advantages.registry import Advantages, register_estimator

INFO_GAINS = ("prob_diff", "log_prob_diff")
IGPO_NORMS = ("joint", "separate")
_VAR_FLOOR = 1e-8  # inside the sqrt, as both official codes


def _check_common(name: str, o) -> None:
    if o.info_gain not in INFO_GAINS:
        raise ValueError(f"{name}.info_gain must be one of {INFO_GAINS}, got {o.info_gain!r}")
    if not 0.0 <= o.gamma <= 1.0:
        raise ValueError(f"{name}.gamma must be in [0, 1], got {o.gamma}")
    if not o.eps > 0.0:
        raise ValueError(f"{name}.eps must be > 0, got {o.eps}")


@dataclasses.dataclass(frozen=True)
class IGPOOptions:
    """``gamma``: turn discount of the cumulative sum (official default 1.0); ``info_gain``: ``"prob_diff"`` (paper)
    or ``"log_prob_diff"``; ``normalization``: ``"joint"`` (info gains and outcomes of a prompt in one group, the
    paper and the official default) or ``"separate"`` (each kind its own group); ``scale_by_std`` / ``eps``: divide
    by ``std + eps`` (verl's ``norm_adv_by_std_in_grpo``, eps 1e-6); ``info_gain_coef`` / ``outcome_coef``: constant
    weights of the two reward kinds before normalisation (the official curriculum's weights, held fixed)."""

    gamma: float = 1.0
    info_gain: str = "prob_diff"
    normalization: str = "joint"
    scale_by_std: bool = True
    eps: float = 1e-6
    info_gain_coef: float = 1.0
    outcome_coef: float = 1.0

    def __post_init__(self):
        _check_common("IGPOOptions", self)
        if self.normalization not in IGPO_NORMS:
            raise ValueError(f"IGPOOptions.normalization must be one of {IGPO_NORMS}, got {self.normalization!r}")


@dataclasses.dataclass(frozen=True)
class A2TGPOOptions:
    """``alpha``: weight of the rescaled information-gain sum (official recipe 0.3); ``clip_beta``: half-width of
    the adaptive clip multiplier, ``c in (1 - beta, 1 + beta)`` (official 0.3); ``adaptive_clip``: return the
    adaptive turn-level clip as ``Advantages.clip_scale`` (the paper's method, default; ``False``: plain
    token-level PPO clip ranges); ``gamma``, ``info_gain``, ``scale_by_std``, ``eps`` as in :class:`IGPOOptions`."""

    alpha: float = 0.3
    clip_beta: float = 0.3
    adaptive_clip: bool = True
    gamma: float = 1.0
    info_gain: str = "prob_diff"
    scale_by_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        _check_common("A2TGPOOptions", self)
        if self.alpha < 0.0:
            raise ValueError(f"A2TGPOOptions.alpha must be >= 0, got {self.alpha}")
        if not 0.0 <= self.clip_beta < 1.0:
            raise ValueError(f"A2TGPOOptions.clip_beta must be in [0, 1), got {self.clip_beta}")


# ------------------------------------------------------------------------------------------------ pieces
def turn_layout(forest: Forest) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(nodes [P, W, D], valid [P, W, D], final [P, W, D])``: leaf ``w``'s turn-``t`` node, whether the turn
    exists (used leaf slot, ``t < K_w``) and whether it is the leaf's final turn (``t = K_w - 1``)."""
    path = forest.leaf_path
    nodes = path[:, :, 1:]
    valid = (nodes >= 0) & (path[:, :, :1] >= 0)
    depth = jnp.sum(valid, axis=-1)
    t = jnp.arange(nodes.shape[-1])[None, None, :]
    return nodes, valid, valid & (t == depth[:, :, None] - 1)


def turn_info_gains(forest: Forest, truth_logp_PxN: jax.Array, info_gain: str) -> jax.Array:
    """float32[P, W, D]: ``IG`` of each leaf's turn-``t`` node, ``v(node) - v(previous node on the path)`` (0 where
    the turn does not exist)."""
    P, N = forest.node_parent.shape
    truth = jnp.asarray(truth_logp_PxN, jnp.float32)
    if tuple(truth.shape) != (P, N):
        raise ValueError(f"truth_logp_PxN has shape {tuple(truth.shape)}, the forest has [P, N] = {(P, N)}")
    value = jnp.exp(truth) if info_gain == "prob_diff" else truth
    path = jnp.clip(forest.leaf_path, 0, N - 1)
    v = jnp.take_along_axis(value[:, None, :], path, axis=-1)  # [P, W, D+1]
    _, valid, _ = turn_layout(forest)
    return jnp.where(valid, v[:, :, 1:] - v[:, :, :-1], 0.0)


def group_normalize(x: jax.Array, member: jax.Array, weight: jax.Array, scale_by_std: bool, eps: float) -> jax.Array:
    """``(x - mean) / (std + eps)`` over the entries with ``member`` of each group = each row of the *last* axis,
    weighted by ``weight``; statistics as in the module docstring; 0 outside ``member``.

    Shifted data (as :func:`treejax.rl.advantages.common.whiten_stats`): with ``c`` the group's first member,
    ``mean = c + sum(w (x - c)) / sum(w)``, so a group of equal values gives exactly 0 (its std is then
    ``sqrt(1e-8)``, and rounding noise in the mean would be amplified 1e4-fold)."""
    w = jnp.where(member, weight, 0.0).astype(jnp.float32)
    first = jnp.argmax(member, axis=-1)[..., None]
    c = jnp.take_along_axis(x, first, axis=-1)
    dx = jnp.where(member, x - c, 0.0)
    sum_w = pairwise_sum(w, axis=-1)[..., None]
    inv = 1.0 / jnp.maximum(sum_w, 1e-30)
    d = jnp.where(member, dx - pairwise_sum(w * dx, axis=-1)[..., None] * inv, 0.0)
    var = pairwise_sum(w * d * d, axis=-1)[..., None] * inv
    count = jnp.sum(member, axis=-1, keepdims=True)
    std = jnp.where(count <= 1, 1.0, jnp.sqrt(var + _VAR_FLOOR))
    out = d / (std + eps) if scale_by_std else d
    return jnp.where(member, out, 0.0)


def discounted_to_go(x_PxWxD: jax.Array, valid: jax.Array, gamma: float) -> jax.Array:
    """``sum_{k >= t} gamma^(k - t) x[..., k]`` over the valid turns (a path's turns are a prefix of the axis)."""
    D = x_PxWxD.shape[-1]
    acc = jnp.zeros(x_PxWxD.shape[:-1], jnp.float32)
    out = []
    for t in range(D - 1, -1, -1):
        acc = jnp.where(valid[..., t], x_PxWxD[..., t] + gamma * acc, 0.0)
        out.append(acc)
    return jnp.stack(out[::-1], axis=-1)


def _tokens(forest: Forest, turns_PxWxD: jax.Array) -> jax.Array:
    return broadcast_segments(turns_PxWxD, forest.segment_index, forest.loss_mask)


# ------------------------------------------------------------------------------------------------ IGPO
@register_estimator("igpo", IGPOOptions, inputs=("truth_logp_PxN",))
def igpo(forest: Forest, rewards_PxW: jax.Array, options: IGPOOptions = IGPOOptions(), *,
         truth_logp_PxN: jax.Array) -> Advantages:
    """IGPO (Wang et al. 2025, arXiv 2510.14967): dense turn rewards from information gain, group-normalised, then
    discounted to go.

    Turn rewards of leaf ``w`` (``t = 0 .. K_w - 1``)::

        r_{w,t} = info_gain_coef * IG(node_t)     t < K_w - 1   (IG = pi(a|q,o_<=t) - pi(a|q,o_<=t-1), default)
        r_{w,K_w-1} = outcome_coef * R_w           the final turn: the leaf's (outcome) reward

    ``joint`` (default): ``r_hat = (r - mean_p) / (std_p + eps)`` with the statistics over all turn rewards of
    prompt ``p``'s leaf slots (weighted by ``leaf_weight``); ``separate``: info gains and outcomes each normalised
    over their own entries of the prompt. Turn advantage and tokens::

        A_{w,t} = sum_{k = t}^{K_w - 1} gamma^(k - t) r_hat_{w,k},     token advantage = A_{w,t} on turn t's
                                                                         policy tokens, 0 on observations

    Variant: the official code (GuoqingWang1/IGPO, ``compute_grpo_outcome_advantage`` with ``info_gain_norm_mode``)
    marks turns by the positions of non-zero token rewards, so an information gain of exactly 0 drops out of its
    group statistics and merges its turn with the next one; here turns come from the forest, every turn keeps its
    reward (an exact 0 included). The official code scores a turn only while the episode continues, so a final
    turn is always rewarded by the outcome; the same rule here. ``truth_logp_PxN`` [P, N]:
    :func:`treejax.rl.info_gain.truth_logprobs`.
    """
    R = check_rewards(forest, rewards_PxW)
    _, valid, final = turn_layout(forest)
    ig = turn_info_gains(forest, truth_logp_PxN, options.info_gain)
    r = jnp.where(final, options.outcome_coef * R[:, :, None], options.info_gain_coef * ig)
    P, W, D = r.shape
    flat = lambda x: x.reshape((P, W * D))  # noqa: E731  (one group per prompt: all its leaves' turns)
    weight = flat(jnp.broadcast_to(forest.leaf_weights()[:, :, None], r.shape))
    norm = lambda member: group_normalize(flat(r), flat(member), weight, options.scale_by_std,  # noqa: E731
                                          options.eps).reshape((P, W, D))
    r_hat = norm(valid) if options.normalization == "joint" else norm(final) + norm(valid & ~final)
    adv = discounted_to_go(r_hat, valid, options.gamma)
    return Advantages(tokens=_tokens(forest, adv), loss_mask=forest.loss_mask, segments=adv)


# ------------------------------------------------------------------------------------------------ A2TGPO
def a2tgpo_turns(forest: Forest, rewards_PxW: jax.Array, options: A2TGPOOptions, truth_logp_PxN: jax.Array):
    """``(advantages [P, W, D], clip_scale [P, W, D])`` of :func:`a2tgpo` (clip scale 1 on final and absent turns)."""
    R = check_rewards(forest, rewards_PxW)
    _, valid, final = turn_layout(forest)
    ig_turn = valid & ~final
    ig = turn_info_gains(forest, truth_logp_PxN, options.info_gain)
    lw = forest.leaf_weights()
    used = forest.leaf_path[:, :, 0] >= 0
    outcome = group_normalize(R, used, lw, options.scale_by_std, options.eps)  # [P, W]
    by_turn = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [P, W, D] <-> [P, D, W]: groups (prompt, turn index)
    z = by_turn(group_normalize(by_turn(ig), by_turn(ig_turn), by_turn(jnp.broadcast_to(lw[:, :, None], ig.shape)),
                                options.scale_by_std, options.eps))
    terms = jnp.sum(ig_turn, axis=-1, keepdims=True) - jnp.arange(ig.shape[-1])[None, None, :]  # K_w - 1 - t
    to_go = discounted_to_go(z, ig_turn, options.gamma) / jnp.sqrt(jnp.maximum(terms, 1).astype(jnp.float32))
    adv = jnp.where(valid, outcome[:, :, None] + jnp.where(ig_turn, options.alpha * to_go, 0.0), 0.0)
    clip = jnp.where(ig_turn, 1.0 + options.clip_beta * (2.0 * jax.nn.sigmoid(z) - 1.0), 1.0)
    return adv, clip


@register_estimator("a2tgpo", A2TGPOOptions, inputs=("truth_logp_PxN",))
def a2tgpo(forest: Forest, rewards_PxW: jax.Array, options: A2TGPOOptions = A2TGPOOptions(), *,
           truth_logp_PxN: jax.Array) -> Advantages:
    """A2TGPO's advantages (Chen et al. 2026, "Agentic Turn-Group Policy Optimization with Adaptive Turn-level
    Clipping", arXiv 2605.06200; the official code's ``info_gain_norm_mode="turn-group-v1d"``).

    Outcome: ``O_w = (R_w - mean_p R) / (std_p + eps)`` over prompt ``p``'s leaf slots. Turn-group normalisation of
    the information gains of the non-final turns, per (prompt, turn index ``t``)::

        z_{w,t} = (IG_{w,t} - mean_{p,t} IG) / (std_{p,t} + eps)          over the leaves of p with a turn-t IG

    Variance-rescaled discounted accumulation and the turn advantages (``n_{w,t} = K_w - 1 - t`` terms)::

        D_{w,t} = sum_{k = t}^{K_w - 2} gamma^(k - t) z_{w,k} / sqrt(n_{w,t})
        A_{w,t} = O_w + alpha * D_{w,t}     t < K_w - 1,          A_{w,K_w-1} = O_w   (the final turn)

    broadcast to each turn's policy tokens (0 on observations). The adaptive turn-level clip (the paper's third
    part) is :func:`a2tgpo_clip_scale`: ``c_{w,t} = 1 + clip_beta (2 sigmoid(z_{w,t}) - 1)`` on non-final turns, 1
    on the final turn, multiplying both PPO clip ranges (``policy_loss(..., eps_scale_BxT=...)``). With
    ``options.adaptive_clip`` (default) its per-token values are ``Advantages.clip_scale``, which the learner
    carries to the loss (:func:`treejax.rl.step.learn`); without, ``clip_scale`` is ``None``.

    Variant notes: the official code indexes a leaf's IG turns by the positions of non-zero token rewards (an IG of
    exactly 0 is skipped and does not count as a turn); here the turn index is the depth - 1 of the turn's node,
    every non-final turn counts. Its turn-level (sequence-per-turn) importance ratio (``ENABLE_POLICY_LOSS_GSPO_TURN``)
    is a loss change not built here: this estimator feeds the token-level PPO-clip loss.
    """
    adv, clip = a2tgpo_turns(forest, rewards_PxW, options, truth_logp_PxN)
    return Advantages(tokens=_tokens(forest, adv), loss_mask=forest.loss_mask, segments=adv,
                      clip_scale=_clip_tokens(forest, clip) if options.adaptive_clip else None)


def _clip_tokens(forest: Forest, clip_PxWxD: jax.Array) -> jax.Array:
    """float32[P, W, T]: each turn's clip multiplier on its policy tokens (``loss_mask``), 1 elsewhere."""
    idx = jnp.clip(forest.segment_index, 0, clip_PxWxD.shape[-1] - 1)
    per_token = jnp.where((forest.loss_mask > 0) & (forest.segment_index >= 0),
                          jnp.take_along_axis(clip_PxWxD, idx, axis=-1), 1.0)
    return per_token.astype(jnp.float32)


def a2tgpo_clip_scale(forest: Forest, rewards_PxW: jax.Array, options: A2TGPOOptions,
                      truth_logp_PxN: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A2TGPO's adaptive turn-level clip: ``(per_turn [P, W, D], per_token [P, W, T])`` multipliers of the clip
    ranges, ``c = 1 + clip_beta (2 sigmoid(z) - 1)`` on non-final turns (``z`` the turn-group-normalised IG of
    :func:`a2tgpo`), 1 on final turns, observation tokens, padding and absent turns. Feed ``per_token`` (rows
    flattened like the advantages) to :func:`treejax.rl.losses.policy_loss` as ``eps_scale_BxT`` (the learner does
    this itself with ``options.adaptive_clip``: ``per_token`` is :func:`a2tgpo`'s ``Advantages.clip_scale``)."""
    _, clip = a2tgpo_turns(forest, rewards_PxW, options, truth_logp_PxN)
    return clip, _clip_tokens(forest, clip)


# ------------------------------------------------------------------------------------------------ InfoPO
@dataclasses.dataclass(frozen=True)
class InfoPOOptions:
    """``intrinsic_weight`` (beta): the information term's weight (official default 0.1; its decay over epochs,
    ``intrinsic_decay_rate``, is 0 in the official scripts and not built); ``gate_temperature`` (tau, official
    0.05); ``baseline_std``: the floor of the magnitude bound's target (official 1.0); ``scale_by_std`` / ``eps``:
    both group normalisations divide by ``std + eps`` (official 1e-6)."""

    intrinsic_weight: float = 0.1
    gate_temperature: float = 0.05
    baseline_std: float = 1.0
    scale_by_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        for name in ("intrinsic_weight", "baseline_std"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and v == v and v != float("inf")):
                raise ValueError(f"InfoPOOptions.{name} must be a finite number >= 0, got {v!r}")
        if not self.gate_temperature > 0:
            raise ValueError(f"InfoPOOptions.gate_temperature must be > 0, got {self.gate_temperature!r}")
        if not self.eps > 0:
            raise ValueError(f"InfoPOOptions.eps must be > 0, got {self.eps!r}")


def turn_feedback_gains(forest: Forest, feedback_gain_PxN: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(gain [P, W, D], has [P, W, D])``: leaf ``w``'s turn ``t`` gets the gain of its *next* turn's node
    (``g(node_{t+1})``: the feedback turn ``t`` obtained, measured on the action it led to; the official code's
    attribution), ``has`` where that node exists and its gain is finite (0 elsewhere)."""
    P, N = forest.node_parent.shape
    g = jnp.asarray(feedback_gain_PxN, jnp.float32)
    if tuple(g.shape) != (P, N):
        raise ValueError(f"feedback_gain_PxN has shape {tuple(g.shape)}, the forest has [P, N] = {(P, N)}")
    nodes, valid, _ = turn_layout(forest)
    nxt = jnp.concatenate([nodes[:, :, 1:], jnp.full(nodes.shape[:2] + (1,), -1, nodes.dtype)], axis=-1)
    val = jnp.take_along_axis(g[:, None, :], jnp.clip(nxt, 0, N - 1), axis=-1)
    has = valid & (nxt >= 0) & jnp.isfinite(val)
    return jnp.where(has, val, 0.0), has


def _weighted_std(x: jax.Array, w: jax.Array) -> jax.Array:
    """sqrt(sum(w (x - mean)^2) / sum(w)) over all entries (0 for no weight)."""
    sw = jnp.maximum(jnp.sum(w), 1e-30)
    mean = jnp.sum(w * x) / sw
    return jnp.sqrt(jnp.sum(w * (x - mean) ** 2) / sw)


def infopo_turns(forest: Forest, rewards_PxW, options: InfoPOOptions, feedback_gain_PxN):
    """``(advantages [P, W, D], parts)`` of :func:`infopo`; ``parts``: ``outcome [P, W]``, ``intrinsic [P, W, D]``
    (normalised gains), ``gate [P]``, ``ratio []``."""
    R = check_rewards(forest, rewards_PxW)
    _, valid, _ = turn_layout(forest)
    gain, has = turn_feedback_gains(forest, feedback_gain_PxN)
    P, W, D = gain.shape
    lw = forest.leaf_weights()
    used = forest.leaf_path[:, :, 0] >= 0
    outcome = group_normalize(R, used, lw, options.scale_by_std, options.eps)  # [P, W]
    flat = lambda x: x.reshape((P, W * D))  # noqa: E731  (one group per prompt: all its slots' gains)
    weight3 = jnp.broadcast_to(lw[:, :, None], gain.shape)
    intrinsic = group_normalize(flat(gain), flat(has), flat(weight3), options.scale_by_std,
                                options.eps).reshape((P, W, D))
    wr = jnp.where(used, lw, 0.0)
    mean_r = jnp.sum(wr * R, -1, keepdims=True) / jnp.maximum(jnp.sum(wr, -1, keepdims=True), 1e-30)
    std_r = jnp.sqrt(jnp.sum(wr * (R - mean_r) ** 2, -1) / jnp.maximum(jnp.sum(wr, -1), 1e-30))  # [P]
    gate = jax.nn.sigmoid(-std_r / options.gate_temperature)
    tok_w = forest.loss_mask * lw[:, :, None]
    std_o = _weighted_std(_tokens(forest, jnp.broadcast_to(outcome[:, :, None], gain.shape)), tok_w) + options.eps
    std_i = _weighted_std(_tokens(forest, intrinsic), tok_w) + options.eps
    ratio = jnp.minimum(1.0, jnp.maximum(std_o, options.baseline_std) / std_i)
    adv = jnp.where(valid, outcome[:, :, None] + options.intrinsic_weight * gate[:, None, None] * ratio * intrinsic,
                    0.0)
    return adv, {"outcome": outcome, "intrinsic": intrinsic, "gate": gate, "ratio": ratio}


@register_estimator("infopo", InfoPOOptions, inputs=("feedback_gain_PxN",))
def infopo(forest: Forest, rewards_PxW: jax.Array, options: InfoPOOptions = InfoPOOptions(), *,
           feedback_gain_PxN: jax.Array) -> Advantages:
    """InfoPO (Kong et al. 2026, "InfoPO: Information-Driven Policy Optimization for User-Centric Agents", arXiv
    2603.00656): a turn is credited by how much the feedback it obtained (the user's reply, a tool's output)
    changes the policy's next action against a masked-feedback counterfactual, fused with the outcome advantage
    by a variance gate.

    Counterfactual information gain (host + learner forward, :func:`treejax.rl.info_gain.feedback_gains`): for a
    turn node ``n`` whose parent turn ended with an observation, ``g(n) = mean_j [log pi(a_j | with the parent's
    observation) - log pi(a_j | the observation replaced by "No information found.")]`` over ``n``'s policy
    tokens, and leaf ``w``'s turn ``t`` gets ``I_{w,t} = g(node_{t+1})`` (:func:`turn_feedback_gains`: the turn
    that *obtained* the feedback is credited). Then, per prompt ``p`` over its leaf slots (weights
    ``Forest.leaf_weight``; statistics as the module docstring)::

        O_w      = (R_w - mean_p R) / (std_p R + eps)                                 outcome (GRPO)
        Ĩ_{w,t}  = (I_{w,t} - mean_p I) / (std_p I + eps)      over p's turns with a gain (0 on the others)
        gate_p   = sigmoid(-std_p(R) / tau)                      (tau = gate_temperature; population std of R)
        m        = min(1, max(s_O, baseline_std) / s_I)          s_X = token-level std of X over the batch + eps
        A_{w,t}  = O_w + beta * gate_p * m * Ĩ_{w,t}             (beta = intrinsic_weight)

    broadcast to each turn's policy tokens (0 on observations); ``segments`` holds ``A`` per (slot, turn). The gate
    opens (-> 1/2) where a prompt's outcomes are tied (no outcome signal) and closes where they vary; the
    magnitude bound only ever shrinks the information term.

    What this rests on: the abstract (counterfactual masking, variance-gated fusion) and the released code
    (``verl/trainer/ppo/intrinsic_reward.py`` and ``core_algos.py::compute_info_grpo_advantage`` of kfq20/InfoPO,
    read, not copied): the placeholder text, the same-length masking, the sampled-token KL averaged over the next
    action, the attribution to the turn that obtained the feedback, beta = 0.1, tau = 0.05, the baseline std 1.0
    and the eps are the code's. The paper's own equations were not read. Chosen here, where the code differs or
    is not expressible on a turn forest: the gains are normalised per turn (the code spreads a turn's gain evenly
    over its tokens and normalises those per-token values, so a long turn's gain is diluted); an exact gain of 0
    is a member of its group (the code drops zero token values); the gate's std is the population std of the
    prompt's rewards (the code: the unbiased std, which differs by sqrt(W / (W - 1)) and saturates the gate in
    the same cases); the outcome term is the plain GRPO advantage on every turn (the code's "Equalized" turn
    credits reduce to it); no epoch decay of beta (0 in the released scripts). ``feedback_gain_PxN`` [P, N]:
    :func:`treejax.rl.info_gain.feedback_gains` (NaN where a node has none).
    """
    adv, _ = infopo_turns(forest, rewards_PxW, options, feedback_gain_PxN)
    return Advantages(tokens=_tokens(forest, adv), loss_mask=forest.loss_mask, segments=adv)


__all__ = ["A2TGPOOptions", "IGPOOptions", "InfoPOOptions", "infopo", "infopo_turns", "turn_feedback_gains", "a2tgpo", "a2tgpo_clip_scale", "a2tgpo_turns", "discounted_to_go",
           "group_normalize", "igpo", "turn_info_gains", "turn_layout"]
