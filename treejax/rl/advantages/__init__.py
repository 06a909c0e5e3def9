"""Advantage estimators over the rollout forest, selected by name (``get_estimator("treepo")``).

Interface: ``fn(forest, rewards_PxW, options, **inputs) -> Advantages`` (see :mod:`.registry`).
Flat estimators: grpo (Dr.GRPO option), rloo, reinforce_pp_baseline, mc_grpo, remax, decs (token-level).
Tree estimators: treepo, treepo_segment, spo_tree. Monte-Carlo cut values: spo_chain. Hinted contexts: nudge.
Multi-turn (turn forests): gigpo, gigpo_similar, hgpo, salt (state-grouped steps); tree_grpo, treeps, portool, portool_tool;
matchtir (matched tool-call turn rewards), infopo (counterfactual feedback gains, variance-gated), a3 (episode
feedback, AST action sub-chain residuals, tree-level margins), sage (task chains: per-problem GRPO on a
skill-integrated reward), ui_s1 (semi-online expert trajectories: discounted step returns, step- plus
episode-level group advantages), rapo (reward-aware scaled outcome advantage plus a step-level tool-call term),
mosaic (pairwise trajectory preferences of a lexicographic safety judge: win rates or Bradley-Terry strengths).
Tree with agent labels: mars2 (MARS²: tree-consistent shaped node values, path-level group advantage).
Judged steps (a scorer model's scores as inputs): slate (step rewards z-scored among siblings), mapo (per-turn judge
rewards, Monte-Carlo returns, turn- and batch-level normalisation mixed).
"""

from treejax.rl.advantages.agentic import GiGPOOptions, HGPOOptions, SALTOptions, gigpo, gigpo_similar, hgpo, salt
from treejax.rl.advantages.agentic_tree import (
    PORToolOptions,
    PORToolToolOptions,
    TreeGRPOOptions,
    TreePSOptions,
    portool,
    portool_tool,
    tree_grpo,
    treeps,
)
from treejax.rl.advantages.common import masked_whiten
from treejax.rl.advantages.decs import DECSOptions, decs
from treejax.rl.advantages import info_gain  # noqa: F401  (registers "igpo", "a2tgpo" and "infopo")
from treejax.rl.advantages.info_gain import InfoPOOptions, infopo
from treejax.rl.advantages.matchtir import MatchTIROptions, matchtir
from treejax.rl.advantages.a3 import A3Options, a3
from treejax.rl.advantages.mapo import MAPOOptions, mapo
from treejax.rl.advantages.sage import SAGEOptions, sage
from treejax.rl.advantages.ui_s1 import UIS1Options, ui_s1
from treejax.rl.advantages.rapo import RAPOOptions, rapo
from treejax.rl.advantages.mosaic import MOSAICOptions, mosaic  # noqa: F401  (MOSAIC's pairwise preferences)
from treejax.rl.advantages.slate import SLATEOptions, slate
from treejax.rl.advantages.mars2 import MARS2Options, mars2  # noqa: F401  (MARS²'s path-level group advantage)
from treejax.rl.advantages.flat import (
    GRPOOptions,
    MCGRPOOptions,
    ReinforcePPBaselineOptions,
    ReMaxOptions,
    RLOOOptions,
    grpo,
    mc_grpo,
    reinforce_pp_baseline,
    remax,
    rloo,
)
from treejax.rl.advantages.registry import (
    ESTIMATORS,
    Advantages,
    EstimatorSpec,
    estimator_spec,
    get_estimator,
    list_estimators,
    register_estimator,
)
from treejax.rl.advantages.spo import SPOTreeOptions, spo_probability_mask, spo_tree
from treejax.rl.advantages.nudge import NudgeOptions, nudge
from treejax.rl.advantages.spo_chain import SPOChainOptions, spo_chain
from treejax.rl.advantages.tree import TreePOOptions, TreePOSegmentOptions, treepo, treepo_segment

__all__ = [
    "ESTIMATORS", "Advantages", "EstimatorSpec", "estimator_spec", "get_estimator", "list_estimators",
    "register_estimator",
    "masked_whiten", "spo_probability_mask",
    "grpo", "rloo", "reinforce_pp_baseline", "mc_grpo", "remax", "decs", "treepo", "treepo_segment", "spo_tree",
    "spo_chain", "SPOChainOptions", "nudge", "NudgeOptions",
    "GRPOOptions", "DECSOptions", "RLOOOptions", "ReinforcePPBaselineOptions", "MCGRPOOptions", "ReMaxOptions",
    "TreePOOptions", "TreePOSegmentOptions", "SPOTreeOptions",
    "gigpo", "gigpo_similar", "hgpo", "salt", "tree_grpo", "treeps", "portool", "portool_tool",
    "GiGPOOptions", "HGPOOptions", "SALTOptions", "TreeGRPOOptions", "TreePSOptions", "PORToolOptions",
    "PORToolToolOptions", "matchtir", "MatchTIROptions", "a3", "A3Options", "slate", "SLATEOptions", "mapo",
    "MAPOOptions", "sage", "SAGEOptions", "infopo", "InfoPOOptions", "ui_s1", "UIS1Options",
    "rapo", "RAPOOptions",
]
