"""Stage functions of the tree rollout's segment step (``treejax.sampling.tree_stages``), each alone, against
Python references on random states (no model)."""

import jax.numpy as jnp
import numpy as np
import pytest

from treejax.forest import NodeStatus
from treejax.sampling import tree_stages as st
from treejax.sampling.tree_config import TreeConfig
from treejax.sampling.tree_state import Counters, Leaves, Nodes, Paths, Rows

P, W, D, T = 3, 5, 3, 6


def _random_rows(rng, alive):
    depth = rng.randint(1, D, P * W)
    path = np.full((P * W, D + 1), -1)
    for r in range(P * W):
        path[r, : depth[r] + 1] = rng.randint(1, 9, depth[r] + 1)
        path[r, 0], path[r, depth[r]] = 0, 10 + r % W  # every path ends in a node of its own
    paths = Paths.empty(P * W, T, D, 0, root=True).replace(
        path_RxD1=jnp.asarray(path, jnp.int32), tokens_RxT=jnp.asarray(rng.randint(0, 50, (P * W, T)), jnp.int32),
        length_R=jnp.asarray(rng.randint(1, T + 1, P * W), jnp.int32))
    z = jnp.zeros((P * W,), jnp.int32)
    return Rows(pending_R=z, position_R=z, epoch_R=z, alive_R=jnp.asarray(alive), depth_R=jnp.asarray(depth, jnp.int32),
                slots_R=jnp.ones((P * W,), jnp.int32), paths=paths)


@pytest.mark.parametrize("seed", range(5))
def test_open_nodes(seed):
    rng = np.random.RandomState(seed)
    alive = rng.rand(P * W) < 0.6
    rows = _random_rows(rng, alive)
    nodes = Nodes.root(P, 1 + W * D).replace(next_P=jnp.asarray(rng.randint(1, 5, P), jnp.int32))
    new_rows, new_nodes = st.open_nodes(rows, nodes)
    path, depth = np.asarray(rows.paths.path_RxD1), np.asarray(rows.depth_R)
    nxt = np.asarray(nodes.next_P).copy()
    for p in range(P):
        for w in range(W):
            r = p * W + w
            if not alive[r]:
                np.testing.assert_array_equal(np.asarray(new_rows.paths.path_RxD1[r]), path[r])
                continue
            node = nxt[p]
            nxt[p] += 1
            assert int(new_rows.paths.path_RxD1[r, depth[r] + 1]) == node
            assert int(new_nodes.parent_PxN[p, node]) == path[r, depth[r]]
            assert int(new_nodes.depth_PxN[p, node]) == depth[r] + 1
            assert int(new_nodes.status_PxN[p, node]) == NodeStatus.ALIVE
    np.testing.assert_array_equal(np.asarray(new_nodes.next_P), nxt)


@pytest.mark.parametrize("seed", range(10))
def test_assign_free_rows(seed):
    rng = np.random.RandomState(seed)
    live = rng.rand(P, W) < 0.5
    counts = np.where(live, 1, 0)
    for p in range(P):  # extra children never exceed the prompt's free rows
        free = W - live[p].sum()
        for w in np.flatnonzero(live[p]):
            add = rng.randint(0, free + 1)
            counts[p, w] += add
            free -= add
    src, forked = map(np.asarray, st.assign_free_rows(jnp.asarray(counts), jnp.asarray(live)))
    for p in range(P):
        want = [p * W + w for w in range(W) for _ in range(counts[p, w] - 1)]  # parents, in order
        free = [w for w in range(W) if not live[p, w]]
        for j, w in enumerate(free):
            r = p * W + w
            assert forked[r] == (j < len(want)) and src[r] == (want[j] if j < len(want) else r)
        for w in np.flatnonzero(live[p]):
            assert src[p * W + w] == p * W + w and not forked[p * W + w]


@pytest.mark.parametrize("seed", range(5))
def test_store_leaves_and_budget(seed):
    rng = np.random.RandomState(seed)
    alive = rng.rand(P * W) < 0.8
    rows = _random_rows(rng, alive)
    ended = alive & (rng.rand(P * W) < 0.5)
    status = np.where(ended, rng.choice([2, 3, 4, 5, 6], P * W), int(NodeStatus.ALIVE))
    had = rng.randint(0, 2, P)
    nodes = Nodes.root(P, 1 + W * D).replace(leaves_P=jnp.asarray(had, jnp.int32))
    leaves = Leaves(paths=Paths.empty(P * W, T, D, 0, root=False), status_R=jnp.zeros((P * W,), jnp.int32),
                    row_R=jnp.full((P * W,), -1, jnp.int32))
    out, nodes2, counters, now = st.store_leaves(leaves, nodes, Counters.zeros(), rows, jnp.asarray(ended),
                                                 jnp.asarray(status, jnp.int32))
    for p in range(P):
        slot = had[p]
        for w in range(W):
            r = p * W + w
            if ended[r]:
                dst = p * W + slot
                slot += 1
                np.testing.assert_array_equal(np.asarray(out.paths.tokens_RxT[dst]),
                                              np.asarray(rows.paths.tokens_RxT[r]))
                assert int(out.status_R[dst]) == status[r] and int(out.row_R[dst]) == r
                end = int(rows.paths.path_RxD1[r, rows.depth_R[r]])
                assert int(nodes2.status_PxN[p, end]) == status[r]
        assert int(nodes2.leaves_P[p]) == slot and int(now[p]) == slot - had[p]
    assert int(counters.stops_K.sum()) == ended.sum()
    live = (alive & ~ended).reshape(P, W)
    tc = TreeConfig(num_leaves=W, max_depth=D, segment_length=2, branch_factor=2)
    total = np.asarray(st.branch_budget(jnp.asarray(live), now, nodes2.leaves_P, tc=tc))
    for p in range(P):
        A, f, F = live[p].sum(), int(now[p]), int(nodes2.leaves_P[p])
        assert total[p] == max(min(W - F, 2 * A + 2 * f), A)


