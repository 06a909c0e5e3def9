"""The PRM's per-step scores in one teacher-forced pass equal a loop that re-runs the model on each prefix."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.scorers import ScorerConfig
from treejax.scorers.prm import line_steps, segment_steps, step_row, step_scores


def test_line_steps():
    assert line_steps("a = 1\n\nb = 2\nAnswer: 3") == ["a = 1\n", "b = 2\n", "Answer: 3"]
    assert line_steps("") == []


def test_segment_steps():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(96 + i) for i in ids)

    assert segment_steps(Tok(), [1, 2, 3, 4, 5, 9, 9], 5, 2) == ["ab", "cd", "e"]


@pytest.fixture(scope="module")
def scorer(tiny_checkpoint):
    from treejax.scorers.model import load_scorer

    return load_scorer(ScorerConfig(model=tiny_checkpoint, batch_size=2))


def _prefix_score(scorer, ids, width=256):
    """The verdict probability after the prefix ``ids``, from a forward of that prefix alone (right-padded to one
    ``width`` so the loop compiles once; padding comes after the read position, which causal attention ignores)."""
    from treejax.models import transformer

    tokens = np.zeros((1, width), np.int32)
    tokens[0, : len(ids)] = ids
    seg = (np.arange(width) < len(ids)).astype(np.int32)[None]
    h = jax.jit(transformer.forward, static_argnums=1)(scorer.params, scorer.model_config, jnp.asarray(tokens),
                                                       jnp.arange(width, dtype=jnp.int32)[None], jnp.asarray(seg))
    last = h[:, len(ids) - 1]
    logp = np.asarray(jax.nn.log_softmax(transformer.logits(scorer.params, scorer.model_config, last), -1))[0]
    py = sum(math.exp(logp[i]) for i in scorer.yes_ids)
    pn = sum(math.exp(logp[i]) for i in scorer.no_ids)
    return py / (py + pn)


def test_step_scores_equal_a_per_step_loop(scorer):
    qs = ["What is 12 + 30?", "What is 5 + 5?", "What is 1 + 1?"]
    texts = ["12 + 30 = 42\nAnswer: 42", "5 + 5 = 11\nAnswer: 11", "Answer: 2"]  # 3 rows in batches of 2
    steps = [line_steps(t) for t in texts]
    got = step_scores(scorer, qs, steps)
    assert got.shape == (3, 2)
    tag = scorer.tokenizer.encode(scorer.config.step_tag)
    for i, (q, ss) in enumerate(zip(qs, steps)):
        ids, ends = step_row(scorer, q, ss)
        prefix = ids[: ends[0] + 1 - len(scorer.tokenizer.encode(ss[0])) - len(tag)]
        for k in range(len(ss)):  # the slow reference: re-run the model on prompt + steps 1..k, each with its tag
            prefix = prefix + scorer.tokenizer.encode(ss[k]) + tag
            assert ends[k] == len(prefix) - 1
            assert got[i, k] == pytest.approx(_prefix_score(scorer, prefix), rel=1e-4, abs=1e-6)
        assert np.all(np.isnan(got[i, len(ss):]))


def test_steps_past_max_length_are_nan(scorer):
    import dataclasses

    s = dataclasses.replace(scorer, config=dataclasses.replace(scorer.config, max_length=60))
    ids, ends = step_row(s, "What?", ["x = 1\n"] * 20)
    assert len(ids) <= 60 and 0 < len(ends) < 20
    got = step_scores(s, ["What?"], [["x = 1\n"] * 20])
    assert np.all(np.isfinite(got[0, : len(ends)])) and np.all(np.isnan(got[0, len(ends):]))
