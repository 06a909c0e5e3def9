"""Nodes as token spans change nothing for fixed segments: the tree sampler's forest on a fixed key is bit-identical
to the one this code base produced before spans existed (digest recorded at e202cb7, the commit before the span
change), and its derived spans are the fixed segments."""

from __future__ import annotations

import hashlib

import jax
import numpy as np

from treejax.models import presets, transformer
from treejax.sampling import decode, tree
from treejax.sampling.strategies import Temperature

CFG = presets.tiny_config("smollm2-135m", vocab_size=64)
#: sha256 of the forest's integer arrays and its log-probs rounded to 1e-4, recorded with e202cb7's sampler.
DIGEST = "6afd9bde7a258dccdcbb4203218c5bcf79a7ca4f82097dabc93b00827e3d26ee"


def _forest():
    fns = decode.make_model_fns(CFG, attention="dense", cache_dtype="float32")
    tc = tree.TreeConfig(num_leaves=6, max_depth=4, segment_length=4, branch_factor=2, init_divergence=2,
                         strategy=Temperature(1.0), stop_ids=(63,))
    params = transformer.init_params(CFG, jax.random.key(11))
    prompts = np.array([[1, 2, 3, 4], [5, 6, 0, 0]], np.int32)
    forest, _ = tree.make_tree_rollout(fns, tc)(params, prompts, np.array([4, 2], np.int32), jax.random.key(12))
    return jax.device_get(forest)


def digest(f) -> str:
    h = hashlib.sha256()
    for name in ("node_parent", "node_depth", "node_status", "leaf_path", "leaf_status", "leaf_length", "tokens",
                 "segment_index", "loss_mask"):
        h.update(np.ascontiguousarray(np.asarray(getattr(f, name))).tobytes())
    h.update(np.round(np.asarray(f.logprobs, np.float64), 4).tobytes())
    return h.hexdigest()


def test_fixed_segment_forest_is_unchanged():
    f = _forest()
    assert digest(f) == DIGEST
    assert f.node_span is None and f.policy_mask is None
    spans = np.asarray(f.spans())
    depth = np.asarray(f.node_depth)
    used = depth >= 1
    np.testing.assert_array_equal(spans[..., 0][used], (depth[used] - 1) * 4)
    assert np.all((spans[..., 1][used] >= 1) & (spans[..., 1][used] <= 4))
    seg = np.asarray(f.segment_index)
    t = np.arange(seg.shape[-1])
    np.testing.assert_array_equal(np.where(seg >= 0, t // 4, -1), seg)
