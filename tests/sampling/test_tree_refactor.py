"""The typed-state, staged tree rollout (issue 13) reproduces the rollout before it bit for bit.

Oracle: ``legacy_tree_f03a90a.py``, a frozen copy of ``treejax/sampling/tree.py`` before the refactor (string
``divergence`` policies, dict state). Every output array (forest and info) must be *equal*, not close, on the
scripted toy policy over configs that exercise every stage (row buckets, forks, EOS/repetition/length stops,
fallbacks from leaves and from the root, each old divergence policy and its temperature schedule, random initial
divergence, no budget transfer, answer predicate) and on a tiny transformer with forks and fallbacks."""

import dataclasses

import jax
import jax.numpy as jnp
import legacy_tree_f03a90a as legacy
import numpy as np
import pytest
from test_tree import TOY, TOY_TREE, _prompts, _tiny

from treejax.sampling import branching, decode, tree

_FIELDS = [f.name for f in dataclasses.fields(legacy.TreeConfig)]


# info the rollout reports that the legacy code did not have (ROSE's epsilon-root restarts, 36b68d7; the
# leaves per stop status, `TreeInfo.stops`): named, so that any other difference in the info's keys still fails
ADDED_INFO = {"root_restarts", "stops"}


def _assert_same(new, old):
    """Every array of the legacy rollout's forest and info, bit for bit (the forest's ``leaf_weight`` and the
    ``ADDED_INFO`` entries, added after the legacy code, are not part of the comparison)."""
    (fa, ia), (fb, ib) = new, old
    fa, ia = fa.replace(leaf_weight=None), ia.as_dict()
    assert set(ib) <= set(ia) and set(ia) - set(ib) <= ADDED_INFO, (sorted(ia), sorted(ib))
    for name, x, y in [("forest", fa, fb)] + [(k, ia[k], ib[k]) for k in ib]:
        for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=name)


def _answer_even(tokens_T, length):
    """Toy answer predicate: the response so far has an even token sum."""
    return jnp.sum(jnp.where(jnp.arange(tokens_T.shape[0]) < length, tokens_T, 0)) % 2 == 0


CASES = {
    "toy": dict(),
    "no_buckets": dict(row_buckets=1),
    "official": dict(branching=branching.FixedAverage(remainder="last"), branch_factor=3),
    "logprob_segment": dict(branching=branching.LogProbWeighted(scope="segment", sign=-1.0, temperature=0.7)),
    "logprob_path_schedule": dict(branching=branching.LogProbWeighted(scope="path", schedule=(5.0, 1.0, 100))),
    "init_range_response_rep": dict(num_leaves=8, init_divergence_range=(1, 5), repetition_scope="response",
                                    repetition_ngram=1, repetition_count=3, budget_transfer=False),
    "answer_entropy": dict(answer_fn=_answer_even, finish_on_answer=True, with_entropy=True, row_buckets=2),
}


#: The legacy rollout's string policy for each case's rule (the legacy code predates ``TreeConfig.branching``).
LEGACY_DIVERGENCE = {
    "official": dict(divergence="fixed_average_official"),
    "logprob_segment": dict(divergence="logprob_segment", divergence_sign=-1.0, divergence_temperature=0.7),
    "logprob_path_schedule": dict(divergence="logprob_path", divergence_schedule=(5.0, 1.0, 100)),
}


_DEFAULT_CASES = ()  # every case compiles the legacy and the new rollout: slow  # the rest are slow: two compiles each (old and new)


@pytest.mark.parametrize("case", [c if c in _DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(CASES)])
def test_toy_rollout_bit_exact(case):
    tc = dataclasses.replace(TOY_TREE, **CASES[case])
    old_tc = legacy.TreeConfig(**{k: getattr(tc, k) for k in _FIELDS if not k.startswith("divergence")},
                               **LEGACY_DIVERGENCE.get(case, {}))
    new_ro, old_ro = tree.make_tree_rollout(TOY, tc), legacy.make_tree_rollout(TOY, old_tc)
    for seed, bias in [(0, 0.0), (1, 2.0), (2, -30.0), (3, 0.5)]:
        prompts, lengths = _prompts(seed, P=4 if seed % 2 else 3)
        args = ({"eos_bias": jnp.float32(bias)}, prompts, lengths, jax.random.key(seed))
        _assert_same(new_ro(*args, step=40 * seed), old_ro(*args, step=40 * seed))


@pytest.mark.slow  # two more compiles of the legacy rollout; the toy and transformer cases run by default
def test_branching_rule_equals_its_deprecated_string():
    """``branching=LogProbWeighted(...)`` is the same program as the string it replaces."""
    tc_new = dataclasses.replace(TOY_TREE, branching=branching.LogProbWeighted(scope="path", sign=-1.0,
                                                                              schedule=(5.0, 1.0, 100)))
    old_tc = legacy.TreeConfig(**{k: getattr(TOY_TREE, k) for k in _FIELDS if not k.startswith("divergence")},
                               divergence="logprob_path", divergence_sign=-1.0, divergence_schedule=(5.0, 1.0, 100))
    prompts, lengths = _prompts(5)
    args = ({"eos_bias": jnp.float32(1.0)}, prompts, lengths, jax.random.key(5))
    _assert_same(tree.make_tree_rollout(TOY, tc_new)(*args, step=30),
                 legacy.make_tree_rollout(TOY, old_tc)(*args, step=30))


@pytest.mark.slow  # the legacy oracle of the sampler refactor: ~55 s on 2 cores
def test_transformer_rollout_bit_exact():
    cfg, params = _tiny()
    fns = decode.make_model_fns(cfg, block_size=16, cache_dtype="float32")
    kw = dict(num_leaves=4, max_depth=3, segment_length=4, branch_factor=2, stop_ids=tuple(range(3, 60)),
              with_entropy=True)
    rng = np.random.RandomState(1)
    lengths = np.array([6, 3])
    prompts = rng.randint(60, 250, (2, 6))
    new_ro = tree.make_tree_rollout(fns, tree.TreeConfig(**kw))
    old_ro = legacy.make_tree_rollout(fns, legacy.TreeConfig(**kw))
    fallbacks = 0
    for seed in range(2):
        new = new_ro(params, prompts, lengths, jax.random.key(seed))
        _assert_same(new, old_ro(params, prompts, lengths, jax.random.key(seed)))
        fallbacks += int(new[1].fallbacks)
    assert fallbacks > 0
