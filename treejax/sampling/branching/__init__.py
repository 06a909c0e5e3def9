"""Branching and pruning rules of the tree rollout: one file per rule family, registered by name.

Interface and registry: :mod:`treejax.sampling.branching.base`. A new rule is one file with a
``@register("name")`` frozen dataclass plus its import line below (which registers it; gin then knows it by
its class name, e.g. ``TreeConfig.branching = @EntropyGuided()``).

  ``fixed_average``  :class:`FixedAverage`     TreePO's equal split (treejax's or the official remainder);
  ``logprob``        :class:`LogProbWeighted`  TreePO's log-prob weighted split (temperature schedule);
  ``entropy``        :class:`EntropyGuided`    EPTree idea: extra children to the most uncertain paths;
  ``latr``           :class:`LATR`             top-2 closeness branching, similarity pruning after a lookahead;
  ``echo``           :class:`ECHO`             entropy-confidence branching with a width rule, three prune rules;
  ``arrol``          :class:`QualityPrune`     ARRoL: correctness-balanced pruning by an online quality head;
  ``rose``           :class:`RoseBranching`    ROSE: branch where likely next tokens are uncertain and dissimilar;
  ``ets``            :class:`ETS`              ETS: PRM-scored REBASE split with a KV-cost / coverage program.
"""

from treejax.sampling.branching.base import (RULES, BranchingRule, PathStats, capped_allocation, get_rule, register,
                                             rule_classes, windowed_mean)
from treejax.sampling.branching.treepo import FixedAverage, LogProbWeighted
from treejax.sampling.branching.entropy import EntropyGuided
from treejax.sampling.branching.latr import LATR
from treejax.sampling.branching.echo import ECHO
from treejax.sampling.branching.arrol import QualityPrune
from treejax.sampling.branching.rose import RoseBranching
from treejax.sampling.branching.ets import ETS

__all__ = ["RULES", "BranchingRule", "ECHO", "ETS", "EntropyGuided", "FixedAverage", "LATR", "LogProbWeighted", "PathStats",
           "QualityPrune", "RoseBranching", "capped_allocation", "get_rule", "register", "rule_classes",
           "windowed_mean"]
