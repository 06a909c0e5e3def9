"""Shapers (treejax.rl.shaping), the DECS estimator and the trainer-pass statistics, each against a slow NumPy
reference written from the method's formula on hand-made inputs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.rl.shaping import (EchoShaping, EntropyAdvantageReshaping, ProcessRewardShaping, RoseLengthPenalty,
                                ShapingInputs, apply_shapers, check_shapers, needed_stats)

P, W, X, K = 2, 4, 12, 5


def _inputs(seed=0, **over):
    """Hand-made pairs in response layout ``[P, W, X]``: leaves of lengths ``lengths``."""
    rng = np.random.default_rng(seed)
    lengths = np.array([[3, 7, 5, 9], [4, 4, 8, 2]], np.int32)
    r = np.arange(X)[None, None, :]
    resp = (r >= 0) & (r < lengths[:, :, None])
    mask = resp & (r >= 1)  # a sub-mask of the response (the shapers take any)
    mask[1, 3] = False  # a leaf without trained tokens
    adv = np.where(mask, rng.normal(size=(P, W, X)), 0.0).astype(np.float32)
    topk = -np.sort(rng.exponential(size=(P, W, X, K)) * 2.0, axis=-1).astype(np.float32)
    topk = topk - np.log(np.exp(topk).sum(-1, keepdims=True) + 0.5)  # a valid distribution's top-k (mass < 1)
    base = dict(
        advantages=adv, loss_mask=mask.astype(np.float32), response_index=np.broadcast_to(np.where(r >= 0, r, -1), (P, W, X)).astype(np.int32),
        old_logp=np.where(mask, -rng.exponential(size=(P, W, X)), 0.0).astype(np.float32),
        rewards=np.array([[1, -1, 1, 1], [-1, 1, 1, -1]], np.float32),
        scores=np.array([[1, 0, 1, 1], [0, 1, 1, 0]], np.float32), leaf_length=lengths,
        eps_scale=np.ones((P, W), np.float32),
        leaf_path=np.array([[[0, 1, 3, -1], [0, 2, 5, 6], [0, 1, 4, -1], [0, 1, 3, 7]],
                            [[0, 1, -1, -1], [0, 2, -1, -1], [0, 2, 3, 4], [0, 1, -1, -1]]], np.int32),
        entropy=np.where(mask, rng.exponential(size=(P, W, X)), 0.0).astype(np.float32),
        topk_logp=topk, ref_logp=np.where(mask, -rng.exponential(size=(P, W, X)), 0.0).astype(np.float32))
    base.update(over)
    return ShapingInputs(**{k: jnp.asarray(v) for k, v in base.items() if k != "response_index"},
                         segment_length=2), base


def _run(shaper, x):
    adv, eps, metrics, _ = apply_shapers((shaper,), x)
    return np.asarray(adv).reshape(P, W, -1), np.asarray(eps).reshape(P, W), metrics


def _whiten_ref(x, on):
    v = x[on]
    return np.where(on, (x - v.mean()) / math.sqrt(v.var(ddof=1) + 1e-8), 0.0)


@pytest.mark.parametrize("add_coef", [0.0, 0.3])
@pytest.mark.parametrize("confidence", ["topk_prob", "sampled_prob"])
def test_echo_matches_reference(add_coef, confidence):
    x, b = _inputs()
    shaper = EchoShaping(add_coef=add_coef, confidence=confidence)
    adv, eps_scale, _ = _run(shaper, x)
    on = b["loss_mask"] > 0
    c = np.exp(b["topk_logp"]).mean(-1) if confidence == "topk_prob" else np.exp(b["old_logp"])
    c = np.where(on, np.clip(c, 0, 1), 0.0)
    s = np.where(on, np.clip(_whiten_ref(b["entropy"], on) + _whiten_ref(1 - c, on), -2, 2), 0.0)
    want = b["advantages"] * (1 + 0.1 * s)
    for p in range(P):
        gs = s[p][on[p]].mean()
        want[p] += add_coef * (s[p] - gs)
    want = np.where(on, want, 0.0)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
    for p in range(P):
        for w in range(W):
            idx = np.nonzero(on[p, w])[0][-16:]
            tail = np.clip(c[p, w, idx].mean(), 0, 1) if len(idx) else 0.0
            eps = 0.05 + 0.15 / (1 + math.exp(-4 * (1 - tail)))
            assert eps_scale[p, w] == pytest.approx(eps / 0.2, rel=1e-5)


def test_echo_tail_window_takes_the_last_trained_tokens():
    x, b = _inputs()
    _, eps_scale, _ = _run(EchoShaping(shaping=False, tail_window=2, confidence="sampled_prob"), x)
    on = b["loss_mask"] > 0
    idx = np.nonzero(on[0, 3])[0][-2:]
    tail = np.exp(b["old_logp"][0, 3, idx]).mean()
    assert eps_scale[0, 3] == pytest.approx((0.05 + 0.15 / (1 + math.exp(-4 * (1 - tail)))) / 0.2, rel=1e-5)


@pytest.mark.parametrize("y_min", [0.0, -np.inf])
def test_ear_matches_reference(y_min):
    x, b = _inputs()
    adv, _, metrics = _run(EntropyAdvantageReshaping(y_min=y_min), x)
    on = b["loss_mask"] > 0
    want = np.zeros_like(adv)
    for p in range(P):
        leaves = [w for w in range(W) if on[p, w].any()]
        h = {w: b["entropy"][p, w][on[p, w]].mean() for w in leaves}
        hbar = np.mean(list(h.values()))
        for w in leaves:
            y = np.clip(2 - h[w] / hbar, y_min, 2.0)
            want[p, w] = np.where(on[p, w], b["advantages"][p, w] * y, 0)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
    assert float(metrics["shaping/ear/scale_min"]) >= (y_min if np.isfinite(y_min) else -np.inf)


def test_ear_clip_mode():
    x, b = _inputs(advantages=np.full((P, W, X), 3.0, np.float32))
    adv, _, _ = _run(EntropyAdvantageReshaping(mode="clip"), x)
    np.testing.assert_array_equal(adv, np.where(b["loss_mask"] > 0, 2.0, 0.0))


@pytest.mark.parametrize("lam", [1.0, 0.5])
def test_rose_length_penalty_matches_reference(lam):
    x, b = _inputs(seed=1)
    adv, _, _ = _run(RoseLengthPenalty(lam=lam), x)
    on, S = b["loss_mask"] > 0, 2
    want = b["advantages"].copy()
    for p in range(P):
        ok = [w for w in range(W) if b["scores"][p, w] >= 1 and on[p, w].any()]
        if not ok:
            continue
        Ls = min(b["leaf_length"][p, w] for w in ok)
        s = [w for w in ok if b["leaf_length"][p, w] == Ls][0]
        for w in ok:
            Lb = b["leaf_length"][p, w]
            if Lb <= Ls:
                continue
            shared = sum(1 for d in range(1, 4) if b["leaf_path"][p, w, d] == b["leaf_path"][p, s, d] >= 0)
            kc = min(shared * S, Ls)
            phi = 1 - ((Ls - kc) / (Lb - kc)) ** lam
            for t in range(X):
                if on[p, w, t] and b["response_index"][p, w, t] >= kc:
                    want[p, w, t] -= abs(want[p, w, t]) * phi
    np.testing.assert_allclose(adv, np.where(on, want, 0), rtol=1e-5, atol=1e-6)
    assert not np.allclose(adv, b["advantages"])  # the hand-made case has penalised leaves


@pytest.mark.parametrize("step_length", [None, 3])
def test_prl_matches_reference(step_length):
    x, b = _inputs()
    adv, _, _ = _run(ProcessRewardShaping(eta=5.0, step_length=step_length), x)
    on = b["loss_mask"] > 0
    S = step_length or 2
    want = np.zeros_like(adv)
    for p in range(P):
        for w in range(W):
            L = b["leaf_length"][p, w]
            d = {b["response_index"][p, w, j]: (b["old_logp"] - b["ref_logp"])[p, w, j] if on[p, w, j] else 0.0
                 for j in range(X) if b["response_index"][p, w, j] >= 0}
            for j in range(X):
                if not on[p, w, j]:
                    continue
                t = b["response_index"][p, w, j]
                e = min((t // S + 1) * S - 1, L - 1)
                to_go = sum(v for u, v in d.items() if u >= e)
                want[p, w, j] = b["advantages"][p, w, j] - to_go / 5.0
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)


def test_shapers_compose_in_order_and_declare_their_needs():
    x, b = _inputs()
    both = (EntropyAdvantageReshaping(), EchoShaping(add_coef=0.2))
    adv, eps, metrics, _ = apply_shapers(both, x)
    a1, e1, _, _ = apply_shapers(both[:1], x)
    x2 = x.replace(advantages=jnp.asarray(a1).reshape(P, W, X), eps_scale=jnp.asarray(e1).reshape(P, W))
    a2, e2, _, _ = apply_shapers(both[1:], x2)
    np.testing.assert_array_equal(np.asarray(adv), np.asarray(a2))
    np.testing.assert_array_equal(np.asarray(eps), np.asarray(e2))
    assert "shaping/ear/scale_mean" in metrics and "shaping/echo/eps_mean" in metrics
    assert needed_stats(both) == (("entropy", "topk"), 5)
    assert needed_stats((ProcessRewardShaping(),)) == (("ref_logp",), 0)
    with pytest.raises(ValueError, match="Shaper instances"):
        check_shapers(["echo"])
    with pytest.raises(ValueError, match="does nothing"):
        EchoShaping(shaping=False, adaptive_clip=False)


# ------------------------------------------------------------------------------------------------- DECS
def test_decs_matches_reference():
    from treejax.forest import Forest
    from treejax.rl.advantages import estimator_spec

    T = 8
    lengths = np.array([[6, 8, 3, 8]], np.int32)
    rewards = np.array([[1.0, 1.0, 0.0, 1.0]], np.float32)
    answer = np.array([[2, -1, -1, 8]], np.int32)  # leaf 0 reached its answer at token 2; leaf 3 only at its end
    mask = (np.arange(T)[None, None] < lengths[:, :, None]).astype(np.float32)
    forest = Forest(node_parent=jnp.zeros((1, 4), jnp.int32), node_depth=jnp.zeros((1, 4), jnp.int32),
                    node_status=jnp.zeros((1, 4), jnp.int32), leaf_path=jnp.zeros((1, 4, 2), jnp.int32),
                    leaf_status=jnp.zeros((1, 4), jnp.int32), leaf_length=jnp.asarray(lengths),
                    tokens=jnp.zeros((1, 4, T), jnp.int32), logprobs=jnp.zeros((1, 4, T)),
                    segment_index=jnp.zeros((1, 4, T), jnp.int32), loss_mask=jnp.asarray(mask), segment_length=T)
    spec = estimator_spec("decs")
    adv = np.asarray(spec.fn(forest, jnp.asarray(rewards), spec.default_options(),
                             answer_step_PxW=jnp.asarray(answer)).tokens)
    beta = 0.1
    R = np.zeros((1, 4, T))
    for w in range(4):
        for t in range(T):
            red = answer[0, w] >= 0 and answer[0, w] <= t < lengths[0, w]
            R[0, w, t] = rewards[0, w] + beta * (1 - lengths[0, w] / T) if red else rewards[0, w] * (1 + beta)
    want = (R - R.mean(1, keepdims=True)) / (R.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(adv, np.where(mask > 0, want, 0), rtol=1e-5, atol=1e-6)
    assert adv[0, 0, 3] < adv[0, 0, 1]  # redundant tokens of a correct answer lose advantage


def test_answer_steps_finds_the_first_line_with_the_answer():
    from treejax.rl.scoring import answer_steps

    class Tok:  # one character per token id
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(i) for i in ids)

    class Task:
        def answer_reached(self, prefix, example):
            nums = [w for w in prefix.replace("\n", " ").split() if w.isdigit()]
            return bool(nums) and nums[-1] == example

    texts = [["7\nso 12\nyes 12", "12", "3\n4"], ["x\n5", "5\n5\n", "no"]]
    T = max(len(t) for row in texts for t in row)
    tokens = np.zeros((2, 3, T), np.int32)
    lengths = np.zeros((2, 3), np.int32)
    for p, row in enumerate(texts):
        for w, t in enumerate(row):
            tokens[p, w, :len(t)] = [ord(c) for c in t]
            lengths[p, w] = len(t)
    scores = np.array([[1, 1, 0], [1, 1, 0]], np.float32)
    steps = answer_steps(Tok(), Task(), ["12", "5"], tokens, lengths, scores)
    # "7\nso 12\n": the answer is first stated in the line ending at index 8; "12": only at its end (2);
    # wrong leaves: -1; "x\n5": only at the end; "5\n5\n": after the first line (2)
    np.testing.assert_array_equal(steps, [[8, 2, -1], [3, 2, -1]])


# ------------------------------------------------------------------------------------------------- trainer pass
def test_topk_logprobs_match_the_full_softmax():
    from treejax.models import presets, transformer

    c = presets.tiny_config("smollm2-135m", vocab_size=250)
    params = transformer.init_params(c, jax.random.key(0))
    h = jax.random.normal(jax.random.key(1), (2, 3, c.hidden_size))
    want = jax.lax.top_k(jax.nn.log_softmax(transformer.logits(params, c, h), -1), 7)[0]
    for chunk in (40, 64, 250):  # chunks that do and do not divide V, and one chunk
        got = transformer.topk_logprobs(params, c, h, 7, chunk_size=chunk)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)
    with pytest.raises(ValueError, match="k must be"):
        transformer.topk_logprobs(params, c, h, 0)


# ----------------------------------------------------------------------------------------------- stateful shapers
def _er_ref(h):
    """Effective rank from NumPy's SVD of the token-centred matrix (VERL's formula)."""
    if len(h) == 0:
        return 1.0
    s = np.linalg.svd(h - h.mean(0), compute_uv=False)
    p = s / (s.sum() + 1e-8)
    return float(np.exp(-(p * np.log(p + 1e-8)).sum()))


def _channels_ref(h, L, stride, max_window):
    """ER, ERV, ERA of one leaf by loops over the windows (module docstring of treejax.rl.shaping.effrank)."""
    h = np.asarray(h, np.float64)[:L]
    er = _er_ref(h)
    n = min(L, max_window)
    tail = h[L - n:]
    ers = []
    k = 1
    while k * stride < n:
        ers.append(_er_ref(tail[: k * stride + 1]))
        k += 1
    d = [ers[i] - np.mean(ers[:i]) for i in range(1, len(ers))]
    a = [d[i] - d[i - 1] for i in range(1, len(d))]
    return er, (np.mean(d) if d else 0.0), (np.mean(a) if a else 0.0)


@pytest.mark.parametrize("E", [6, 40])  # both Gram forms: tokens <= E and tokens > E
def test_effective_rank_matches_svd(E):
    from treejax.rl.shaping.effrank import effective_rank

    h = np.random.default_rng(0).normal(size=(30, E)).astype(np.float32)
    h[:, 0] *= 5.0  # an uneven spectrum
    on = np.arange(30) < 23
    np.testing.assert_allclose(float(effective_rank(jnp.asarray(h), jnp.asarray(on))), _er_ref(h[:23]), rtol=2e-4)


def test_rank_channels_match_reference():
    from treejax.rl.shaping.effrank import rank_channels

    rng = np.random.default_rng(1)
    T, E = 40, 6
    # a drifting state: the rank grows along the response, so velocity and acceleration are not zero
    h = rng.normal(size=(2, 3, T, E)) * np.linspace(0.1, 1.0, E)[None, None, None, :]
    h = (h + np.cumsum(rng.normal(size=(2, 3, T, E)), axis=2) * 0.3).astype(np.float32)
    L = np.array([[40, 23, 4], [31, 0, 17]], np.int32)
    er, erv, era = (np.asarray(a) for a in rank_channels(jnp.asarray(h), jnp.asarray(L), stride=5, max_window=24))
    for p in range(2):
        for w in range(3):
            want = _channels_ref(h[p, w], L[p, w], 5, 24)
            got = (er[p, w], erv[p, w], era[p, w])
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5, err_msg=str((p, w)))
    assert np.any(np.abs(era) > 1e-3) and np.any(np.abs(erv) > 1e-3)


def test_effective_rank_bonus_matches_reference():
    """Two steps of VERL's bonus: the first only sets the EMA baseline to the batch means; the second adds
    ``min(relu(psi), |A| / kappa)`` on each leaf's last trained token and moves the baseline."""
    from treejax.rl.shaping import EffectiveRankBonus
    from treejax.rl.shaping.effrank import rank_channels

    rng = np.random.default_rng(2)
    T, E = X, 5
    shaper = EffectiveRankBonus(stride=2, max_window=10)
    states = {"verl_rank": shaper.init_state(E)}
    for step in range(2):
        h = rng.normal(size=(P, W, T, E)).astype(np.float32) * rng.uniform(0.2, 2.0, size=(P, W, 1, 1))
        x, b = _inputs(step, hidden=h)
        x = x.replace(hidden=jnp.asarray(h))
        mu = np.asarray(states["verl_rank"]["mu"])
        adv, _, metrics, states = apply_shapers((shaper,), x, states)
        adv = np.asarray(adv).reshape(P, W, -1)
        er, erv, era = (np.asarray(a) for a in rank_channels(jnp.asarray(h), x.leaf_length, 2, 10))
        on = b["loss_mask"] > 0
        leaf_on = on.any(-1)
        m = np.stack([era, erv, er], -1)
        batch = m[leaf_on].mean(0)
        want = b["advantages"].copy()
        if step == 0:
            np.testing.assert_allclose(np.asarray(states["verl_rank"]["mu"]), batch, rtol=1e-5, atol=1e-6)
        else:
            delta = np.clip((m - mu) / (np.abs(mu) + 1e-8), -5, 5)
            lam = 1 / (1 + np.exp(-2.0 * delta[..., 0]))
            psi = lam * np.tanh(delta[..., 2]) + (1 - lam) * np.tanh(delta[..., 1])
            for p in range(P):
                for w in range(W):
                    if leaf_on[p, w]:
                        t = np.nonzero(on[p, w])[0][-1]
                        want[p, w, t] += min(max(psi[p, w], 0.0), abs(want[p, w, t]) / 2.0)
            # ERA is a difference of differences of ranks ~3: its fp32 error is absolute (~1e-7), not relative
            np.testing.assert_allclose(np.asarray(states["verl_rank"]["mu"]), 0.7 * mu + 0.3 * batch, rtol=1e-5,
                                       atol=1e-6)
            assert metrics["shaping/verl_rank/bonus_frac"] > 0
        np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
        assert int(states["verl_rank"]["steps"]) == step + 1


