"""What the SLATE and MAPO tests share: a tiny model (vocab 64) with a character tokenizer as both the policy and
the step judge, and the loop's learner (collect -> learn) on it."""

import jax
import numpy as np

from treejax.testing.tokenizers import CharTokenizer


class JudgeTokenizer(CharTokenizer):
    """:class:`CharTokenizer` with what a scorer reads of a tokenizer (no chat template, pad id 0)."""

    chat_template = None
    pad_id = 0

    def encode(self, text: str) -> list[int]:
        return super().encode(text.replace("\n", ""))  # the scorer ends a plain user turn with a newline


class FixedForestSource:
    """A rollout source that returns one fixed forest (rewards, prompts) every step: the collect side without a
    sampler compile, so a test runs the judge wrapper and the learner alone."""

    def __init__(self, forest, rewards_PxW, prompts_PxLp, lengths_P):
        self.forest, self.rewards = forest, np.asarray(rewards_PxW, np.float32)
        self.prompts, self.lengths = np.asarray(prompts_PxLp, np.int32), np.asarray(lengths_P, np.int32)
        self.pipeline = None

    def sample(self, params, key, step):
        import jax.numpy as jnp

        from treejax.rl.rollouts import Rollouts

        return Rollouts(self.forest, jnp.asarray(self.rewards), (self.rewards > 0).astype(np.float32), self.prompts,
                        self.lengths)


def tiny_policy_and_judge():
    """``(model_config, params, scorer)``: a tiny random model and the same weights as a step judge (verdict tokens
    ``Y`` / ``N``, the question alone as the PRM's user turn, ``?`` after each step)."""
    from treejax.models import presets, transformer
    from treejax.scorers import ScorerConfig
    from treejax.scorers.model import from_params

    cfg = presets.tiny_config("smollm2-135m", vocab_size=64)
    params = transformer.init_params(cfg, jax.random.key(0))
    sc = ScorerConfig(model="policy", yes_tokens=("Y",), no_tokens=("N",), step_template="{question}",
                      step_tag="?", batch_size=4, max_length=64)
    return cfg, params, from_params(sc, cfg, params, JudgeTokenizer())


def tiny_learner(cfg, params, estimator: str, options=None, shapers=()):
    """``(learner, state)`` of the RL step with ``estimator`` (and ``shapers``) on the expanded layout."""
    from treejax.precision import Precision
    from treejax.rl.config import StepConfig
    from treejax.rl.layouts import Expanded
    from treejax.rl.losses import LossConfig
    from treejax.rl.optimizer import OptimizerConfig, make_optimizer
    from treejax.rl.step import make_learner
    from treejax.rl.train_state import TrainState
    from treejax.rl.update import make_update_fn

    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=10))
    layout = Expanded(cfg, attention_impl="xla")
    update = jax.jit(make_update_fn(layout, LossConfig(), optimizer), donate_argnames=("state",))
    learner = make_learner(cfg, StepConfig(estimator=estimator, estimator_options=options, shapers=shapers),
                           Precision().resolve("cpu"), update, layout)
    return learner, TrainState.create(jax.tree_util.tree_map(np.array, params), optimizer)


def check_one_rl_step(source, cfg, params, estimator: str, input_name: str) -> None:
    """One loop step (collect -> judge -> learn) of ``source`` with ``estimator``: the judge's ``input_name``
    reaches the learner, and the update trains on it (nothing skipped, finite loss, a gradient, first PPO ratio 1:
    the rollout's log-probs are the learner's)."""
    from treejax.rl.step import rl_step

    learner, state = tiny_learner(cfg, params, estimator)
    state, ro, m, _ = rl_step(learner, state, source, jax.random.key(1), 0)
    m = jax.device_get(m)
    assert input_name in ro.estimator_inputs
    assert m["update/skipped"] == 0.0 and np.isfinite(m["update/loss"]) and m["update/grad_norm"] > 0
    assert abs(m["update/first_ratio_min"] - 1) < 1e-5 and abs(m["update/first_ratio_max"] - 1) < 1e-5
