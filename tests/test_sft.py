"""treejax-sft (treejax.sft): the NLL and OTR losses and their gradients against NumPy references, OTR's candidate
draws against their distribution, the batch's loss mask, training that lowers the demonstrations' NLL, and the CLI
end to end on a tiny checkpoint."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax import sft
from treejax.errors import ConfigError, DataError


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _data(seed=0, B=2, L=5, V=7):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(B, L, V)).astype(np.float32) * 2
    y = rng.integers(0, V, size=(B, L)).astype(np.int32)
    mask = (rng.uniform(size=(B, L)) < 0.7).astype(np.float32)
    mask[0, 0] = 1.0
    return z, y, mask


def test_otr_exact_expectation_value_and_gradient_match_numpy():
    z, y, mask = _data()
    otr = sft.OTRConfig(samples=0, temperature=1.3, beta=-0.2)
    loss, grad = jax.value_and_grad(lambda x: sft.otr_loss(x, jnp.asarray(y), jnp.asarray(mask), jax.random.key(0),
                                                           otr))(jnp.asarray(z))
    pi, q = _softmax(z.astype(np.float64)), _softmax(z.astype(np.float64) / 1.3)
    R = np.where(np.arange(7)[None, None] == y[..., None], 1.0, -0.2)
    n = mask.sum()
    want = -np.sum(mask * np.sum(q * R * np.log(pi), -1)) / n
    # d/dz of sum_a c_a log pi(a) = c - pi sum_a c_a, with c = q R fixed (no gradient through q)
    c = q * R
    want_grad = -(mask[..., None] * (c - pi * c.sum(-1, keepdims=True))) / n
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)


def test_otr_sampled_loss_matches_its_candidates_and_converges_to_the_expectation():
    z, y, mask = _data(1)
    key = jax.random.key(3)
    otr = sft.OTRConfig(samples=64, temperature=1.2, beta=-0.1)
    loss = float(sft.otr_loss(jnp.asarray(z), jnp.asarray(y), jnp.asarray(mask), key, otr))
    a = np.asarray(sft.otr_candidates(key, jnp.asarray(z), 64, 1.2))
    logp = np.log(_softmax(z.astype(np.float64)))
    R = np.where(a == y[..., None], 1.0, -0.1)
    want = -np.sum(mask * np.mean(R * np.take_along_axis(logp, a, -1), -1)) / mask.sum()
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    # the draws follow softmax(z / tau): frequencies over 40,000 draws per position within 5 standard errors
    many = np.asarray(sft.otr_candidates(jax.random.key(4), jnp.asarray(z[:1, :2]), 40_000, 1.2))
    q = _softmax(z[:1, :2].astype(np.float64) / 1.2)
    freq = np.stack([[np.bincount(many[0, t], minlength=7) / 40_000 for t in range(2)]])
    assert np.all(np.abs(freq - q) <= 5 * np.sqrt(q * (1 - q) / 40_000) + 1e-9)


def test_nll_loss_matches_numpy():
    z, y, mask = _data(2)
    logp = np.log(_softmax(z.astype(np.float64)))
    want = -np.sum(mask * np.take_along_axis(logp, y[..., None], -1)[..., 0]) / mask.sum()
    np.testing.assert_allclose(float(sft.nll_loss(jnp.asarray(z), jnp.asarray(y), jnp.asarray(mask))), want, rtol=1e-5)


class _CharTokenizer:
    eos_ids = (1,)
    pad_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
        return "".join(m["content"] for m in messages) + "|"


class _Task:
    def make_example(self, record):
        from treejax.data.task_base import Example

        return Example(prompt_messages=[{"role": "user", "content": record["question"]}],
                       ground_truth=record["answer"], metadata={})


def test_batch_masks_exactly_the_demonstration_and_its_eos(monkeypatch):
    from treejax.data import prompts

    monkeypatch.setattr(prompts, "format_prompt", lambda tok, msgs, **kw: tok.apply_chat_template(msgs))
    recs = [{"uid": "a", "question": "1+2", "answer": "3", "metadata": "{\"hint\": \"add\"}"},
            {"uid": "b", "question": "10+20", "answer": "30", "metadata": "{}"}]
    cfg = sft.SFTConfig(demonstration="A:{answer}")
    tokens, targets, mask = sft.sft_batch(_CharTokenizer(), _Task(), recs, cfg, pad_id=0)
    for i, (prompt, demo) in enumerate([("1+2|", "A:3"), ("10+20|", "A:30")]):
        row = [ord(c) for c in prompt + demo] + [1]
        assert tokens[i, :len(row)].tolist() == row and not tokens[i, len(row):].any()
        on = np.nonzero(mask[i])[0]
        assert on.tolist() == list(range(len(prompt) - 1, len(row) - 1))  # predicts the demo and the EOS
        assert targets[i, on].tolist() == row[len(prompt):]
    assert sft.demonstration_text("{hint}: {answer}", recs[0]) == "add: 3"
    with pytest.raises(DataError, match="hint"):
        sft.demonstration_text("{hint}", recs[1])
    with pytest.raises(DataError, match="max_demo_tokens"):
        sft.sft_batch(_CharTokenizer(), _Task(), recs, sft.SFTConfig(demonstration="A:{answer}", max_demo_tokens=3), 0)


def test_config_checks():
    with pytest.raises(ValueError, match="objective"):
        sft.SFTConfig(objective="dpo")
    with pytest.raises(ConfigError, match="format string"):
        sft.SFTConfig(demonstration="{answer")
    with pytest.raises(ValueError, match="temperature"):
        sft.OTRConfig(temperature=0.0)


@pytest.mark.parametrize("objective", ["nll", "otr"])
def test_steps_lower_the_demonstrations_nll(objective):
    from treejax.models import presets, transformer
    from treejax.rl.optimizer import OptimizerConfig, make_optimizer

    mc = presets.tiny_config("smollm2-135m", vocab_size=64)
    params = transformer.init_params(mc, jax.random.key(0))
    cfg = sft.SFTConfig(objective=objective, otr=sft.OTRConfig(samples=16, temperature=1.2, beta=-0.1))
    opt = make_optimizer(OptimizerConfig(learning_rate=3e-3, warmup_steps=0, total_steps=20, weight_decay=0.0))
    step = sft.make_sft_step(mc, cfg, opt)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(2, 64, size=(4, 16)), jnp.int32)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((4, 1), jnp.int32)], 1)
    mask = jnp.asarray((np.arange(16)[None] >= 5) & (np.arange(16)[None] < 15), jnp.float32).repeat(4, 0)
    state = opt.init(params)
    nll = []
    for i in range(8):
        params, state, m = step(params, state, tokens, targets, mask, jax.random.key(i))
        nll.append(float(m["sft/nll"]))
    assert nll[-1] < nll[0] - 0.1, nll


def test_cli_runs_and_writes_a_summary(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "sft"
    summary = sft.main(["--quiet", "--gin_param", f"SFTConfig.model = '{tiny_checkpoint}'",
                        "--gin_param", f"SFTConfig.log_dir = '{out}'", "--gin_param", "SFTConfig.num_steps = 2",
                        "--gin_param", "SFTConfig.batch_size = 4", "--gin_param", "SFTConfig.objective = 'otr'",
                        "--gin_param", "SFTConfig.otr = @OTRConfig()", "--gin_param", "OTRConfig.samples = 8",
                        "--gin_param", "SFTConfig.eval = @EvalConfig()", "--gin_param", "EvalConfig.num_problems = 4",
                        "--gin_param", "EvalConfig.max_new_tokens = 4", "--gin_param", "SFTConfig.export_hf = True",
                        "--gin_param", "SFTConfig.demonstration = 'Answer: {answer}'"])
    assert [h["step"] for h in summary["history"]] == [1, 2]
    assert all(np.isfinite(h["sft/loss"]) and h["sft/tokens"] > 0 for h in summary["history"])
    assert json.load(open(out / "summary.json"))["objective"] == "otr"
    assert os.path.isfile(out / "hf_export" / "config.json")
    assert "held-out greedy accuracy" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # a user error is one line, status 2
        sft.console_main(["--gin_param", "SFTConfig.objective = 'dpo'"])
    assert e.value.code == 2
