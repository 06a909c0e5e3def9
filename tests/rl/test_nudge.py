"""NudgeRL (treejax.rl.nudge, estimator ``nudge``): the advantage against a loop over the code's formulas, the
contexts' dropout, the hinted prompts and hints, and the configuration checks."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError, DataError
from treejax.forest import Forest
from treejax.rl.advantages import NudgeOptions, estimator_spec
from treejax.rl.config import RunConfig
from treejax.rl.nudge import HINT_TEMPLATE, NudgeConfig, hinted_example, problem_hints, rollout_contexts
from treejax.sampling.tree import TreeConfig


def _reference(rewards, problems, contexts, lam, eps):
    """The code's per-problem loop: (r - mu_c) + lam (mu_c - mu) for hinted, r - mu for plain, whitened with the
    population std."""
    out = np.zeros(len(rewards))
    for g in set(problems):
        idx = [i for i, p in enumerate(problems) if p == g]
        r = np.array([rewards[i] for i in idx], np.float64)
        c = np.array([contexts[i] for i in idx])
        mu = r.mean()
        a = np.array([(r[k] - r[c == c[k]].mean()) + lam * (r[c == c[k]].mean() - mu) if c[k] > 0 else r[k] - mu
                      for k in range(len(idx))])
        a = (a - a.mean()) / (a.std() + eps)
        out[idx] = a
    return out


def _forest(N, T=4):
    lengths = np.full((N, 1), T - 1, np.int32)
    mask = (np.arange(T)[None, None] < lengths[:, :, None]).astype(np.float32)
    return Forest(node_parent=jnp.zeros((N, 2), jnp.int32), node_depth=jnp.zeros((N, 2), jnp.int32),
                  node_status=jnp.zeros((N, 2), jnp.int32), leaf_path=jnp.zeros((N, 1, 2), jnp.int32),
                  leaf_status=jnp.zeros((N, 1), jnp.int32), leaf_length=jnp.asarray(lengths),
                  tokens=jnp.zeros((N, 1, T), jnp.int32), logprobs=jnp.zeros((N, 1, T)),
                  segment_index=jnp.zeros((N, 1, T), jnp.int32), loss_mask=jnp.asarray(mask), segment_length=T)


def test_nudge_advantage_matches_the_code_formulas():
    rng = np.random.default_rng(0)
    cfg = NudgeConfig(hints=("a", "b"))
    problems, contexts = [], []
    for g in range(3):
        ctx = rollout_contexts(rng, cfg)
        problems += [g] * len(ctx)
        contexts += ctx.tolist()
    R = len(problems)
    rewards = rng.choice([-1.0, 1.0], size=R)
    rewards[problems.index(2):] = 1.0  # problem 2: all equal -> exactly 0
    opts = NudgeOptions(lam=1.1, eps=1e-5, distill_coef=0.1)
    want = _reference(rewards, problems, contexts, 1.1, 1e-5)
    assert np.all(want[np.array(problems) == 2] == 0)
    # rollout rows, then one distillation row per rollout (same problem, context -1, source = the rollout)
    r2 = np.concatenate([rewards, rewards])[:, None]
    prob = np.array(problems + problems)[:, None]
    ctx = np.array(contexts + [-1] * R)[:, None]
    src = np.array([-1] * R + list(range(R)))[:, None]
    spec = estimator_spec("nudge")
    forest = _forest(2 * R)
    adv = spec.fn(forest, jnp.asarray(r2, jnp.float32), opts, nudge_problem_PxW=jnp.asarray(prob),
                  nudge_context_PxW=jnp.asarray(ctx), nudge_source_PxW=jnp.asarray(src))
    got = np.asarray(adv.leaves)[:, 0]
    np.testing.assert_allclose(got[:R], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[R:], 0.1 * want, rtol=1e-5, atol=1e-7)
    tokens = np.asarray(adv.tokens)
    np.testing.assert_allclose(tokens[:, 0, :3], np.repeat(got[:, None], 3, 1), rtol=1e-6)
    assert not tokens[:, 0, 3:].any()
    with pytest.raises(ValueError, match="nudge_source_PxW"):
        spec.fn(forest, jnp.asarray(r2, jnp.float32), opts, nudge_problem_PxW=jnp.asarray(prob),
                nudge_context_PxW=jnp.asarray(ctx), nudge_source_PxW=jnp.asarray(src[:3]))


def test_contexts_hints_and_prompts():
    cfg = NudgeConfig(num_hints=2, rollouts_per_hint=4, p_drop=0.5, hints=("h1", "h2", "h3"))
    rng = np.random.default_rng(1)
    ctxs = [rollout_contexts(rng, cfg) for _ in range(4000)]
    for c in ctxs[:50]:  # hinted rows by hint, then the plain ones
        hinted = c[c > 0].tolist()
        assert len(c) == 8 and hinted == sorted(hinted) and c.tolist() == hinted + [0] * (8 - len(hinted))
    drops = np.array([(c == 0).sum() for c in ctxs])
    assert abs(drops.mean() - 4.0) < 0.1 and abs(drops.var() - 2.0) < 0.15  # Binomial(8, 0.5) in total
    assert all(((c == 1).sum() <= 4) and ((c == 2).sum() <= 4) for c in ctxs)
    assert rollout_contexts(rng, NudgeConfig(hints=("a", "b"), p_drop=0.0)).tolist() == [1] * 4 + [2] * 4
    rec = {"uid": "u", "question": "2 + 3 =", "answer": "5", "metadata": json.dumps({"hints": ["x", "y", "z"]})}
    assert problem_hints(rec, cfg) == ["x", "y"]  # the record's own hints first
    plain = dict(rec, metadata="{}")
    assert problem_hints(plain, cfg) == ["h1", "h2"]
    from treejax.data.task_base import Example

    ex = Example(prompt_messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "2 + 3 =\n\nBe brief."}],
                 ground_truth="5", metadata={"question": "2 + 3 =", "uid": "u"})
    hinted = hinted_example(ex, "x", cfg)
    assert hinted.prompt_messages[1]["content"] == "2 + 3 =\n\n" + HINT_TEMPLATE.format(hint="x") + "\n\nBe brief."
    assert hinted.prompt_messages[0] == ex.prompt_messages[0] and hinted.metadata == ex.metadata
    assert hinted.ground_truth == "5" and hinted_example(ex, None, cfg) is ex
    with pytest.raises(DataError, match="num_hints"):
        problem_hints(plain, NudgeConfig(hints=("only one",)))


def _chains(**kw):
    return RunConfig(rollout=TreeConfig(num_leaves=1, branch_factor=1, max_depth=2, segment_length=4),
                     estimator="nudge", rollouts=[NudgeConfig(hints=("a", "b"))], **kw)


def test_config_checks():
    assert _chains().rollouts[0].rows_per_problem() == 16
    with pytest.raises(ConfigError, match=r"estimator 'nudge' reads .* supplies them \(\['NudgeConfig'\]\)"):
        RunConfig(estimator="nudge")
    with pytest.raises(ConfigError, match="NudgeConfig needs estimator 'nudge'"):
        RunConfig(rollouts=[NudgeConfig(hints=("a", "b"))], estimator="grpo",
                  rollout=TreeConfig(num_leaves=1, branch_factor=1, max_depth=2, segment_length=4))
    with pytest.raises(ConfigError, match="num_leaves = 1"):
        RunConfig(estimator="nudge", rollouts=[NudgeConfig(hints=("a", "b"))])
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        _chains(dynamic_sampling=True)
    with pytest.raises(ConfigError, match="template"):
        NudgeConfig(template="no hint here")
    with pytest.raises(ValueError, match="mini_batches"):
        _chains(mini_batches=3)
