"""SCOPE: the first wrong step, the rewritten row (refiner tokens off-policy with their behaviour log-probs), the
loss's importance weights or mask on them, the config checks."""

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.rl.judges.scope import (SCOPEConfig, SCOPERollouts, assemble_row, choose_rewrites, first_wrong_step,
                                     token_steps)

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


# ------------------------------------------------------------------------------------- the pure pieces
def test_token_steps_end_after_newline_tokens_and_merge_blank_ones():
    # ids 9 = "\n", 8 = "\n\n" (blank span), others words; the step after "\n\n" alone would be blank
    tokens = np.array([1, 2, 9, 8, 3, 4, 9, 5, 0, 0])
    text = {1: "a", 2: "b", 3: "c", 4: "d", 5: "e", 9: "\n", 8: "\n\n"}
    blank = lambda a, b: not "".join(text[int(t)] for t in tokens[a:b]).strip()  # noqa: E731
    newline = lambda t: "\n" in text.get(t, "")  # noqa: E731
    assert token_steps(tokens, 8, "lines", 4, newline, blank) == [(0, 4), (4, 7), (7, 8)]
    assert token_steps(np.array([8, 1, 9]), 3, "lines", 4, newline,
                       lambda a, b: a == 0 and b == 1) == [(0, 3)]  # a blank first step joins the next
    assert token_steps(tokens, 8, "segments", 3, newline, blank) == [(0, 3), (3, 6), (6, 8)]
    assert token_steps(tokens, 0, "lines", 4, newline, blank) == []


def test_first_wrong_step():
    assert first_wrong_step([0.9, 0.7, 0.3, 0.1], 0.5) == 2
    assert first_wrong_step([np.nan, 0.4], 0.5) == 1  # a step the PRM could not score is not wrong
    assert first_wrong_step([0.9, np.nan], 0.5) == -1
    assert first_wrong_step([0.5], 0.5) == -1  # strictly below


def test_choose_rewrites_keeps_the_longest_salvaged_prefixes():
    cands = [(0, 0, 3), (0, 2, 7), (0, 3, 7), (0, 5, 1), (1, 1, 0)]
    assert choose_rewrites(cands, 2) == [(0, 2), (0, 3), (1, 1)]
    assert choose_rewrites(cands, 1) == [(0, 2), (1, 1)]


def test_assemble_row_hand_computed():
    tok, lp, refined, n = assemble_row([11, 12], [-0.1, -0.2], [21, 22, 23], [-1.5, -2.5, -0.5], [31, 32, 33],
                                       [-0.3, -0.4, -0.6], T=7)
    assert tok.tolist() == [11, 12, 21, 22, 23, 31, 32] and n == 7  # the continuation is cut at T
    np.testing.assert_allclose(lp, [-0.1, -0.2, -1.5, -2.5, -0.5, -0.3, -0.4])
    assert refined.tolist() == [0, 0, 1, 1, 1, 0, 0]
    tok, lp, refined, n = assemble_row([], [], [21], [-1.0], [31], [-0.3], T=4)
    assert tok.tolist() == [21, 31, 0, 0] and refined.tolist() == [1, 0, 0, 0] and n == 2 and lp[2:].sum() == 0


# ------------------------------------------------------------------------------------- config checks
@pytest.mark.parametrize("kw,match", [(dict(threshold=1.0), "threshold must be in"),
                                      (dict(rewrites_per_prompt=0), "rewrites_per_prompt must be >= 1"),
                                      (dict(steps="words"), "steps must be one of"),
                                      (dict(correction="drop"), "correction must be one of"),
                                      (dict(prm="smollm2"), "prm must be a ScorerConfig"),
                                      (dict(refiner="policy"), "refiner must be a RefinerConfig")])
def test_stage_errors_are_one_line_with_the_fix(kw, match):
    with pytest.raises(ConfigError, match=match) as e:
        SCOPEConfig(**kw)
    assert "fix:" in str(e.value) and "\n" not in str(e.value)


