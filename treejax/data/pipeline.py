"""grain input pipelines for prompts: sharded, seeded shuffle, repeat, batching, checkpointable iterator state.

``make_prompt_dataset(source, batch_size, seed, shard_index, shard_count, num_epochs)`` is the lazy
``grain.MapDataset``

    MapDataset.source(source)[shard_index::shard_count]     # per-process shard (disjoint, covering)
      .map(map_fn)                                          # default: decode_record (bytes -> str)
      .seed(seed).shuffle()                                 # global permutation of the shard, per seed
      .repeat(num_epochs)                                   # None = forever; each epoch reshuffled
      .batch(batch_size, drop_remainder, batch_fn=collate)  # {"uid": [..], "question": [..], ...}

and ``make_prompt_pipeline(...)`` returns its ``grain.DatasetIterator``, whose ``get_state()`` is a small
JSON-serialisable dict (the next element index) to store in checkpoints; ``set_state(state)`` on a fresh iterator
of the same pipeline resumes exactly, mid-epoch included.

Sharding before shuffling makes shard ``k`` the records ``{i : i mod shard_count = k}``: the shards are disjoint
and cover the source for any seed. With a shard size not divisible by ``batch_size`` and a finite ``num_epochs``,
``drop_remainder=True`` drops the last partial batch (batches span epoch boundaries, so at most ``batch_size - 1``
records in total). Shards of unequal size (``len(source) % shard_count != 0``) give processes different epoch
lengths; with ``num_epochs=None`` every process still gets an endless stream of full batches, and
``even_shards=True`` truncates the source to a multiple of ``shard_count`` (dropping at most
``shard_count - 1`` records, reported with a warning) when equal lengths matter.

``source`` is any random-access sequence (``__len__``/``__getitem__``): ``tfds.data_source(...)``, an
``ArrayRecordDataSource``, or ``task.records(split)``. With ``num_workers > 0`` elements are prepared in grain
worker processes; since grain reads absl flags when jax is importable, ``ensure_absl_flags_parsed`` is called
first (otherwise grain raises ``UnparsedFlagAccessError`` outside ``absl.app.run``).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Sequence

import grain

from treejax.data.task_base import decode_record

__all__ = ["collate", "ensure_absl_flags_parsed", "make_prompt_dataset", "make_prompt_pipeline"]


def collate(records: Sequence[dict]) -> dict[str, list]:
    """Batch of dict records -> dict of lists (strings don't stack into arrays usefully)."""
    keys = list(records[0])
    for r in records:
        if list(r) != keys:
            raise ValueError(f"records in a batch have different fields: {keys} vs {list(r)}")
    return {k: [r[k] for r in records] for k in keys}


def ensure_absl_flags_parsed() -> None:
    """Mark absl flags parsed (with defaults) if no ``absl.app.run`` did it; grain's worker processes read them."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def make_prompt_dataset(
    source: Sequence,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    num_epochs: Optional[int] = None,
    *,
    shuffle: bool = True,
    drop_remainder: bool = True,
    even_shards: bool = False,
    map_fn: Optional[Callable[[Any], Any]] = decode_record,
) -> grain.MapDataset:
    """The lazy, batched ``grain.MapDataset`` (see module docstring)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if shard_count < 1 or not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got shard_index={shard_index}, "
                         f"shard_count={shard_count}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be None (forever) or >= 1, got {num_epochs}")
    n = len(source)
    ds = grain.MapDataset.source(source)
    if even_shards and n % shard_count:
        keep = n - n % shard_count
        warnings.warn(f"even_shards: dropping the last {n - keep} of {n} records so that {shard_count} shards "
                      "are equal")
        ds = ds[:keep]
    ds = ds[shard_index::shard_count]
    if len(ds) == 0:
        raise ValueError(f"shard {shard_index} of {shard_count} is empty (source has {n} records)")
    if num_epochs is not None and drop_remainder and len(ds) * num_epochs < batch_size:
        raise ValueError(f"shard has {len(ds)} records x {num_epochs} epochs, fewer than one batch of {batch_size}")
    if map_fn is not None:
        ds = ds.map(map_fn)
    if shuffle:
        ds = ds.seed(seed).shuffle()
    ds = ds.repeat(num_epochs)
    return ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=collate)


def make_prompt_pipeline(
    source: Sequence,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    num_epochs: Optional[int] = None,
    *,
    shuffle: bool = True,
    drop_remainder: bool = True,
    even_shards: bool = False,
    map_fn: Optional[Callable[[Any], Any]] = decode_record,
    num_threads: int = 0,
    num_workers: int = 0,
) -> grain.DatasetIterator:
    """Iterator over prompt batches with ``get_state``/``set_state`` for checkpoints.

    ``num_threads > 0`` prefetches with grain read threads; ``num_workers > 0`` uses grain worker processes
    (``map_fn`` must then be picklable). Order and state are the same in every mode.
    """
    ds = make_prompt_dataset(
        source, batch_size, seed, shard_index, shard_count, num_epochs,
        shuffle=shuffle, drop_remainder=drop_remainder, even_shards=even_shards, map_fn=map_fn,
    )
    read_options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=max(2 * num_threads, 1)) \
        if num_threads > 0 else grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    it_ds = ds.to_iter_dataset(read_options)
    if num_workers > 0:
        ensure_absl_flags_parsed()
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
    return iter(it_ds)
