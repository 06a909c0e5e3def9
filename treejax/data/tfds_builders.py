"""tensorflow-datasets builders (no TensorFlow needed) that write task records as array_record.

``build_task_dataset(task, data_dir)`` writes the task's ``train`` and ``eval`` records
(schema ``treejax.data.tasks.RECORD_FIELDS``: uid, question, answer, metadata — all UTF-8 text) with
``TaskRecordsBuilder``, a ``tfds.core.GeneratorBasedBuilder``, into
``<data_dir>/treejax_task_records/<config name>/1.0.0`` using ``file_format="array_record"``. Records are written
in the task's order (``disable_shuffling=True``), so array_record index ``i`` is the task's record ``i``.
Read back with ``tfds.data_source("treejax_task_records/<config name>", data_dir=..., split="train")`` or
``open_task_source`` — random-access sources for ``grain.MapDataset.source`` whose values are ``bytes``
(``treejax.data.tasks.decode_record`` turns them into ``str``).

Works with any task: local GSM8K/MATH files or seeded reasoning-gym generators. The config name defaults to a
filesystem-safe version of ``task.name``; pass a distinct ``config_name`` for different configs of one task.
As tfds 4.9 requires for a builder defined outside a registered dataset package, ``_info`` builds its
``DatasetInfo`` directly. ``tfds.load``/``as_dataset`` (TensorFlow) are not used.
"""

from __future__ import annotations

import re
from typing import Optional

from treejax.data.task_base import RECORD_FIELDS, Task

__all__ = ["build_task_dataset", "open_task_source"]

DATASET_NAME = "treejax_task_records"


def _tfds():
    import tensorflow_datasets as tfds

    return tfds


def _make_builder_class():
    tfds = _tfds()

    class TaskRecordsBuilder(tfds.core.GeneratorBasedBuilder):
        """Writes a ``Task``'s train/eval records (see module docstring)."""

        name = DATASET_NAME
        VERSION = tfds.core.Version("1.0.0")
        RELEASE_NOTES = {"1.0.0": "uid/question/answer/metadata text records."}

        # tfds locates a builder's source file (for url checksums) through `importlib_resources`, which this
        # environment lacks; the builder downloads nothing, so it has no checksums file.
        @tfds.core.utils.classproperty
        @classmethod
        def code_path(cls):
            return None

        def __init__(self, *, task: Optional[Task] = None, **kwargs):
            self._task = task
            super().__init__(**kwargs)

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                description="Verifiable task records written by treejax.",
                features=tfds.features.FeaturesDict({k: tfds.features.Text() for k in RECORD_FIELDS}),
                disable_shuffling=True,
            )

        def _split_generators(self, dl_manager):
            if self._task is None:
                raise ValueError("TaskRecordsBuilder needs task=... to generate data (reading needs none)")
            return {split: self._generate_examples(split) for split in ("train", "eval")}

        def _generate_examples(self, split):
            for i, rec in enumerate(self._task.records(split)):
                yield i, {k: rec[k] for k in RECORD_FIELDS}

    return TaskRecordsBuilder


_BUILDER_CLASS = None


def __getattr__(name):  # lazy: importing this module does not import tensorflow_datasets
    global _BUILDER_CLASS
    if name == "TaskRecordsBuilder":
        if _BUILDER_CLASS is None:
            _BUILDER_CLASS = _make_builder_class()
        return _BUILDER_CLASS
    raise AttributeError(name)


def _config_name(name: str) -> str:
    slug = re.sub(r"[^a-zA-Z0-9_.]+", "_", name).strip("_").lower()
    if not slug:
        raise ValueError(f"cannot derive a config name from {name!r}; pass config_name")
    return slug


def build_task_dataset(task: Task, data_dir: str, *, config_name: Optional[str] = None) -> str:
    """Write ``task``'s records as array_record under ``data_dir``; returns the dataset name
    ``"treejax_task_records/<config>"`` for ``tfds.data_source``. Re-running with existing files reuses them."""
    tfds = _tfds()
    builder_cls = __getattr__("TaskRecordsBuilder")
    cfg = tfds.core.BuilderConfig(name=_config_name(config_name or task.name), description=task.name)
    builder = builder_cls(task=task, data_dir=data_dir, config=cfg, file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(verify_ssl=False))
    return f"{DATASET_NAME}/{cfg.name}"


def open_task_source(dataset_name: str, data_dir: str, split: str):
    """Random-access source of a built dataset: ``tfds.data_source(dataset_name, data_dir=..., split=...)``."""
    tfds = _tfds()
    return tfds.data_source(dataset_name, data_dir=data_dir, split=split)
