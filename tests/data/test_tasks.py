"""Task registry, reasoning-gym tasks, GSM8K/MATH file tasks, split disjointness and bad-input errors."""

import json
import os

import pytest

from treejax.data import splits
from treejax.data.file_tasks import FileTask
from treejax.data.reasoning_gym_tasks import EASY_PRESETS, ReasoningGymTask
from treejax.data.tasks import Example, get_task, task_names
from treejax.errors import DataError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
GSM8K = os.path.join(FIXTURES, "gsm8k_small.jsonl")
MATH = os.path.join(FIXTURES, "math_small.jsonl")


def test_unknown_task_suggests_close_names():
    with pytest.raises(DataError, match="unknown task 'gsm8k'; did you mean 'gsm8k_file'[?] .*task_names[(][)]"):
        get_task("gsm8k")
    with pytest.raises(ValueError, match="unknown task 'no_such_task' [(]all [0-9]+ names: ") as err:
        get_task("no_such_task")
    assert "did you mean" not in str(err.value) and "\n" not in str(err.value)
    assert set(EASY_PRESETS) <= set(task_names())


def test_reasoning_gym_unknown_dataset_and_config_field():
    with pytest.raises(DataError, match="valid names") as err:
        get_task("reasoning_gym", dataset="no_such_dataset")
    assert len(str(err.value)) < 200  # no kilobytes of names
    with pytest.raises(DataError, match="'chain_sums'; did you mean 'chain_sum'"):
        get_task("reasoning_gym", dataset="chain_sums")
    with pytest.raises(DataError, match="min_terms"):
        get_task("chain_sum", not_a_field=3)


def test_reasoning_gym_alias_equals_generic_and_is_seeded():
    a = get_task("chain_sum", size=30, eval_size=10, seed=3, max_terms=3, max_digits=2)
    b = get_task("reasoning_gym", dataset="chain_sum", size=30, eval_size=10, seed=3, max_terms=3, max_digits=2)
    c = get_task("chain_sum", size=30, eval_size=10, seed=4, max_terms=3, max_digits=2)
    assert a.records("train") == b.records("train") and a.records("eval") == b.records("eval")
    assert a.records("train") != c.records("train")
    assert len(a.records("train")) == 30 and len(a.records("eval")) == 10


@pytest.mark.parametrize("seeds", [(0, 0), (0, 1), (5, 6)])
def test_reasoning_gym_train_eval_disjoint_even_across_neighbouring_seeds(seeds):
    # reasoning-gym item i uses Random(seed + i): seeds s and s+1 share items, the hash split must still separate.
    train = get_task("chain_sum_2x1", size=60, eval_size=20, seed=seeds[0])
    evals = get_task("chain_sum_2x1", size=60, eval_size=20, seed=seeds[1])
    train_q = {r["question"] for r in train.records("train")}
    eval_q = {r["question"] for r in evals.records("eval")}
    assert train_q and eval_q and not train_q & eval_q
    assert len(train_q) == 60  # deduplicated within the split
    for q in eval_q:
        assert splits.split_unit(q) < 0.2


def test_reasoning_gym_too_few_distinct_problems_is_an_error():
    # 2 single-digit terms with +/-: only 200 distinct questions.
    with pytest.raises(ValueError, match="distinct"):
        get_task("chain_sum_2x1", size=400, eval_size=10).records("train")


def test_reasoning_gym_scoring_uses_its_scorer_and_maps_partial_credit():
    task = get_task("chain_sum_2x2", size=20, eval_size=5, seed=1)
    ex = next(task.examples("train"))
    gt = ex.ground_truth
    assert ex.prompt_messages[0]["role"] == "system" and "<answer>" in ex.prompt_messages[0]["content"]
    assert ex.prompt_messages[-1] == {"role": "user", "content": ex.metadata["question"]}
    assert task.score(f"thinking... <answer>{gt}</answer>", ex) == 1.0
    assert task.score(f"<answer>{gt}</answer> wait <answer>{int(gt) + 1}</answer>", ex) == 0.0
    assert task.score(f"The answer is {gt}", ex) == 0.0  # no answer tags: reasoning-gym convention
    # A wrong answer reasoning-gym gives partial credit to is 0 by default, the raw value with partial_credit.
    wrong = f"<answer>9{gt}</answer>"
    raw = task.raw_score(wrong, ex)
    assert 0.0 < raw < 1.0
    assert task.score(wrong, ex) == 0.0
    lenient = get_task("chain_sum_2x2", size=20, eval_size=5, seed=1, partial_credit=True)
    assert lenient.score(wrong, next(lenient.examples("train"))) == pytest.approx(raw)
    # extraction is configurable
    auto = get_task("chain_sum_2x2", size=20, eval_size=5, seed=1, extraction="auto")
    assert auto.score(f"The answer is {gt}.", next(auto.examples("train"))) == 1.0


