"""R3L: the failure point, the retried row (feedback out of the row, behaviour log-probs under it), the pivotal
masks on the retried row and its source, Positive Amplification, the config checks."""

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.rl.judges.r3l import R3LConfig, R3LRollouts, assemble_retry, pivotal_masks, retry_slots
from treejax.rl.shaping.r3l import PositiveAmplification

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


# ------------------------------------------------------------------------------------- the pure pieces
def test_retry_slots_pivotal_masks_and_the_row_by_hand():
    assert (list(retry_slots(16, 4)[0]), list(retry_slots(16, 4)[1])) == (list(range(12)), [12, 13, 14, 15])
    retry, source = pivotal_masks(3, 7, 9)  # failure point a = 3, retried row of 7 tokens, T = 9
    assert retry.tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0] and source.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    tok, lp, n = assemble_retry([11, 12, 13], [-0.1, -0.2, -0.3], [41, 42, 43, 44, 45], [-1.5, -2.5, -0.5, -0.7, -0.9],
                                T=7)
    assert tok.tolist() == [11, 12, 13, 41, 42, 43, 44] and n == 7  # the retry is cut at T
    np.testing.assert_allclose(lp, [-0.1, -0.2, -0.3, -1.5, -2.5, -0.5, -0.7])
    tok, lp, n = assemble_retry([], [], [41], [-1.0], T=3)
    assert tok.tolist() == [41, 0, 0] and n == 1 and lp.tolist() == [-1.0, 0, 0]