@pytest.mark.parametrize("seed", range(5))
def test_store_leaves_with_slots(seed):
    """A slot tree's path that ends holding n slots fills n consecutive leaf slots (in row order), each a copy."""
    rng = np.random.RandomState(seed)
    alive = rng.rand(P * W) < 0.8
    rows = _random_rows(rng, alive)
    ended = alive & (rng.rand(P * W) < 0.5)
    had = rng.randint(0, 3, P)
    slots = np.zeros(P * W, np.int64)
    for p in range(P):  # slots of the ended paths fit in W - had
        left = W - had[p]
        for w in range(W):
            if ended[p * W + w]:
                slots[p * W + w] = n = min(left, rng.randint(1, 4))
                left -= n
    ended &= slots > 0
    rows = rows.replace(slots_R=jnp.asarray(np.maximum(slots, 1), jnp.int32))
    status = np.where(ended, rng.choice([2, 3, 4, 5], P * W), int(NodeStatus.ALIVE))
    nodes = Nodes.root(P, 1 + W * D).replace(leaves_P=jnp.asarray(had, jnp.int32))
    leaves = Leaves(paths=Paths.empty(P * W, T, D, 0, root=False), status_R=jnp.zeros((P * W,), jnp.int32),
                    row_R=jnp.full((P * W,), -1, jnp.int32))
    out, nodes2, counters, now = st.store_leaves(leaves, nodes, Counters.zeros(), rows, jnp.asarray(ended),
                                                 jnp.asarray(status, jnp.int32))
    for p in range(P):
        slot = had[p]
        for w in range(W):
            r = p * W + w
            for _ in range(slots[r] if ended[r] else 0):
                dst = p * W + slot
                slot += 1
                np.testing.assert_array_equal(np.asarray(out.paths.tokens_RxT[dst]),
                                              np.asarray(rows.paths.tokens_RxT[r]))
                np.testing.assert_array_equal(np.asarray(out.paths.path_RxD1[dst]), np.asarray(rows.paths.path_RxD1[r]))
                assert int(out.status_R[dst]) == status[r] and int(out.row_R[dst]) == r
        for w in range(slot, W):  # untouched slots stay empty
            assert int(out.paths.path_RxD1[p * W + w, 0]) == -1
        assert int(nodes2.leaves_P[p]) == slot and int(now[p]) == ended[p * W:(p + 1) * W].sum()
    assert int(counters.stops_K.sum()) == slots[ended].sum()


@pytest.mark.parametrize("seed", range(10))
def test_split_slots(seed):
    """Children of a path share its own slots: n // c each, the first n mod c children one more."""
    rng = np.random.RandomState(seed)
    live = rng.rand(P, W) < 0.5
    slots = np.zeros((P, W), np.int64)
    counts = np.zeros((P, W), np.int64)
    for p in range(P):
        left = W
        for w in np.flatnonzero(live[p]):
            slots[p, w] = n = max(1, min(left - (live[p, w + 1:].sum()), rng.randint(1, 6)))
            left -= n
            counts[p, w] = rng.randint(1, min(2, n) + 1) if n > 1 else 1
    # extra children fit in the free rows because sum(counts) <= sum(slots) <= W
    src, forked, child = st._children_rows(jnp.asarray(counts), jnp.asarray(live))
    holds = live.reshape(-1) | np.asarray(forked)
    new = np.asarray(st.split_slots(jnp.asarray(slots.reshape(-1), jnp.int32), jnp.asarray(counts.reshape(-1)),
                                    src, child, jnp.asarray(holds)))
    src, child = np.asarray(src), np.asarray(child)
    for p in range(P):
        for w in np.flatnonzero(live[p]):
            r = p * W + w
            kids = [q for q in range(p * W, (p + 1) * W) if holds[q] and src[q] == r]
            assert sorted(child[kids].tolist()) == list(range(counts[p, w]))
            n, c = slots[p, w], counts[p, w]
            assert sorted(new[kids].tolist(), reverse=True) == [n // c + (i < n % c) for i in range(c)]
        assert new[p * W:(p + 1) * W].sum() == slots[p].sum()