def _signal_inputs(seed):
    """Hidden states whose first coordinate carries the leaf's correctness (plus noise): a head can learn it."""
    rng = np.random.default_rng(seed)
    E = 8
    scores = rng.integers(0, 2, size=(P, W)).astype(np.float32)
    h = rng.normal(size=(P, W, X, E)).astype(np.float32)
    h[..., 0] += 3.0 * (2 * scores[..., None] - 1)
    x, _ = _inputs(seed)
    return x.replace(hidden=jnp.asarray(h), scores=jnp.asarray(scores)), E


def test_quality_head_bce_falls_and_checkpoint_restores_it(tmp_path):
    """ARRoL's head on a fixed synthetic signal: its BCE falls step after step, the advantages pass through, and
    the head with its own Adam state round-trips through a checkpoint of the TrainState (``aux``) exactly."""
    from treejax.checkpoint import Checkpointer, abstract_state_with_shardings
    from treejax.models import presets, transformer
    from treejax.rl.optimizer import OptimizerConfig, make_optimizer
    from treejax.rl.shaping import QualityHead, init_states, probes
    from treejax.rl.train_state import TrainState

    head = QualityHead(learning_rate=0.05, updates=2)
    x0, E = _signal_inputs(0)
    states = init_states((head,), E)
    assert not bool(probes((head,), states)["arrol_head"]["ready"])
    bces = []
    for step in range(6):
        x, _ = _signal_inputs(step % 2)  # a fixed signal: two batches, alternating
        adv, _, metrics, states = apply_shapers((head,), x, states)
        np.testing.assert_array_equal(np.asarray(adv).reshape(x.advantages.shape), np.asarray(x.advantages))
        bces.append(float(metrics["shaping/arrol_head/bce"]))
    assert bces[0] == pytest.approx(np.log(2.0), rel=1e-5)  # zero weights: p = 1/2
    assert bces[-1] < 0.5 * bces[0] and all(b1 < b0 for b0, b1 in zip(bces, bces[1:]))
    # it separates the classes, and through the signal coordinate (the largest weight)
    assert metrics["shaping/arrol_head/p_correct"] > metrics["shaping/arrol_head/p_wrong"] + 0.4
    probe = probes((head,), states)["arrol_head"]
    assert bool(probe["ready"]) and int(np.argmax(np.abs(np.asarray(probe["w"])))) == 0

    cfg = presets.tiny_config("smollm2-135m")
    opt = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    state = TrainState.create(transformer.init_params(cfg, jax.random.key(0)), opt, aux=states)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(3, state, {"rl_step": 3}, force=True)
        ck.wait()
    fresh = TrainState.create(state.params, opt, aux=init_states((head,), E))
    with Checkpointer(tmp_path / "ck") as ck:
        restored, _ = ck.restore(abstract_state_with_shardings(jax.eval_shape(lambda: fresh)))
    for a, b in zip(jax.tree.leaves(restored.aux), jax.tree.leaves(state.aux)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the restored head continues exactly like the saved one
    x, _ = _signal_inputs(0)
    _, _, m1, s1 = apply_shapers((head,), x, restored.aux)
    _, _, m2, s2 = apply_shapers((head,), x, states)
    assert float(m1["shaping/arrol_head/bce"]) == float(m2["shaping/arrol_head/bce"])


def test_stateful_shapers_need_their_state_and_appear_once():
    from treejax.rl.shaping import EffectiveRankBonus, QualityHead

    x, _ = _inputs()
    with pytest.raises(ValueError, match="has no state"):
        apply_shapers((QualityHead(),), x.replace(hidden=jnp.zeros(x.advantages.shape + (4,))))
    with pytest.raises(ValueError, match="each may appear once"):
        check_shapers([EffectiveRankBonus(), EffectiveRankBonus(stride=3)])
    with pytest.raises(ValueError, match="apply_to"):
        EffectiveRankBonus(apply_to="first")


def test_probe_readers_need_the_shaper_that_trains_the_probe():
    """ARRoL's pruning rule and the probe-weighted held-out vote name the quality head; without it the config is a
    one-line ConfigError, and a vote without samples a ValueError."""
    import dataclasses as dc

    from treejax.errors import ConfigError
    from treejax.rl.config import RunConfig
    from treejax.rl.evaluation import EvalConfig
    from treejax.rl.shaping import EffectiveRankBonus, QualityHead
    from treejax.sampling.branching import QualityPrune

    base = RunConfig()
    with pytest.raises(ConfigError, match="QualityHead"):
        RunConfig(rollout=dc.replace(base.rollout, branching=QualityPrune()))
    with pytest.raises(ConfigError, match="vote_probe"):  # VERL is stateful but offers no probe
        RunConfig(shapers=[EffectiveRankBonus()], eval=EvalConfig(k=4, vote_probe="arrol_head"))
    with pytest.raises(ValueError, match="k >= 1"):
        EvalConfig(vote_probe="arrol_head")
    RunConfig(shapers=[QualityHead()], rollout=dc.replace(base.rollout, branching=QualityPrune()),
              eval=EvalConfig(k=4, vote_probe="arrol_head"))
