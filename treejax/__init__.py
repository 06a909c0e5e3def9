"""treejax: JAX-native tree-structured RL post-training of language models (TreePO and family).

The public API, stage by stage (the same functions the trainer uses; notebooks import from here):
models -> sampling (tree rollouts) -> rewards/advantages -> losses/update -> checkpoint/metrics.
"""

__version__ = "0.1.0"

from treejax.forest import Forest, NodeStatus, forest_from_paths, subgroup_masks  # noqa: F401
from treejax.models.config import ModelConfig  # noqa: F401
from treejax.models.presets import get_config, preset_names, tiny_config  # noqa: F401
from treejax.models.registry import load_model  # noqa: F401
from treejax.models.export import export_hf  # noqa: F401
from treejax.models.tokenizer import TextTokenizer  # noqa: F401
from treejax.sampling import (  # noqa: F401
    BoxedAnswer, Greedy, MinP, Temperature, TopK, TopP, TreeConfig, generate, make_independent_rollout,
    make_tree_rollout)
from treejax.sampling.branching import (  # noqa: F401
    ECHO, LATR, BranchingRule, EntropyGuided, FixedAverage, LogProbWeighted, PathStats)
from treejax.sampling.kernels import allocate_budget, divergence_weights, ngram_repetition  # noqa: F401
from treejax.rl.advantages import (  # noqa: F401
    Advantages, estimator_spec, get_estimator, list_estimators, register_estimator)
from treejax.rl.rewards import dynamic_sampling_keep, overlong_penalty, verifier_reward  # noqa: F401
from treejax.rl.losses import LossConfig, policy_loss  # noqa: F401
from treejax.rl.optimizer import OptimizerConfig, make_optimizer  # noqa: F401
from treejax.rl.train_state import TrainState  # noqa: F401
from treejax.rl.update import make_update_fn  # noqa: F401
from treejax.rl.batch import forest_to_batch  # noqa: F401
from treejax.rl.loop import RunConfig, run  # noqa: F401
from treejax.parallel.mesh import MeshConfig, make_mesh  # noqa: F401
from treejax.checkpoint import Checkpointer  # noqa: F401
from treejax.viz import draw_tree  # noqa: F401
