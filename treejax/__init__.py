"""treejax: JAX-native tree-structured RL post-training of language models (TreePO and family).

The public API, stage by stage (the same functions the trainer uses; notebooks import from here):
models -> sampling (tree rollouts) -> rewards/advantages -> losses/update -> checkpoint/metrics.
"""

__version__ = "0.1.0"

# The names below are imported on first use (PEP 562), so `import treejax` and the CLI's config check start in
# about a second instead of importing jax, flax, orbax and matplotlib up front; `from treejax import X` works as
# before.
import importlib as _importlib


_EXPORTS = {
    "Forest": "treejax.forest",
    "NodeStatus": "treejax.forest",
    "forest_from_paths": "treejax.forest",
    "forest_from_spans": "treejax.forest",
    "subgroup_masks": "treejax.forest",
    "ModelConfig": "treejax.models.config",
    "get_config": "treejax.models.presets",
    "preset_names": "treejax.models.presets",
    "tiny_config": "treejax.models.presets",
    "load_model": "treejax.models.registry",
    "export_hf": "treejax.models.export",
    "TextTokenizer": "treejax.models.tokenizer",
    "BoxedAnswer": "treejax.sampling",
    "Greedy": "treejax.sampling",
    "MinP": "treejax.sampling",
    "Temperature": "treejax.sampling",
    "TopK": "treejax.sampling",
    "TopP": "treejax.sampling",
    "TreeConfig": "treejax.sampling",
    "generate": "treejax.sampling",
    "make_independent_rollout": "treejax.sampling",
    "make_tree_rollout": "treejax.sampling",
    "TurnLimits": "treejax.sampling.turns",
    "TurnTreeConfig": "treejax.sampling.turns",
    "run_episodes": "treejax.sampling.turns",
    "run_turn_trees": "treejax.sampling.turns",
    "turn_forest": "treejax.sampling.turns",
    "CodeToolEnv": "treejax.envs.code_tool",
    "GuessNumberEnv": "treejax.envs.guess",
    "GymnasiumText": "treejax.envs.base",
    "StepResult": "treejax.envs.base",
    "ECHO": "treejax.sampling.branching",
    "LATR": "treejax.sampling.branching",
    "BranchingRule": "treejax.sampling.branching",
    "EntropyGuided": "treejax.sampling.branching",
    "FixedAverage": "treejax.sampling.branching",
    "LogProbWeighted": "treejax.sampling.branching",
    "PathStats": "treejax.sampling.branching",
    "allocate_budget": "treejax.sampling.kernels",
    "divergence_weights": "treejax.sampling.kernels",
    "ngram_repetition": "treejax.sampling.kernels",
    "Advantages": "treejax.rl.advantages",
    "estimator_spec": "treejax.rl.advantages",
    "get_estimator": "treejax.rl.advantages",
    "list_estimators": "treejax.rl.advantages",
    "register_estimator": "treejax.rl.advantages",
    "dynamic_sampling_keep": "treejax.rl.rewards",
    "overlong_penalty": "treejax.rl.rewards",
    "verifier_reward": "treejax.rl.rewards",
    "LossConfig": "treejax.rl.losses",
    "policy_loss": "treejax.rl.losses",
    "OptimizerConfig": "treejax.rl.optimizer",
    "make_optimizer": "treejax.rl.optimizer",
    "TrainState": "treejax.rl.train_state",
    "make_update_fn": "treejax.rl.update",
    "forest_to_batch": "treejax.rl.batch",
    "Batch": "treejax.rl.batch",
    "expanded_batch": "treejax.rl.batch",
    "Expanded": "treejax.rl.layouts",
    "Packed": "treejax.rl.layouts",
    "Rollouts": "treejax.rl.rollouts",
    "RolloutSource": "treejax.rl.rollouts",
    "learn": "treejax.rl.step",
    "make_learner": "treejax.rl.step",
    "rl_step": "treejax.rl.step",
    "RunConfig": "treejax.rl.config",
    "run": "treejax.rl.loop",
    "MeshConfig": "treejax.parallel.mesh",
    "make_mesh": "treejax.parallel.mesh",
    "Checkpointer": "treejax.checkpoint",
    "draw_tree": "treejax.viz",
    "draw_turn_tree": "treejax.viz",
    "turn_tree_text": "treejax.viz",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'treejax' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
