"""ARRoL's quality head: a light probe on the policy's hidden states, trained online to predict a rollout's success.

Source: "Prune as You Generate" (ARRoL, arXiv 2603.24840, ACL 2026): a lightweight quality head, trained on the
fly with binary cross-entropy against final correctness, predicts the success probability of *partial* rollouts;
the sampler prunes so the survivors are correctness-balanced (target positive ratio ``rho = 0.5``), and the head
weights answers at test time. The code (``Hsu1023/ARRoL`` at fe9ad20) is not released and the paper's method
section could not be read, so the architecture and training below are choices, stated as such:

* the head is **linear** on the last layer's hidden state after the final norm (``Shaper.needs = ("hidden",)``,
  from the trainer's own forward: no second pass), ``p(h_t) = sigmoid(w . h_t + b)``, ``w, b`` in fp32, the
  policy's states detached (the head never moves the policy);
* every response token ``t`` of a leaf is one training prefix (the state after ``t + 1`` tokens) labelled with the
  leaf's final correctness ``y`` (verifier score ``>= 1``; pseudo-labels in test-time runs). The loss is the mean
  over leaves of the mean over the leaf's tokens of ``softplus(z) - y z`` (BCE with logits, ``z = w . h + b``),
  so long leaves do not outweigh short ones;
* ``updates`` full-batch Adam steps per RL step (``learning_rate = 1e-3``), from zero weights; its Adam state is
  its own (``optax``), and head and optimizer state live in ``TrainState.aux["arrol_head"]``, checkpointed with
  the run.

The head does not change the advantages. It offers the sampler a **probe** (``w``, ``b`` and ``ready`` once it
has trained): the branching rule :class:`treejax.sampling.branching.arrol.QualityPrune` reads the probe's
per-token predictions during decoding and prunes paths so the survivors are correctness-balanced, and the
held-out evaluation weights each sample's vote by it (``EvalConfig.vote_probe = "arrol_head"``, ``wmaj@k``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from treejax.rl.shaping.base import Shaped, Shaper, ShapingInputs, correct, masked_mean, register


def head_logits(head: dict, hidden: jax.Array) -> jax.Array:
    """``w . h + b`` over the last axis of ``hidden`` (fp32)."""
    return jnp.einsum("...e,e->...", hidden.astype(jnp.float32), head["w"]) + head["b"]


def bce_loss(head: dict, hidden_PxWxTxE: jax.Array, y_PxW: jax.Array, on_PxWxT: jax.Array) -> jax.Array:
    """Mean over leaves with any ``on`` token of the mean over their ``on`` tokens of ``softplus(z) - y z``."""
    z = head_logits(head, hidden_PxWxTxE)
    per_token = jax.nn.softplus(z) - y_PxW[..., None] * z
    per_leaf = masked_mean(per_token, on_PxWxT, axis=-1)
    return masked_mean(per_leaf, jnp.any(on_PxWxT, axis=-1))


@register("arrol_head")
@dataclasses.dataclass(frozen=True)
class QualityHead(Shaper):
    """ARRoL's online quality head (module docstring). Advantages pass through unchanged."""

    needs = ("hidden",)
    stateful = True
    learning_rate: float = 1e-3
    updates: int = 4

    def __post_init__(self):
        if self.learning_rate <= 0 or self.updates < 1:
            raise ValueError(f"QualityHead needs learning_rate > 0 and updates >= 1, got {self.learning_rate}, "
                             f"{self.updates}")

    def optimizer(self) -> optax.GradientTransformation:
        return optax.adam(self.learning_rate)

    def init_state(self, hidden_size: int) -> Any:
        head = {"w": jnp.zeros((hidden_size,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
        return {"head": head, "opt": self.optimizer().init(head), "steps": jnp.zeros((), jnp.int32)}

    def shape(self, x: ShapingInputs) -> Shaped:
        raise TypeError("QualityHead is stateful: apply it with shape_stateful (apply_shapers does)")

    def shape_stateful(self, x: ShapingInputs, state: Any) -> tuple[Shaped, Any]:
        hidden = jax.lax.stop_gradient(x.hidden).astype(jnp.float32)
        on = x.t < x.leaf_length[..., None]
        y = correct(x).astype(jnp.float32)
        opt = self.optimizer()
        loss_grad = jax.value_and_grad(bce_loss)

        def one(carry, _):
            head, opt_state = carry
            loss, g = loss_grad(head, hidden, y, on)
            upd, opt_state = opt.update(g, opt_state, head)
            return (optax.apply_updates(head, upd), opt_state), loss

        (head, opt_state), losses = jax.lax.scan(one, (state["head"], state["opt"]), None, length=self.updates)
        p_last = jax.nn.sigmoid(head_logits(head, _last_hidden(hidden, x.leaf_length)))
        leaf_on = jnp.any(on, axis=-1)
        ok = correct(x)
        metrics = {"bce": losses[0], "bce_after": bce_loss(head, hidden, y, on),
                   "acc_last": masked_mean(((p_last >= 0.5) == ok).astype(jnp.float32), leaf_on),
                   "p_correct": masked_mean(p_last, leaf_on & ok), "p_wrong": masked_mean(p_last, leaf_on & ~ok)}
        return (Shaped(x.advantages, x.eps_scale, metrics),
                {"head": head, "opt": opt_state, "steps": state["steps"] + 1})

    def probe(self, state: Any) -> Any:
        return {"w": state["head"]["w"], "b": state["head"]["b"], "ready": state["steps"] > 0}


def _last_hidden(hidden_PxWxTxE: jax.Array, length_PxW: jax.Array) -> jax.Array:
    """``[P, W, E]``: each leaf's hidden state at its last response token."""
    t = jnp.maximum(length_PxW - 1, 0)[..., None, None]
    return jnp.take_along_axis(hidden_PxWxTxE, t, axis=2)[:, :, 0]