def test_reasoning_gym_rejects_examples_of_another_seed():
    a = get_task("chain_sum", size=5, eval_size=2, seed=0)
    b = get_task("chain_sum", size=5, eval_size=2, seed=100)
    ex = next(a.examples("train"))
    with pytest.raises(ValueError, match="another"):
        b.score("<answer>1</answer>", ex)


@pytest.mark.parametrize("preset", sorted(EASY_PRESETS))
def test_easy_presets_generate_and_score_their_own_answers(preset):
    task = get_task(preset, size=10, eval_size=3, seed=0)
    assert isinstance(task, ReasoningGymTask)
    for ex in list(task.examples("train"))[:3] + list(task.examples("eval")):
        assert task.score(f"<answer>{ex.ground_truth}</answer>", ex) == 1.0


def test_examples_order_is_deterministic_per_seed():
    task = get_task("chain_sum", size=40, eval_size=5, seed=0)
    uids = lambda s: [e.metadata["uid"] for e in task.examples("train", seed=s)]  # noqa: E731
    assert uids(1) == uids(1) and uids(1) != uids(2)
    assert sorted(uids(1)) == sorted(r["uid"] for r in task.records("train"))
    with pytest.raises(ValueError, match="valid splits"):
        list(task.examples("test"))


def test_gsm8k_file_task():
    task = get_task("gsm8k_file", path=GSM8K)
    recs = task.records("train")
    assert len(recs) == 12 and task.records("eval") == []
    answers = [r["answer"] for r in recs]
    assert answers[:5] == ["72", "10", "14400", "-7", "1.5"]
    ex = task.make_example(recs[2])
    assert ex.ground_truth == "14400" and "\\boxed{}" in ex.prompt_messages[-1]["content"]
    assert json.loads(recs[2]["metadata"])["source"].endswith("gsm8k_small.jsonl:3")
    assert task.score("12 months times 1,200 gives \\boxed{14,400}", ex) == 1.0
    assert task.score("#### 14,400", ex) == 1.0
    assert task.score("\\boxed{14,400} ... no, #### 1200", ex) == 0.0


def test_math_file_task_and_hash_split():
    task = get_task("math_file", path=MATH)
    answers = [r["answer"] for r in task.records("train")]
    assert answers == ["\\frac{3}{4}", "2\\sqrt{3}", "\\{-2, 2\\}", "3", "1024", "\\dfrac{1}{4}"]
    ex = task.make_example(task.records("train")[0])
    assert ex.metadata["level"] == "Level 1" and ex.metadata["type"] == "Prealgebra"
    assert task.score("Adding: $\\boxed{0.75}$", ex) == 1.0
    assert task.score("Adding: $\\boxed{\\frac{6}{8}}$", ex) == 1.0
    assert task.score("Adding: $\\boxed{\\frac{2}{3}}$", ex) == 0.0
    split = FileTask(MATH, format="math", eval_fraction=0.5)
    tq = {r["question"] for r in split.records("train")}
    eq = {r["question"] for r in split.records("eval")}
    assert not tq & eq and len(tq | eq) == 6


def test_parquet_file_task(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in open(GSM8K)]
    path = str(tmp_path / "gsm8k.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert [r["answer"] for r in get_task("gsm8k_file", path=path).records("train")][:3] == ["72", "10", "14400"]
    rows[3]["answer"] = "no marker here"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match=r"gsm8k\.parquet:row 3.*####"):
        get_task("gsm8k_file", path=path)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [
        json.dumps({"question": "q1", "answer": "#### 1"}),
        "",
        json.dumps({"question": "q2", "answer": "#### 2"}),
        '{"question": "q3", "answer": "#### 3"',
    ])
    with pytest.raises(DataError, match=r"bad\.jsonl:4: malformed JSON"):
        get_task("gsm8k_file", path=path)


