"""Every rollout stage, one import line each (importing a module registers its stages: ``Stage.__init_subclass__``).
A new stage is its module and one line here."""

from treejax.rl.sources.base import TaskSource  # noqa: F401  (the default planner)
from treejax.rl.allocation.source import AllocationConfig  # noqa: F401
from treejax.rl.selection import DOTSConfig  # noqa: F401
from treejax.rl.prompt_gdro import PromptGDROConfig  # noqa: F401
from treejax.rl.partial import PartialConfig  # noqa: F401
from treejax.rl.exemplars import ExemplarConfig  # noqa: F401
from treejax.rl.nudge import NudgeConfig  # noqa: F401
from treejax.rl.multiturn import MultiTurnConfig  # noqa: F401
from treejax.rl.shape_search import ShapeSearchConfig  # noqa: F401
from treejax.rl.replay import ReplayConfig  # noqa: F401
from treejax.rl.spear import SpearConfig  # noqa: F401
from treejax.rl.judges.fapo import FAPOConfig  # noqa: F401
from treejax.rl.judges.ssl import SSLConfig  # noqa: F401
from treejax.rl.judges.slate import SLATEConfig  # noqa: F401
from treejax.rl.judges.mapo import MAPOConfig  # noqa: F401
from treejax.rl.dart import DARTConfig  # noqa: F401
from treejax.rl.sapo import SAPOConfig  # noqa: F401
from treejax.rl.rapo import RAPOConfig  # noqa: F401
from treejax.rl.deeptravel import FailureReplayConfig  # noqa: F401
from treejax.rl.judges.scope import SCOPEConfig  # noqa: F401
from treejax.rl.judges.r3l import R3LConfig  # noqa: F401
from treejax.rl.judges.prm_steps import PRMStepsConfig  # noqa: F401
from treejax.rl.judges.search_r2 import SearchR2Config  # noqa: F401
from treejax.rl.cosearch import CoSearchConfig  # noqa: F401
