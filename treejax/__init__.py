"""treejax: JAX-native tree-structured RL post-training of language models (TreePO and family)."""

__version__ = "0.1.0"

from treejax.forest import Forest, NodeStatus, forest_from_paths, subgroup_masks  # noqa: F401
