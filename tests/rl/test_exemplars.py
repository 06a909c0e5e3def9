"""XRPO's exemplar injection (treejax.rl.exemplars): the chat turns, retrieval against a brute-force reference,
and the source on a scripted task: failed rows are re-rolled with a solved exemplar and replaced in place, the
bank fills from solved rows, every row has the fixed width, and the bank round-trips through the checkpoint."""

from __future__ import annotations

import dataclasses
import types

import jax
import numpy as np
import pytest

from treejax.data.task_base import Example
from treejax.errors import ConfigError
from treejax.forest import forest_from_paths
from treejax.rl.exemplars import ExemplarConfig, ExemplarRollouts, retrieve, with_exemplars
from treejax.rl.rollouts import RolloutCounters, ScoredRows
from treejax.rl.selection import ngram_embeddings


def _example(i, system=True):
    msgs = ([{"role": "system", "content": "sys"}] if system else []) + [{"role": "user", "content": f"q{i} = ?"}]
    return Example(prompt_messages=msgs, ground_truth=str(i), metadata={"question": f"q{i} = ?", "uid": str(i)})


def test_exemplars_come_before_the_question_after_the_system_message():
    ex = with_exemplars(_example(1), [{"user": "q2 = ?", "assistant": "2"}, {"user": "q3 = ?", "assistant": "3"}])
    assert [m["role"] for m in ex.prompt_messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert ex.prompt_messages[1]["content"] == "q2 = ?" and ex.prompt_messages[-1]["content"] == "q1 = ?"
    assert ex.ground_truth == "1" and _example(1).prompt_messages[-1]["content"] == "q1 = ?"
    assert [m["role"] for m in with_exemplars(_example(1, False), [{"user": "a", "assistant": "b"}]).prompt_messages] \
        == ["user", "assistant", "user"]


def test_retrieval_matches_brute_force():
    bank = [{"key": str(i), "question": q} for i, q in enumerate(["12 + 34", "98 - 7", "12 + 35", "5 * 6", "12 + 34"])]
    for query, shots in [("12 + 34", 2), ("98 - 8", 1), ("5 * 7", 3)]:
        emb = ngram_embeddings([query] + [e["question"] for e in bank], 256)
        sims = [float(emb[0] @ emb[1 + i]) for i in range(len(bank)) if bank[i]["key"] != "0"]
        pool = [e for e in bank if e["key"] != "0"]
        want = sorted(range(len(pool)), key=lambda i: (-round(sims[i], 12), -i))[:shots]
        got = retrieve(query, bank, shots, 256, exclude_key="0")
        assert [e["key"] for e in got] == [pool[i]["key"] for i in want]
    assert retrieve("x", [{"key": "a", "question": "x"}], 1, 256, exclude_key="a") == []


class _Tokenizer:
    def apply_chat_template(self, msgs, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}" for m in msgs) + "<assistant>"

    def encode(self, text):  # 4 tokens per chat turn
        return [1, 2, 3, 4] * text.count("<")

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(64 + i) for i in ids)


class _Base:
    """Questions q0, q1, ... drawn 4 at a time (q_i asks about i % 6). A plain even question is solved by both
    leaves, a plain odd one by none; any question with an exemplar in its context is solved by one leaf."""

    def __init__(self):
        self.cfg = types.SimpleNamespace(system_prompt=None, instruction=None)
        self.tokenizer, self.pad_id, self.prompt_width = _Tokenizer(), 0, 16
        self.pipeline, self.estimator_inputs, self.drawn, self.calls = None, (), 0, []

    def draw(self):
        ids = range(self.drawn, self.drawn + 4)
        self.drawn += 4
        return [_example(i % 6) for i in ids], np.ones((4, 16), np.int32), np.full(4, 16, np.int32)

    def roll_and_score(self, params, examples, prompts, lens, key, step):
        self.calls.append(np.asarray(prompts).shape)
        n = len(examples)
        helped = np.array([len(e.prompt_messages) > 2 for e in examples])
        even = np.array([int(e.ground_truth) % 2 == 0 for e in examples])
        scores = np.where(helped[:, None], [[1.0, 0.0]], np.where(even[:, None], 1.0, 0.0)).astype(np.float32)
        tokens = np.full((n, 2, 2), 5, np.int32) + np.asarray([int(e.ground_truth) for e in examples])[:, None, None]
        f = forest_from_paths(np.tile([[[0, 1], [0, 2]]], (n, 1, 1)), np.full((n, 2), 2), 2, tokens=tokens)
        return ScoredRows(f, 2 * scores - 1, scores, examples, np.asarray(prompts), np.asarray(lens),
                          RolloutCounters(), None, {"reward_scores": scores})

    def checkpoint_state(self):
        return {}

    def restore_state(self, data_state):
        pass