def test_missing_answer_field_is_a_clear_error(tmp_path):
    path = _write(tmp_path / "missing.jsonl", [json.dumps({"question": "q1", "answer": "#### 1"}),
                                               json.dumps({"question": "q2", "solution": "#### 2"})])
    with pytest.raises(DataError, match=r"missing\.jsonl:2: missing field 'answer'"):
        get_task("gsm8k_file", path=path)
    path = _write(tmp_path / "nobox.jsonl", [json.dumps({"problem": "p", "solution": "it is 3"})])
    with pytest.raises(DataError, match=r"nobox\.jsonl:1: .*no \\boxed"):
        get_task("math_file", path=path)
    path = _write(tmp_path / "trunc.jsonl", [json.dumps({"problem": "p", "solution": "\\boxed{\\frac{1"})])
    with pytest.raises(ValueError, match=r"trunc\.jsonl:1: .*truncated"):
        get_task("math_file", path=path)
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        get_task("gsm8k_file", path=str(tmp_path / "nowhere.jsonl"))


def test_eval_file_overlapping_train_is_an_error(tmp_path):
    path = _write(tmp_path / "eval.jsonl", [open(GSM8K).readline().strip()])
    with pytest.raises(ValueError, match="must not overlap"):
        get_task("gsm8k_file", path=GSM8K, eval_path=path)
    ok = _write(tmp_path / "eval_ok.jsonl", [json.dumps({"question": "new?", "answer": "#### 5"})])
    task = get_task("gsm8k_file", path=GSM8K, eval_path=ok)
    assert [r["answer"] for r in task.records("eval")] == ["5"]


def test_empty_task_file_names_the_file(tmp_path):
    """Not the pipeline's "shard 0 of 1 is empty": the file task says which file holds nothing."""
    empty = _write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DataError, match=r"task file .*empty\.jsonl holds no problems"):
        get_task("gsm8k_file", path=empty)
    with pytest.raises(DataError, match=r"task file .*empty\.jsonl holds no problems"):
        get_task("gsm8k_file", path=GSM8K, eval_path=empty)


def test_numeric_answers_are_the_ground_truth(tmp_path):
    path = _write(tmp_path / "ints.jsonl", [json.dumps({"question": "2+3?", "answer": 5}),
                                            json.dumps({"question": "3/2?", "answer": 1.5}),
                                            json.dumps({"question": "9-2?", "answer": 7.0}),
                                            json.dumps({"question": "1+1?", "answer": "so #### 2"})])
    task = get_task("gsm8k_file", path=path)
    assert [r["answer"] for r in task.records("train")] == ["5", "1.5", "7", "2"]
    ex = task.make_example(task.records("train")[0])
    assert task.score("\\boxed{5}", ex) == 1.0 and task.score("\\boxed{6}", ex) == 0.0
    math_path = _write(tmp_path / "math_ints.jsonl", [json.dumps({"problem": "2+3?", "answer": 5})])
    assert get_task("math_file", path=math_path, answer_field="answer").records("train")[0]["answer"] == "5"
    for bad, kind in ((True, "bool"), ([5], "list"), (None, None)):
        path = _write(tmp_path / "bad.jsonl", [json.dumps({"question": "q", "answer": bad})])
        message = f"bad\\.jsonl:1: field 'answer' must be a string or a number, got {kind}" if kind else \
            "bad\\.jsonl:1: missing field 'answer'"
        with pytest.raises(DataError, match=message):
            get_task("gsm8k_file", path=path)
    path = _write(tmp_path / "q.jsonl", [json.dumps({"question": 7, "answer": 5})])
    with pytest.raises(DataError, match="q\\.jsonl:1: field 'question' must be a string, got int"):
        get_task("gsm8k_file", path=path)