def test_shipped_config_and_the_chain_checks():
    from treejax import train
    from treejax.scorers.refiner import RefinerConfig

    path = os.path.join(CONFIGS, "efficacy_scope.gin")
    cfg = train.parse([path], [])
    (stage,) = cfg.rollouts
    assert isinstance(stage, SCOPEConfig) and isinstance(stage.refiner, RefinerConfig)
    assert cfg.loss.tis_cap == 2.0 and cfg.old_logp == "trainer" and not cfg.dynamic_sampling
    for bad, match in ((["TreeConfig.branch_factor = 2"], "fix: TreeConfig.branch_factor = 1"),
                       (["LossConfig.tis_cap = None"], "importance correction.*or SCOPEConfig.correction = 'mask'"),
                       (["RunConfig.packed_update = True"], "fix: RunConfig.packed_update = False"),
                       (["SCOPEConfig.rewrites_per_prompt = 17"], "exceeds the 16 leaves"),
                       (["RunConfig.estimator = 'remax'"], "does not supply")):
        with pytest.raises(ConfigError, match=match):
            train.parse([path], bad)
    masked = train.parse([path], ["LossConfig.tis_cap = None", "RunConfig.old_logp = 'sampler'",
                                  "SCOPEConfig.correction = 'mask'"])
    assert masked.rollouts[0].correction == "mask"


def test_the_memory_plan_counts_a_refiner_once_when_it_is_the_prm():
    from treejax import train
    from treejax.memory_plan import scorer_configs

    path = os.path.join(CONFIGS, "efficacy_scope.gin")
    assert len(scorer_configs(train.parse([path], []))) == 1  # refiner = PRM's model and dtype: one copy
    two = train.parse([path], ["RefinerConfig.compute_dtype = 'bfloat16'"])
    assert [type(c).__name__ for c in scorer_configs(two)] == ["ScorerConfig", "RefinerConfig"]


# ------------------------------------------------------------------------------------- the rewritten row
@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    from treejax.models import transformer
    from treejax.models.registry import load_model

    cfg_m, params, tok = load_model(tiny_checkpoint, param_dtype="float32", compute_dtype="float32")
    return cfg_m, params, transformer.init_params(cfg_m, jax.random.key(1)), tok  # a refiner unlike the policy


def _rollouts(tok, T):
    """One prompt, two leaves: leaf 0 fails in three lines, leaf 1 is correct; sampler log-probs all -1."""
    from treejax.forest import Forest
    from treejax.rl.rollouts import Rollouts

    ex = types.SimpleNamespace(metadata={"question": "What is 12 + 30?"}, ground_truth="42")
    prompt = tok.encode("What is 12 + 30?\n")
    resp = [tok.encode("a = 12 + 30\na = 41\nAnswer: 41"), tok.encode("Answer: 42")]
    tokens, lengths = np.zeros((1, 2, T), np.int32), np.array([[len(r) for r in resp]], np.int32)
    for w, r in enumerate(resp):
        tokens[0, w, : len(r)] = r
    on = (np.arange(T)[None, None] < lengths[..., None]).astype(np.float32)
    f = Forest(node_parent=jnp.zeros((1, 2), jnp.int32), node_depth=jnp.zeros((1, 2), jnp.int32),
               node_status=jnp.zeros((1, 2), jnp.int32), leaf_path=jnp.zeros((1, 2, 5), jnp.int32),
               leaf_status=jnp.full((1, 2), 3, jnp.int32), leaf_length=jnp.asarray(lengths),
               tokens=jnp.asarray(tokens), logprobs=jnp.asarray(-on), segment_index=jnp.zeros((1, 2, T), jnp.int32),
               loss_mask=jnp.asarray(on), segment_length=8)
    return Rollouts(forest=f, rewards_PxW=jnp.asarray([[-1.0, 1.0]]), scores_PxW=np.array([[0.0, 1.0]], np.float32),
                    prompts_PxLp=np.array([prompt], np.int32), lengths_P=np.array([len(prompt)]), examples=[ex])


