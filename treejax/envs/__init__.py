"""Environments for tool-use and multi-turn rollouts (issue 26): the interface (:mod:`.base`: ``reset`` / ``step`` /
``clone``, a gymnasium adapter), a sandboxed Python runner (:mod:`.sandbox`), a code tool for math and reasoning-gym
tasks (:mod:`.code_tool`), a guessing game with feedback (:mod:`.guess`) and a retrieval world (:mod:`.retrieval`:
BM25 search over the generated multi-hop corpus of :mod:`.retrieval_corpus`, and a calculator) and a shell-like world
(:mod:`.shell`: a small shell language, :mod:`.shell_lang`, parsed to an AST and run over an in-memory file system),
task chains (:mod:`.task_chain`: related problems of any task in one episode, for SAGE) and a simulated user with a
persona and a hidden goal (:mod:`.simulated_user`, the goals of :mod:`.user_task`) and a travel-planning sandbox
(:mod:`.travel`: flights, trains and hotels generated from a seed, DeepTravel's hierarchical verifiers). Multi-turn
rollouts name an environment by ``MultiTurnConfig.environment``: the registry is :data:`ENVS` (:func:`register_env`), filled by the imports
below."""

from treejax.envs.base import ENVS, env_names, get_env, register_env
from treejax.envs.code_tool import CodeToolEnv
from treejax.envs.guess import GuessNumberEnv
from treejax.envs.retrieval import RetrievalEnv
from treejax.envs.shell import ShellEnv
from treejax.envs.simulated_user import SimulatedUserEnv
from treejax.envs.guarded_user import GuardedUserEnv  # noqa: F401  (MOSAIC's guarded user)
from treejax.envs.task_chain import TaskChainEnv
from treejax.envs.travel import TravelEnv

__all__ = ["ENVS", "CodeToolEnv", "GuessNumberEnv", "RetrievalEnv", "ShellEnv", "SimulatedUserEnv", "TaskChainEnv",
           "TravelEnv", "env_names", "get_env", "register_env"]
