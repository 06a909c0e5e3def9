"""grain prompt pipeline: seeded order, resume mid-epoch, disjoint covering shards, serialisable state."""

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treejax.data.pipeline import make_prompt_dataset, make_prompt_pipeline


def _records(n):
    return [{"uid": f"{i:04d}", "question": f"q{i}", "answer": str(i), "metadata": "{}"} for i in range(n)]


def _uids(it, num_batches=None):
    """uids of the next ``num_batches`` batches (all if None), consuming exactly that many."""
    return [tuple(b["uid"]) for b in itertools.islice(it, num_batches)]


def test_batches_have_dict_of_lists_and_one_epoch_is_a_permutation():
    src = _records(12)
    batches = list(make_prompt_pipeline(src, 4, seed=0, num_epochs=1))
    assert len(batches) == 3 and set(batches[0]) == {"uid", "question", "answer", "metadata"}
    assert all(len(b["uid"]) == 4 for b in batches)
    uids = [u for b in batches for u in b["uid"]]
    assert sorted(uids) == [r["uid"] for r in src] and uids != [r["uid"] for r in src]


def test_order_is_deterministic_per_seed_and_epochs_are_reshuffled():
    src = _records(20)
    a = _uids(make_prompt_pipeline(src, 5, seed=7, num_epochs=2))
    assert a == _uids(make_prompt_pipeline(src, 5, seed=7, num_epochs=2))
    assert a != _uids(make_prompt_pipeline(src, 5, seed=8, num_epochs=2))
    assert a[:4] != a[4:]  # epoch 2 has another order
    assert sorted(u for b in a[4:] for u in b) == [r["uid"] for r in src]


@pytest.mark.parametrize("num_threads", [0, 2])
def test_resume_mid_epoch_gives_same_continuation(num_threads):
    src = _records(23)
    full = _uids(make_prompt_pipeline(src, 4, seed=3, num_threads=num_threads), 15)  # ~2.6 epochs
    it = make_prompt_pipeline(src, 4, seed=3, num_threads=num_threads)
    _uids(it, 3)  # mid first epoch
    state = json.loads(json.dumps(it.get_state()))  # goes through a checkpoint as JSON
    resumed = make_prompt_pipeline(src, 4, seed=3, num_threads=num_threads)
    resumed.set_state(state)
    assert _uids(resumed, 12) == full[3:]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), shard_count=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_shards_are_disjoint_and_cover(n, shard_count, seed):
    src = _records(n)
    seen = []
    for k in range(shard_count):
        if k >= n:  # more processes than records: an empty shard is an error
            with pytest.raises(ValueError, match="empty"):
                make_prompt_dataset(src, 1, seed, k, shard_count, num_epochs=1)
            continue
        ds = make_prompt_dataset(src, 1, seed, k, shard_count, num_epochs=1, drop_remainder=False)
        seen.append([ds[i]["uid"][0] for i in range(len(ds))])
    flat = [u for shard in seen for u in shard]
    assert len(flat) == len(set(flat)) == n


def test_even_shards_truncate_with_warning_and_infinite_stream_is_full():
    src = _records(10)
    with pytest.warns(UserWarning, match="dropping the last 1"):
        sizes = [len(make_prompt_dataset(src, 1, 0, k, 3, num_epochs=1, even_shards=True)) for k in range(3)]
    assert sizes == [3, 3, 3]
    it = make_prompt_pipeline(src, 4, seed=0, shard_index=1, shard_count=3)
    assert all(len(b["uid"]) == 4 for b in (next(it) for _ in range(5)))


def test_bad_arguments():
    src = _records(5)
    with pytest.raises(ValueError, match="shard_index"):
        make_prompt_dataset(src, 2, 0, 3, 3)
    with pytest.raises(ValueError, match="batch_size"):
        make_prompt_dataset(src, 0, 0)
    with pytest.raises(ValueError, match="fewer than one batch"):
        make_prompt_dataset(src, 8, 0, num_epochs=1)


def test_worker_processes_give_the_same_order():
    src = _records(14)
    single = _uids(make_prompt_pipeline(src, 3, seed=1, num_epochs=2))
    assert _uids(make_prompt_pipeline(src, 3, seed=1, num_epochs=2, num_workers=2)) == single