def _scope_source(tiny, correction, monkeypatch, T=32):
    from treejax.sampling import strategies, tree
    from treejax.sampling.decode import make_model_fns
    from treejax.scorers.refiner import Refiner, RefinerConfig

    cfg_m, params, ref_params, tok = tiny
    tc = tree.TreeConfig(num_leaves=2, max_depth=4, segment_length=8, branch_factor=1, init_divergence=2,
                         strategy=strategies.Temperature(1.0))
    cfg = types.SimpleNamespace(model="unused", rollout=tc, reward_style="pm1", overlong_buffer=0, overlong_factor=1.0)
    task = types.SimpleNamespace(score=lambda text, ex: 1.0)  # every rewritten response counts as correct
    ctx = types.SimpleNamespace(cfg=cfg, tokenizer=tok, task=task, sampler_fns=make_model_fns(cfg_m), pad_id=0)
    stage = SCOPEConfig(refiner=RefinerConfig(max_new_tokens=4, stop_at_newline=False), rewrites_per_prompt=1,
                        correction=correction)
    base = types.SimpleNamespace(sample=lambda params, key, step: _rollouts(tok, T), pipeline=None)
    src = SCOPERollouts(base, stage, ctx)
    refiner = Refiner(stage.refiner, cfg_m, ref_params, tok)

    def load():  # the PRM's scores are set below; the refiner is a tiny random model unlike the policy
        src.prm, src.refiner = object(), refiner
    monkeypatch.setattr(src, "_load", load)
    monkeypatch.setattr("treejax.scorers.prm.step_scores", lambda prm, qs, steps: np.array([[0.9, 0.3, 0.1]]))
    return src, refiner


def test_the_rewritten_row_carries_behaviour_log_probs_and_is_importance_weighted(tiny, monkeypatch):
    """PRM scores (0.9, 0.3, 0.1): the first wrong step is line 2 ("a = 41"); the row keeps line 1 with its
    sampler log-probs (-1), the refiner's span with log q equal to a direct forward of the refiner, the policy's
    continuation with the policy's teacher-forced log-probs; it replaces leaf 0 with the verifier's reward. In
    the update batch its span's sampler_logp is log q, so truncated IS weighs each span token by
    min(pi / q, 2), as a replayed row's tokens."""
    from treejax.rl.batch import forest_to_batch
    from treejax.rl.losses import LossConfig, policy_loss
    from treejax.sampling.decode import score_tokens
    from treejax.scorers.refiner import refiner_context
    from tests.scorers.test_refiner import teacher_forced_logp

    cfg_m, params, ref_params, tok = tiny
    src, refiner = _scope_source(tiny, "is", monkeypatch)
    ro = src.sample(params, jax.random.key(5), 0)
    m = ro.extra_metrics
    assert (m["scope/failed"], m["scope/located"], m["scope/rewritten"], m["scope/salvaged"]) == (1, 1, 1, 1)
    assert m["scope/first_step_mean"] == 1.0
    a = len(tok.encode("a = 12 + 30\n"))
    f = ro.forest
    tokens, logp, n = np.asarray(f.tokens)[0, 0], np.asarray(f.logprobs)[0, 0], int(f.leaf_length[0, 0])
    refined = ro.refined_PxWxT[0, 0]
    span = np.flatnonzero(refined)
    assert span[0] == a and len(span) == m["scope/refined_tokens"] and 1 <= len(span) <= 4
    assert refined.sum() == refined[span].sum() and not ro.refined_PxWxT[0, 1].any()
    np.testing.assert_array_equal(tokens[:a], tok.encode("a = 12 + 30\n"))
    np.testing.assert_allclose(logp[:a], -1.0)  # the policy's own prefix keeps its sampler log-probs
    ctx = refiner_context(refiner, "What is 12 + 30?", "a = 12 + 30\n", "a = 41\n")
    q = teacher_forced_logp(cfg_m, ref_params, ctx, tokens[span].tolist())
    np.testing.assert_allclose(logp[span], q, rtol=1e-4, atol=1e-5)
    b = span[-1] + 1
    pi = np.asarray(score_tokens(params, src.ctx.sampler_fns, ro.prompts_PxLp, ro.lengths_P, tokens[None], [n]))[0]
    np.testing.assert_allclose(logp[b:n], pi[b:n], rtol=1e-4, atol=1e-5)  # the continuation is the policy's
    assert np.asarray(ro.rewards_PxW).tolist() == [[1.0, 1.0]] and ro.scores_PxW.tolist() == [[0.0, 1.0]]
    assert np.asarray(f.loss_mask)[0, 0, :n].all() and not np.asarray(f.loss_mask)[0, 0, n:].any()
    np.testing.assert_allclose(m["scope/log_ratio_mean"], np.mean(pi[span] - q), rtol=1e-4, atol=1e-5)

    batch = forest_to_batch(jnp.asarray(ro.prompts_PxLp), jnp.asarray(ro.lengths_P), f, jnp.ones(f.tokens.shape))
    Lp = int(ro.lengths_P[0])
    np.testing.assert_allclose(np.asarray(batch["sampler_logp"])[0, Lp + span], q, rtol=1e-4, atol=1e-5)
    old = jnp.asarray(batch["sampler_logp"]).at[0, Lp:Lp + n].set(pi[:n])  # the trainer's pi_prox of row 0
    mask = jnp.asarray(batch["loss_mask"]).at[1].set(0.0)
    loss, _ = policy_loss(old, old, batch["advantages"], mask, LossConfig(aggregation="token-mean", tis_cap=2.0),
                          sampler_logp=batch["sampler_logp"])
    # by hand: pi / q on the span; on the policy's continuation pi / pi_sampler (1 up to the sampler's numerics,
    # checked above on the log-probs); on the prefix pi / e^-1 (its stand-in sampler log-probs), capped at 2
    w = np.minimum(np.exp(pi[:n] - logp[:n]), 2.0)
    np.testing.assert_allclose(float(loss), -w.mean(), rtol=1e-4)
    assert np.abs(w[span] - 1.0).max() > 0.05  # the refiner is not the policy: its tokens are re-weighted