def test_positive_amplification_by_hand():
    from treejax.rl.shaping.base import ShapingInputs

    # two leaves of one prompt: leaf 0 correct with advantage 0.5 on 2 tokens, leaf 1 wrong with -0.5 on 3
    adv = jnp.asarray([[[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5]]])
    mask = jnp.asarray([[[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]])
    z = jnp.zeros((1, 2, 3))
    x = ShapingInputs(advantages=adv, loss_mask=mask, old_logp=z, rewards=jnp.asarray([[1.0, -1.0]]),
                      scores=jnp.asarray([[1.0, 0.0]]), leaf_length=jnp.asarray([[2, 3]]),
                      eps_scale=jnp.ones((1, 2)), leaf_path=jnp.zeros((1, 2, 2), jnp.int32))
    out = PositiveAmplification(factor=3.0).shape(x)
    np.testing.assert_allclose(np.asarray(out.advantages), [[[1.5, 1.5, 0.0], [-0.5, -0.5, -0.5]]])
    assert int(out.metrics["amplified"]) == 1
    np.testing.assert_allclose(float(out.metrics["positive_share_before"]), 1.0 / 2.5)  # 1 of |A| 2.5
    np.testing.assert_allclose(float(out.metrics["positive_share_after"]), 3.0 / 4.5)   # 3 of 4.5
    same = PositiveAmplification(factor=1.0).shape(x)
    np.testing.assert_array_equal(np.asarray(same.advantages), np.asarray(adv))  # factor 1: the identity


# ------------------------------------------------------------------------------------- config checks
@pytest.mark.parametrize("kw,match", [(dict(threshold=0.0), "threshold must be in"),
                                      (dict(retries_per_prompt=0), "retries_per_prompt must be >= 1"),
                                      (dict(steps="words"), "steps must be one of"),
                                      (dict(feedback="hint"), "feedback must be one of"),
                                      (dict(feedback_template="{answer}"), "feedback_template may use only"),
                                      (dict(prm="smollm2"), "prm must be a ScorerConfig"),
                                      (dict(refiner="policy"), "refiner must be a RefinerConfig")])
def test_stage_errors_are_one_line_with_the_fix(kw, match):
    with pytest.raises(ConfigError, match=match) as e:
        R3LConfig(**kw)
    assert "fix:" in str(e.value) and "\n" not in str(e.value)


def test_amplification_factor_error():
    with pytest.raises(ConfigError, match="fix: PositiveAmplification.factor = 2.0"):
        PositiveAmplification(factor=0.5)


def test_shipped_config_and_the_chain_checks():
    from treejax import train

    path = os.path.join(CONFIGS, "efficacy_r3l.gin")
    cfg = train.parse([path], [])
    (stage,) = cfg.rollouts
    assert isinstance(stage, R3LConfig) and stage.feedback == "refiner" and stage.retries_per_prompt == 4
    assert cfg.shapers == (PositiveAmplification(factor=2.0),)
    assert cfg.loss.tis_cap == 2.0 and cfg.old_logp == "trainer" and not cfg.dynamic_sampling
    for bad, match in ((["TreeConfig.branch_factor = 2"], "fix: TreeConfig.branch_factor = 1"),
                       (["LossConfig.tis_cap = None"], "importance correction.*or R3LConfig.feedback = 'none'"),
                       (["RunConfig.packed_update = True"], "fix: RunConfig.packed_update = False"),
                       (["R3LConfig.retries_per_prompt = 16"], "leaves no source slot in a group of 16"),
                       (["RunConfig.estimator = 'remax'"], "does not supply")):
        with pytest.raises(ConfigError, match=match):
            train.parse([path], bad)
    plain = train.parse([path], ["LossConfig.tis_cap = None", "RunConfig.old_logp = 'sampler'",
                                 "R3LConfig.feedback = 'none'"])  # an on-policy retry needs no correction
    assert plain.rollouts[0].feedback == "none"


# ------------------------------------------------------------------------------------- the retried row
@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    from treejax.models.registry import load_model

    return load_model(tiny_checkpoint, param_dtype="float32", compute_dtype="float32")


RESPONSES = ("a = 12 + 30\na = 41\nAnswer: 41", "Answer: 42", "a = 12\nAnswer: 12")


def _rollouts(tok, T):
    """One prompt, three leaves: leaf 0 fails in three lines, leaf 1 is correct, leaf 2 (the retry slot, k = 1)
    fails; sampler log-probs all -1."""
    from treejax.forest import Forest
    from treejax.rl.rollouts import Rollouts

    ex = types.SimpleNamespace(metadata={"question": "What is 12 + 30?"}, ground_truth="42")
    prompt = tok.encode("What is 12 + 30?\n")
    resp = [tok.encode(r) for r in RESPONSES]
    tokens, lengths = np.zeros((1, 3, T), np.int32), np.array([[len(r) for r in resp]], np.int32)
    for w, r in enumerate(resp):
        tokens[0, w, : len(r)] = r
    on = (np.arange(T)[None, None] < lengths[..., None]).astype(np.float32)
    f = Forest(node_parent=jnp.zeros((1, 3), jnp.int32), node_depth=jnp.zeros((1, 3), jnp.int32),
               node_status=jnp.zeros((1, 3), jnp.int32), leaf_path=jnp.zeros((1, 3, 5), jnp.int32),
               leaf_status=jnp.full((1, 3), 3, jnp.int32), leaf_length=jnp.asarray(lengths),
               tokens=jnp.asarray(tokens), logprobs=jnp.asarray(-on), segment_index=jnp.zeros((1, 3, T), jnp.int32),
               loss_mask=jnp.asarray(on), segment_length=8)
    return Rollouts(forest=f, rewards_PxW=jnp.asarray([[-1.0, 1.0, -1.0]]),
                    scores_PxW=np.array([[0.0, 1.0, 0.0]], np.float32), prompts_PxLp=np.array([prompt], np.int32),
                    lengths_P=np.array([len(prompt)]), examples=[ex])


def _source(tiny, feedback, monkeypatch, T=32):
    from treejax.sampling import strategies, tree
    from treejax.sampling.decode import make_model_fns

    cfg_m, params, tok = tiny
    tc = tree.TreeConfig(num_leaves=3, max_depth=4, segment_length=8, branch_factor=1, init_divergence=3,
                         strategy=strategies.Temperature(1.0))
    cfg = types.SimpleNamespace(model="unused", rollout=tc, reward_style="pm1", overlong_buffer=0, overlong_factor=1.0)
    task = types.SimpleNamespace(score=lambda text, ex: 1.0)  # every retried response counts as correct
    ctx = types.SimpleNamespace(cfg=cfg, tokenizer=tok, task=task, sampler_fns=make_model_fns(cfg_m), pad_id=0)
    stage = R3LConfig(retries_per_prompt=1, feedback=feedback)
    base = types.SimpleNamespace(sample=lambda params, key, step: _rollouts(tok, T), pipeline=None)
    src = R3LRollouts(base, stage, ctx)
    seen = []

    def scores(prm, qs, steps):  # only the source slot's failed leaf 0 is judged: (0.9, 0.3, 0.1)
        seen.append(steps)
        return np.array([[0.9, 0.3, 0.1]])
    monkeypatch.setattr(src, "_load", lambda: setattr(src, "prm", object()))
    monkeypatch.setattr("treejax.scorers.prm.step_scores", scores)
    return src, seen


def test_the_retried_row_from_the_failure_point_with_feedback_out_of_the_row(tiny, monkeypatch):
    """PRM scores (0.9, 0.3, 0.1) on leaf 0: the failure point is line 2 ("a = 41"), a = the tokens of line 1.
    The retry slot (leaf 2) gets line 1 + the policy's retry; the feedback is in the context the retry was
    sampled under, not in the row; the retry's log-probs equal a direct teacher-forced forward of the policy over
    prompt + line 1 + feedback; only [a, n) is trained on the retried row, and leaf 0 loses its line 1."""
    from tests.scorers.test_refiner import teacher_forced_logp
    from treejax.rl.judges.r3l import DEFAULT_FEEDBACK_TEMPLATE

    cfg_m, params, tok = tiny
    src, seen = _source(tiny, "template", monkeypatch)
    ro = src.sample(params, jax.random.key(5), 0)
    m = ro.extra_metrics
    assert len(seen) == 1 and len(seen[0]) == 1  # the retry slot's own failure is no source
    assert (m["r3l/failed"], m["r3l/located"], m["r3l/retried"], m["r3l/salvaged"]) == (1, 1, 1, 1)
    assert m["r3l/first_step_mean"] == 1.0
    line1 = tok.encode("a = 12 + 30\n")
    a, f = len(line1), ro.forest
    tokens, logp, mask = (np.asarray(x)[0] for x in (f.tokens, f.logprobs, f.loss_mask))
    n = int(f.leaf_length[0, 2])
    assert n > a
    np.testing.assert_array_equal(tokens[2, :a], line1)
    feedback = tok.encode(DEFAULT_FEEDBACK_TEMPLATE.format(step="a = 41", reflection=""))
    assert m["r3l/feedback_tokens"] == len(feedback)
    context = list(ro.prompts_PxLp[0, : ro.lengths_P[0]]) + line1 + feedback
    q = teacher_forced_logp(cfg_m, params, context, tokens[2, a:n].tolist())
    np.testing.assert_allclose(logp[2, a:n], q, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(mask[2], (np.arange(32) >= a) & (np.arange(32) < n))  # the diverging suffix
    n0 = len(tok.encode(RESPONSES[0]))
    np.testing.assert_array_equal(mask[0], (np.arange(32) >= a) & (np.arange(32) < n0))  # its prefix out too
    np.testing.assert_array_equal(mask[1, : len(tok.encode(RESPONSES[1]))], 1.0)  # other leaves untouched
    np.testing.assert_array_equal(ro.refined_PxWxT[0, 2], mask[2])  # off-policy: sampled under the feedback
    assert not ro.refined_PxWxT[0, :2].any()
    assert (m["r3l/suffix_tokens"], m["r3l/prefix_tokens"]) == (n - a, 2 * a)
    assert np.asarray(ro.rewards_PxW).tolist() == [[-1.0, 1.0, 1.0]]
    assert ro.scores_PxW.tolist() == [[0.0, 1.0, 0.0]] and ro.reward_scores_PxW.tolist() == [[0.0, 1.0, 1.0]]
    assert ro.correct_PxW.tolist() == [[False, True, True]]  # what Positive Amplification reads
    plain = teacher_forced_logp(cfg_m, params, context[: -len(feedback)], tokens[2, a:n].tolist())
    # a difference of two log-probs, each within the log-probs' own tolerance (rtol 1e-4, atol 1e-5) of the forward
    tol = 2 * (1e-5 + 1e-4 * max(np.abs(q).max(), np.abs(plain).max()))
    assert abs(m["r3l/log_ratio_mean"] - float(np.mean(plain - q))) <= tol


def test_without_feedback_the_retry_is_on_policy(tiny, monkeypatch):
    from tests.scorers.test_refiner import teacher_forced_logp

    cfg_m, params, tok = tiny
    src, _ = _source(tiny, "none", monkeypatch)
    ro = src.sample(params, jax.random.key(6), 0)
    a, n = len(tok.encode("a = 12 + 30\n")), int(ro.forest.leaf_length[0, 2])
    tokens, logp = np.asarray(ro.forest.tokens)[0, 2], np.asarray(ro.forest.logprobs)[0, 2]
    context = list(ro.prompts_PxLp[0, : ro.lengths_P[0]]) + tokens[:a].tolist()
    q = teacher_forced_logp(cfg_m, params, context, tokens[a:n].tolist())
    np.testing.assert_allclose(logp[a:n], q, rtol=1e-4, atol=1e-5)
    assert not ro.refined_PxWxT.any() and ro.extra_metrics["r3l/feedback_tokens"] == 0.0


def test_the_refiners_reflection_goes_into_the_feedback(tiny, monkeypatch):
    """feedback = "refiner": the refiner's decoded line fills {reflection}; the context it reads is the question,
    the prefix before the failure point and the wrong step."""
    from treejax.rl.judges.r3l import DEFAULT_FEEDBACK_TEMPLATE
    from treejax.rl.judges.scope import _Rewrite
    from treejax.scorers.refiner import RefinedSpans

    cfg_m, params, tok = tiny
    src, _ = _source(tiny, "refiner", monkeypatch)
    line = tok.encode(" Add again.\n")
    asked = []
    monkeypatch.setattr("treejax.scorers.refiner.refiner_context",
                        lambda refiner, q, prefix, step: asked.append((q, prefix, step)) or [1, 2])
    monkeypatch.setattr("treejax.scorers.refiner.refine", lambda refiner, contexts, key: RefinedSpans(
        np.array([line], np.int32), np.zeros((1, len(line)), np.float32), np.array([len(line)])))
    chosen = [_Rewrite(0, 0, [(0, 6), (6, 10)], 1, "a = 12 + 30\n", "a = 41\n")]
    (ids,) = src.feedback_ids(chosen, ["What is 12 + 30?"], jax.random.key(0))
    assert asked == [("What is 12 + 30?", "a = 12 + 30\n", "a = 41\n")]
    assert ids == tok.encode(DEFAULT_FEEDBACK_TEMPLATE.format(step="a = 41", reflection="Add again. "))


def test_nothing_changes_without_a_located_failure(tiny, monkeypatch):
    cfg_m, params, tok = tiny
    src, _ = _source(tiny, "template", monkeypatch)
    monkeypatch.setattr("treejax.scorers.prm.step_scores", lambda prm, qs, steps: np.array([[0.9, 0.8, 0.7]]))
    ro, ref = src.sample(params, jax.random.key(5), 0), _rollouts(tok, 32)
    assert ro.extra_metrics["r3l/retried"] == 0 and ro.reward_scores_PxW is None
    for name in ("tokens", "logprobs", "loss_mask", "leaf_length", "leaf_status"):
        np.testing.assert_array_equal(np.asarray(getattr(ro.forest, name)), np.asarray(getattr(ref.forest, name)))
    np.testing.assert_array_equal(np.asarray(ro.rewards_PxW), np.asarray(ref.rewards_PxW))


# ------------------------------------------------------------------------------------- the whole loop
@pytest.mark.slow  # one step of the shipped config through treejax.train.main (tiny model as policy, PRM and
# refiner); the retried row's log-probs, masks, rewards and the amplification are covered by the default tests
# above (test_the_retried_row_from_the_failure_point_with_feedback_out_of_the_row, test_positive_amplification_by_hand)
def test_one_loop_step_of_the_shipped_config(tiny_checkpoint, tmp_path):
    from treejax.testing.runs import run_shipped

    row = run_shipped("efficacy_r3l.gin", tiny_checkpoint, tmp_path / "run", extra=(
        "ScorerConfig.model = 'policy'", "R3LConfig.threshold = 0.99", "R3LConfig.steps = 'segments'",
        "ScorerConfig.batch_size = 4", "R3LConfig.retries_per_prompt = 2", "TreeConfig.init_divergence = 4"))
    assert row["r3l/retried"] >= 1 and row["r3l/suffix_tokens"] >= 1
    assert row["r3l/feedback_tokens"] > 0 and np.isfinite(row["r3l/log_ratio_mean"])
    assert "shaping/r3l_amplify/amplified" in row
