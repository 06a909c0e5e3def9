"""Sampling: KV cache rows, ragged decode attention, strategies, the linear sampler and TreePO tree rollouts."""

from treejax.sampling.branching import (ECHO, LATR, BranchingRule, EntropyGuided, FixedAverage, LogProbWeighted,
                                        PathStats)
from treejax.sampling.attention import dense_decode_attention, ragged_decode_attention
from treejax.sampling.cache import fork_rows, init_kv_cache
from treejax.sampling.decode import FinishReason, GenerateOutput, ModelFns, generate, make_model_fns
from treejax.sampling.predicates import BoxedAnswer
from treejax.sampling.strategies import Greedy, MinP, Strategy, Temperature, TopK, TopP, get_strategy
from treejax.sampling.tree import TreeConfig, independent_config, make_independent_rollout, make_tree_rollout

__all__ = [
    "BranchingRule", "ECHO", "EntropyGuided", "FixedAverage", "LATR", "LogProbWeighted", "PathStats",
    "BoxedAnswer", "FinishReason", "GenerateOutput", "Greedy", "MinP", "ModelFns", "Strategy",
    "Temperature", "TopK", "TopP", "TreeConfig", "dense_decode_attention", "fork_rows", "generate", "get_strategy",
    "independent_config", "init_kv_cache", "make_independent_rollout", "make_model_fns", "make_tree_rollout",
    "ragged_decode_attention",
]