def test_failed_rows_are_re_rolled_with_exemplars_in_place():
    src = ExemplarRollouts(_Base(), ExemplarConfig(shots=1, bank_size=3))
    ro = src.sample(None, jax.random.key(0), 0)  # q0..q3: the bank is empty, nothing is injected
    assert ro.extra_metrics["exemplars/injected"] == 0 and len(src.bank) == 2  # q0 and q2 were solved
    assert np.asarray(ro.prompts_PxLp).shape == (4, 32)  # twice the run's width, every step
    ro = src.sample(None, jax.random.key(1), 1)  # q4 q5 q0 q1: q5 and q1 fail and are re-rolled with an exemplar
    m = ro.extra_metrics
    assert m["exemplars/injected"] == 2 and m["exemplars/rescued"] == 2 and ro.counters.rollout_calls == 2
    assert [e.ground_truth for e in ro.examples] == ["4", "5", "0", "1"]  # rows stay in place
    assert [len(e.prompt_messages) for e in ro.examples] == [2, 4, 2, 4]  # system, (exemplar,) question
    np.testing.assert_array_equal(np.asarray(ro.scores_PxW)[:, 0], [1, 1, 1, 1])
    np.testing.assert_array_equal(np.asarray(ro.forest.tokens)[:, 0, 0], [9, 10, 5, 6])
    assert src.base.calls[-1] == (4, 32)  # the re-roll ran on the fixed width, padded to P rows
    assert [e["question"] for e in src.bank] == ["q2 = ?", "q4 = ?", "q0 = ?"]  # q0 solved again: moved to the end
    b = ExemplarRollouts(_Base(), ExemplarConfig(shots=1, bank_size=3))
    b.base.drawn = src.base.drawn
    b.restore_state(src.checkpoint_state())
    x, y = src.sample(None, jax.random.key(2), 2), b.sample(None, jax.random.key(2), 2)
    assert [e.prompt_messages for e in x.examples] == [e.prompt_messages for e in y.examples]
    assert x.extra_metrics == y.extra_metrics and src.bank == b.bank


def test_too_long_prompts_are_left_as_they_were():
    src = ExemplarRollouts(_Base(), ExemplarConfig(shots=1, prompt_width=17))
    src.sample(None, jax.random.key(0), 0)
    ro = src.sample(None, jax.random.key(1), 1)
    assert ro.extra_metrics["exemplars/injected"] == 0 and ro.extra_metrics["exemplars/too_long"] == 2
    with pytest.raises(ConfigError, match="narrower"):
        ExemplarRollouts(_Base(), ExemplarConfig(prompt_width=8))


def test_config_checks():
    from treejax.rl.config import RunConfig

    with pytest.raises(ConfigError, match="shots"):
        ExemplarConfig(shots=0)
    with pytest.raises(ConfigError, match=r"ExemplarConfig.*dynamic_sampling"):
        RunConfig(rollouts=[ExemplarConfig()], dynamic_sampling=True)
    assert dataclasses.replace(RunConfig(), rollouts=[ExemplarConfig()]).rollouts[0].shots == 1
