"""BoxedAnswer: closed \\boxed{...} detection over token ids, against a character-level Python reference."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from treejax.sampling.predicates import BoxedAnswer

# toy vocabulary: 0 pad, 1 "\\boxed", 2 "{", 3 "}", 4 "x", 5 "}}", 6 "{x}", 7 "\\box", 8 "ed"
PIECES = ["", "\\boxed", "{", "}", "x", "}}", "{x}", "\\box", "ed"]
VOCAB = {s: i for i, s in enumerate(PIECES) if s}
PRED = BoxedAnswer.from_vocab(VOCAB, open_pattern=(1, 2))
PRED_JIT = jax.jit(PRED)


def _reference(ids, length):
    """Character-level: a token-aligned '\\boxed{' whose braces balance later in the text."""
    text_ids = list(ids[:length])
    for i in range(len(text_ids) - 1):
        if text_ids[i] == 1 and text_ids[i + 1] == 2:
            depth = 1
            for tid in text_ids[i + 2:]:
                piece = PIECES[tid]
                depth += piece.count("{") - piece.count("}")
                if depth <= 0:
                    return True
            return False
    return False


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=12, max_size=12), st.integers(0, 12))
def test_boxed_answer_matches_reference(ids, length):
    got = bool(PRED_JIT(jnp.asarray(ids, jnp.int32), jnp.int32(length)))
    assert got == _reference(ids, length)


def test_boxed_examples_and_table():
    assert dict(PRED.brace_delta) == {2: 1, 3: -1, 5: -2}  # "{x}" is balanced: no entry
    closed = np.array([4, 1, 2, 4, 6, 3, 0, 0])
    assert bool(PRED(jnp.asarray(closed), 6)) and not bool(PRED(jnp.asarray(closed), 5))
    nested_open = np.array([1, 2, 2, 4, 3, 0])
    assert not bool(PRED(jnp.asarray(nested_open), 5))
    assert bool(PRED(jnp.asarray(np.array([1, 2, 2, 4, 5, 0])), 5))  # "}}" closes both
