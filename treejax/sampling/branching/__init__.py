"""Branching and pruning rules of the tree rollout: one file per rule family, registered by name.

Interface and registry: :mod:`treejax.sampling.branching.base`. A new rule is one file with a
``@register("name")`` frozen dataclass plus its import line below.
"""

from treejax.sampling.branching.base import (BranchingRule, PathStats, capped_allocation, get_rule, register,
                                             rule_classes, windowed_mean)
from treejax.sampling.branching.treepo import FixedAverage, LogProbWeighted

__all__ = ["BranchingRule", "FixedAverage", "LogProbWeighted", "PathStats", "capped_allocation", "get_rule",
           "register", "rule_classes", "windowed_mean"]
