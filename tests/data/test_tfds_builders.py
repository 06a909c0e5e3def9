"""tfds builder round trip: jsonl / reasoning-gym -> array_record -> tfds.data_source -> grain (no TensorFlow)."""

import itertools
import json
import os

import pytest

from treejax.data.pipeline import make_prompt_pipeline
from treejax.data.tasks import decode_record, get_task
from treejax.data.tfds_builders import build_task_dataset, open_task_source

GSM8K = os.path.join(os.path.dirname(__file__), "fixtures", "gsm8k_small.jsonl")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Build once per module: a GSM8K file task (hash split) and a seeded reasoning-gym task."""
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    file_task = get_task("gsm8k_file", path=GSM8K, eval_fraction=0.3)
    rg_task = get_task("chain_sum_2x2", size=40, eval_size=8, seed=2)
    names = {
        "file": build_task_dataset(file_task, data_dir),
        "rg": build_task_dataset(rg_task, data_dir, config_name="chain_sum_2x2_seed2"),
    }
    return data_dir, {"file": file_task, "rg": rg_task}, names


@pytest.mark.parametrize("which", ["file", "rg"])
def test_array_record_round_trip_gives_same_records(built, which):
    import tensorflow_datasets as tfds

    data_dir, tasks, names = built
    for split in ("train", "eval"):
        src = tfds.data_source(names[which], data_dir=data_dir, split=split)
        assert len(src) == len(tasks[which].records(split)) > 0
        assert [decode_record(src[i]) for i in range(len(src))] == tasks[which].records(split)


def test_builder_names_and_files(built):
    data_dir, _, names = built
    assert names["rg"] == "treejax_task_records/chain_sum_2x2_seed2"
    assert names["file"].startswith("treejax_task_records/gsm8k_file")
    files = os.listdir(os.path.join(data_dir, *names["file"].split("/"), "1.0.0"))
    assert any(".array_record" in f for f in files)


def test_grain_over_array_record_equals_grain_over_task_records(built):
    data_dir, tasks, names = built
    src = open_task_source(names["rg"], data_dir, "train")
    from_disk = make_prompt_pipeline(src, 8, seed=11, num_epochs=2)
    in_memory = make_prompt_pipeline(tasks["rg"].records("train"), 8, seed=11, num_epochs=2)
    a, b = list(from_disk), list(in_memory)
    assert len(a) == 10 and a == b
    ex = tasks["rg"].make_example({k: v[0] for k, v in a[0].items()})
    assert tasks["rg"].score(f"<answer>{ex.ground_truth}</answer>", ex) == 1.0


def test_array_record_pipeline_resumes_mid_epoch(built):
    data_dir, _, names = built
    src = open_task_source(names["rg"], data_dir, "train")
    full = [b["uid"] for b in itertools.islice(make_prompt_pipeline(src, 3, seed=5), 20)]
    it = make_prompt_pipeline(src, 3, seed=5)
    for _ in range(7):
        next(it)
    state = json.dumps(it.get_state())
    resumed = make_prompt_pipeline(src, 3, seed=5)
    resumed.set_state(json.loads(state))
    assert [b["uid"] for b in itertools.islice(resumed, 13)] == full[7:]


def test_rebuild_reuses_existing_files(built):
    data_dir, tasks, names = built
    assert build_task_dataset(tasks["file"], data_dir) == names["file"]