def test_mask_correction_keeps_the_refiners_tokens_out_of_the_loss(tiny, monkeypatch):
    cfg_m, params, _, tok = tiny
    src, _ = _scope_source(tiny, "mask", monkeypatch)
    ro = src.sample(params, jax.random.key(5), 0)
    refined, mask = ro.refined_PxWxT[0, 0], np.asarray(ro.forest.loss_mask)[0, 0]
    n = int(ro.forest.leaf_length[0, 0])
    assert refined.any() and not mask[refined > 0].any()
    np.testing.assert_array_equal(mask[:n], 1.0 - refined[:n])  # the policy's own tokens stay in the loss


def test_nothing_changes_without_a_located_error(tiny, monkeypatch):
    """No PRM step below the threshold: the chain's rollouts pass unchanged (nothing rewritten, no refiner call)."""
    cfg_m, params, _, tok = tiny
    src, _ = _scope_source(tiny, "is", monkeypatch)
    monkeypatch.setattr("treejax.scorers.prm.step_scores", lambda prm, qs, steps: np.array([[0.9, 0.8, 0.7]]))
    monkeypatch.setattr("treejax.scorers.refiner.refine", lambda *a: pytest.fail("the refiner ran"))
    ro, ref = src.sample(params, jax.random.key(5), 0), _rollouts(tok, 32)
    assert ro.extra_metrics["scope/rewritten"] == 0 and ro.extra_metrics["scope/located"] == 0
    for name in ("tokens", "logprobs", "loss_mask", "leaf_length", "leaf_status"):
        np.testing.assert_array_equal(np.asarray(getattr(ro.forest, name)), np.asarray(getattr(ref.forest, name)))
    np.testing.assert_array_equal(np.asarray(ro.rewards_PxW), np.asarray(ref.rewards_PxW))


# ------------------------------------------------------------------------------------- the whole loop
@pytest.mark.slow  # one step of the shipped config through treejax.train.main (88 s on 2 shared cores; tiny model as
# policy, PRM and refiner);
# the rewritten row's log-probs, weights and mask are covered by the default tests above
def test_one_loop_step_of_the_shipped_config(tiny_checkpoint, tmp_path):
    from treejax.testing.runs import run_shipped

    row = run_shipped("efficacy_scope.gin", tiny_checkpoint, tmp_path / "run", extra=(
        "ScorerConfig.model = 'policy'", "RefinerConfig.model = 'policy'", "SCOPEConfig.threshold = 0.99",
        "SCOPEConfig.steps = 'segments'", "RefinerConfig.max_new_tokens = 4", "ScorerConfig.batch_size = 4",
        "RefinerConfig.batch_size = 4", "SCOPEConfig.rewrites_per_prompt = 2", "TreeConfig.init_divergence = 4"))
    assert row["scope/rewritten"] >= 1
    assert row["scope/refined_tokens"] >= 1 and np.isfinite(row["scope/log_ratio_mean"])
