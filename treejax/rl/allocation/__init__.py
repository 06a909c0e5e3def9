"""Where the rollout budget goes: prompt-level allocators (one file each, registered by name) and the group forest
that lets a prompt's rollouts span several rows. Interface: :mod:`treejax.rl.allocation.base`.

  ``uniform``      :class:`Uniform`       every prompt W rollouts (treejax without allocation);
  ``dars``         :class:`DARS`          DARS-ET / DARS-HW: extra rollouts for hard prompts (a < 0.5);
  ``xrpo``         :class:`XRPOAllocator` XRPO: chunks to the prompts whose reward CI shrinks most, plus a bonus;
  ``rollout_gdro`` :class:`RolloutGDRO`   Rollout-GDRO: pass-rate bins, square-root rule under a mean budget;
  ``dart``         :class:`DARTAllocator` DART: rollouts and a length cap from the running success rate.
"""

from treejax.rl.allocation.base import (ALLOCATORS, allocation_metrics, Allocator, Budget, PromptStats, allocator_classes, example_text, get_allocator,
                                        plan_chunks, prompt_key, register)
from treejax.rl.allocation.dars import DARS, dars_extra
from treejax.rl.allocation.dart import DARTAllocator, dart_length_cap, dart_rollouts, length_cap_mask
from treejax.rl.allocation.gdro import RolloutGDRO, sqrt_rule
from treejax.rl.allocation.groups import group_forest, group_leaves, ungroup
from treejax.rl.allocation.uniform import Uniform
from treejax.rl.allocation.xrpo import XRPOAllocator, ci_half_width, xrpo_extra
from treejax.rl.allocation.source import AllocatedRollouts, AllocationConfig  # the planner stage (last: it reads base)

__all__ = ["ALLOCATORS", "AllocatedRollouts", "AllocationConfig", "allocation_metrics", "Allocator", "Budget", "DARS", "DARTAllocator", "dart_length_cap", "dart_rollouts", "length_cap_mask", "PromptStats", "RolloutGDRO", "Uniform", "XRPOAllocator",
           "allocator_classes", "ci_half_width", "example_text", "dars_extra", "get_allocator", "group_forest", "group_leaves",
           "plan_chunks", "prompt_key", "register", "sqrt_rule", "ungroup", "xrpo_extra"]