def test_numeric_parquet_answers(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "ints.parquet")
    pq.write_table(pa.Table.from_pylist([{"question": "2+3?", "answer": 5}, {"question": "2+4?", "answer": 6}]),
                   path)
    assert [r["answer"] for r in get_task("gsm8k_file", path=path).records("train")] == ["5", "6"]
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="junk.parquet: not a readable parquet file"):
        get_task("gsm8k_file", path=str(tmp_path / "junk.parquet"))


def test_file_task_option_errors_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="task 'gsm8k_file': .*'eval_pth'; did you mean 'eval_path'[?] [(]its options: path, "):
        get_task("gsm8k_file", path=GSM8K, eval_pth="x.jsonl")
    with pytest.raises(DataError, match="task 'gsm8k_file': missing a required argument: 'path'"):
        get_task("gsm8k_file")
    with pytest.raises(DataError, match="unsupported task file type"):
        get_task("gsm8k_file", path=_write(tmp_path / "t.csv", ["question,answer"]))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"question": "caf\xe9", "answer": "#### 1"}\n')
    with pytest.raises(DataError, match="latin1.jsonl:1: not UTF-8 text"):
        get_task("gsm8k_file", path=str(tmp_path / "latin1.jsonl"))


def test_example_is_frozen_dataclass():
    ex = Example([{"role": "user", "content": "q"}], "1", {})
    with pytest.raises(Exception):
        ex.ground_truth = "2"


def test_task_seeds_give_disjoint_problem_streams():
    """reasoning-gym builds item i from Random(rg_seed + i): the task seed is spread out before it is passed on, so
    seed 7 is not seed 0's problems shifted by 7 items; seed 0 keeps its problems (rg_seed 0), and rg_seed= passes
    reasoning-gym's own seed through (the old behaviour of seed=7)."""
    from treejax.data.reasoning_gym_tasks import reasoning_gym_seed

    assert reasoning_gym_seed(0) == 0
    qs = lambda t, split: {r["question"] for r in t.records(split)}  # noqa: E731
    opts = dict(size=200, eval_size=50, min_terms=3, max_terms=3, min_digits=2, max_digits=3)
    a, b = get_task("chain_sum", seed=0, **opts), get_task("chain_sum", seed=7, **opts)
    assert json.loads(a.records("train")[0]["metadata"])["rg_seed"] == 0
    for split in ("train", "eval"):
        assert len(qs(a, split) & qs(b, split)) <= 0.02 * len(qs(a, split))
    old_seed7 = get_task("chain_sum", seed=0, rg_seed=7, **opts)
    assert len(qs(a, "train") & qs(old_seed7, "train")) >= 0.9 * len(qs(a, "train"))  # the trap it avoids


def test_blank_prompts_in_a_task_file_are_filtered_with_a_count(tmp_path, caplog, monkeypatch):
    import logging

    rows = [{"question": "What is 2 + 3?", "answer": "#### 5"}, {"question": "", "answer": "#### 1"},
            {"question": "  \n\t ", "answer": "#### 2"}, {"question": "What is 4 + 4?", "answer": "#### 8"}]
    path = _write(tmp_path / "blank.jsonl", [json.dumps(r) for r in rows])
    monkeypatch.setattr(logging.getLogger("treejax"), "propagate", True)  # a CLI test may have turned it off
    with caplog.at_level(logging.WARNING, logger="treejax.data.file_tasks"):
        task = get_task("gsm8k_file", path=path, eval_fraction=0.0)
    assert [r["question"] for r in task.records("train")] == ["What is 2 + 3?", "What is 4 + 4?"]
    # (a set: after a CLI test in the same process, the treejax logger's own handler may capture it a second time)
    warned = {r.getMessage() for r in caplog.records if "whitespace-only" in r.getMessage()}
    assert warned == {f"{path}: 2 of 4 problems have an empty or whitespace-only 'question' field (first at "
                      f"{path}:2): filtered out"}
    only_blank = _write(tmp_path / "only_blank.jsonl", [json.dumps(r) for r in rows[1:3]])
    with pytest.raises(DataError, match=r"only_blank\.jsonl holds no problems .* every 'question' field is empty"):
        get_task("gsm8k_file", path=only_blank)
    assert sorted(os.listdir(tmp_path)) == ["blank.jsonl", "only_blank.jsonl"]  # nothing else written
