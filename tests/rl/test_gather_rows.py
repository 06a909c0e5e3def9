"""``rollouts.gather_rows``: dynamic sampling's row assembly (kept prompts of several sampler calls, then masked
filler rows) in one jitted gather whose program does not depend on how the rows split over the calls."""

import jax
import jax.numpy as jnp
import numpy as np

from treejax.forest import Forest
from treejax.rl import rollouts
from treejax.rl.rollouts import RowSource, gather_rows


def _forest(seed: int, P: int = 4, W: int = 2, T: int = 4, N: int = 5) -> Forest:
    """Random arrays in a forest's shapes (the gather never reads them as a tree)."""
    rng = np.random.RandomState(seed)
    i32 = lambda *shape: jnp.asarray(rng.randint(0, 9, shape), jnp.int32)  # noqa: E731
    f32 = lambda *shape: jnp.asarray(rng.rand(*shape), jnp.float32)  # noqa: E731
    return Forest(node_parent=i32(P, N), node_depth=i32(P, N), node_status=i32(P, N), leaf_path=i32(P, W, 3),
                  leaf_status=i32(P, W), leaf_length=i32(P, W), tokens=i32(P, W, T), logprobs=f32(P, W, T),
                  segment_index=i32(P, W, T), loss_mask=f32(P, W, T), leaf_weight=f32(P, W), segment_length=2)


def _reference(blocks):
    parts = []
    for b in blocks:
        f = jax.tree.map(lambda x: x[jnp.asarray(b.idx)], b.forest)
        if not b.train:
            f = f.replace(loss_mask=jnp.zeros_like(f.loss_mask))
        parts.append(f)
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def test_gather_rows_equals_indexing_and_compiles_once_per_source_shapes():
    a, b = _forest(0), _forest(1)
    splits = [([0, 2], [1, 3], [0], [1]), ([3], [0, 1, 2], [0], [0]), ([0, 1, 2], [], [0, 1], [2])]
    rollouts._gather_rows.clear_cache()
    for ka, kb, fill_a, fill_b in splits:
        blocks = [RowSource(a, np.array(ka, np.int64)), RowSource(b, np.array(kb, np.int64)),
                  RowSource(a, np.array(fill_a, np.int64), train=False),
                  RowSource(b, np.array(fill_b, np.int64), train=False)]
        blocks = [bl for bl in blocks if len(bl.idx)]
        got, want = gather_rows(blocks), _reference(blocks)
        assert got.num_prompts == 6
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert float(got.loss_mask[len(ka) + len(kb):].sum()) == 0.0
    assert rollouts._gather_rows._cache_size() == 1  # every split of 6 rows over the same two calls: one program
    assert gather_rows([RowSource(a, np.arange(4))]) is a  # the whole of one call, in order: no gather at all
