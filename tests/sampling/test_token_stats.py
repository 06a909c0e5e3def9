"""Per-token rule statistics (treejax.sampling.token_stats) and the rules that read them (ARRoL's pruning by a
quality probe, ROSE's cosine-entropy branching): the channels the decode step writes equal a full forward of each
path's prefix, and each rule's decisions equal a slow reference at every boundary of a real rollout."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.forest import NodeStatus
from treejax.models import presets, transformer
from treejax.sampling import branching as B
from treejax.sampling import decode, probe as probe_lib, token_stats, tree

CFG = presets.tiny_config("smollm2-135m", vocab_size=64)
FNS = decode.make_model_fns(CFG, attention="dense", cache_dtype="float32")  # fp32 KV: exact against a forward
P, W = 2, 6
PROMPTS = np.array([[1, 5, 9, 2, 7], [1, 11, 3, 4, 0]], np.int32)
LENS = np.array([5, 4], np.int32)


def _semantic_ref(logits, embed, k=20):
    """``sum_{i != j} p_i p_j cos(e_i, e_j)`` over the top-k tokens, by the double loop."""
    p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    ids = np.argsort(-logits, kind="stable")[:k]
    e = embed[ids] / np.linalg.norm(embed[ids], axis=-1, keepdims=True)
    return sum(p[ids[i]] * p[ids[j]] * float(e[i] @ e[j]) for i in range(len(ids)) for j in range(len(ids)) if i != j)


def test_semantic_similarity_matches_pairwise_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 2
    embed = rng.normal(size=(50, 8)).astype(np.float32)
    got = np.asarray(token_stats.semantic_similarity(jnp.asarray(logits), jnp.asarray(embed)))
    want = [_semantic_ref(logits[r].astype(np.float64), embed.astype(np.float64)) for r in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="known"):
        token_stats.check_token_stats(["probe", "nope"])


def survivors_reference(p_hat, keep: float, rho: float) -> set[int]:
    """Slow reference of one prompt's survivors (indices into ``p_hat``): ARRoL's rule (module docstring of treejax.sampling.branching.arrol)."""
    n = len(p_hat)
    k = max(math.ceil(keep * n - 1e-6), min(n, 1))
    hi = math.ceil(rho * k - 1e-6)
    order = sorted(range(n), key=lambda i: (-p_hat[i], i))
    return set(order[:hi]) | set(order[n - (k - hi):]) if k - hi > 0 else set(order[:hi])


# ----------------------------------------------------------------------------------------------- recording rule
RECORDS: list = []


def _record(kind, fields, out, total=None):
    RECORDS.append(dict(kind=kind, s={k: np.asarray(v) for k, v in fields.items()}, out=np.asarray(out),
                        total=None if total is None else np.asarray(total)))


@dataclasses.dataclass(frozen=True)
class Recorded(B.BranchingRule):
    inner: B.BranchingRule

    @property
    def token_stats(self):
        return self.inner.token_stats

    @property
    def needs_entropy(self):
        return self.inner.needs_entropy

    @property
    def prunes(self):
        return self.inner.prunes

    @property
    def probe_name(self):
        return getattr(self.inner, "probe_name", None)

    @property
    def rule_name(self):
        return self.inner.rule_name

    def _fields(self, stats):
        return dict(live=stats.live_PxW, depth=stats.depth_PxW, length=stats.length_PxW, tokens=stats.tokens_PxWxT,
                    extra=stats.extra_PxWxTxC, entropy=stats.entropy_PxWxT, start=stats.segment_start_PxW,
                    ready=stats.probe_ready)

    def prune(self, stats):
        out = self.inner.prune(stats)
        jax.debug.callback(functools.partial(_record, "prune"), self._fields(stats), out)
        return out

    def allocate(self, stats, total_P):
        out = self.inner.allocate(stats, total_P)
        jax.debug.callback(functools.partial(_record, "allocate"), self._fields(stats), out, total_P)
        return out


def _semantic_matrix_ref(logits, embed, k=20):
    """:func:`_semantic_ref` for many rows at once, as the masked pairwise sum ``p^T (C - I) p``."""
    out = np.zeros(len(logits))
    for r, z in enumerate(logits):
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        ids = np.argsort(-z, kind="stable")[:k]
        e = embed[ids] / np.linalg.norm(embed[ids], axis=-1, keepdims=True)
        cos = e @ e.T
        np.fill_diagonal(cos, 0.0)
        out[r] = p[ids] @ cos @ p[ids]
    return out


@functools.lru_cache(maxsize=None)
def _jit_forward():
    return jax.jit(lambda params, seq, pos: transformer.forward(params, CFG, seq, pos, jnp.ones_like(seq)))


def _forward_channels(params, probe, prompt, n, tokens, width=32):
    """Probe logit and semantic similarity for each response token ``t`` of a path, from a full forward of
    ``prompt[:n] + tokens`` (right-padded to ``width``; causal, so the padding changes nothing before it): the
    state that sampled token ``t`` sits at position ``n - 1 + t``."""
    seq = np.zeros((1, width), np.int32)
    seq[0, : n + len(tokens)] = np.concatenate([prompt[:n], tokens])
    pos = np.arange(width, dtype=np.int32)[None, :]
    h = _jit_forward()(params, jnp.asarray(seq), jnp.asarray(pos))
    h = np.asarray(h[0, n - 1: n - 1 + len(tokens)], np.float64)
    logits = np.asarray(transformer.logits(params, CFG, jnp.asarray(h, jnp.float32)), np.float64)
    pr = h @ np.asarray(probe["w"], np.float64) + float(probe["b"])
    sem = _semantic_matrix_ref(logits, np.asarray(params["embed"], np.float64))
    return pr, sem


@dataclasses.dataclass(frozen=True)
class _BothChannels(B.QualityPrune):
    token_stats = ("probe", "semantic_similarity")


def test_channels_equal_a_full_forward_and_arrol_prunes_the_middle():
    """A tree rollout with ARRoL's pruning (and both channels on): at every boundary the recorded channels equal a
    full forward of each live path's prefix (fp32 cache), the pruned paths are exactly the reference's middle of
    the ranking, and the forest keeps W leaves with those paths as PRUNED leaves."""
    params = transformer.init_params(CFG, jax.random.key(1))
    w = np.asarray(jax.random.normal(jax.random.key(2), (CFG.hidden_size,)), np.float32)
    probe = {"w": jnp.asarray(w), "b": jnp.float32(0.3), "ready": jnp.asarray(True)}
    rollout = _arrol_rollout()
    RECORDS.clear()
    forest, info = rollout(probe_lib.attach(params, {"arrol_head": probe}), PROMPTS, LENS, jax.random.key(3))
    jax.block_until_ready(forest)
    checked = pruned_total = 0
    for rec in RECORDS:
        s = rec["s"]
        if rec["kind"] == "allocate":
            continue
        assert bool(s["ready"])
        for p in range(P):
            for w_ in range(W):
                if not s["live"][p, w_]:
                    continue
                L = int(s["length"][p, w_])
                pr, sem = _forward_channels(params, probe, PROMPTS[p], LENS[p], s["tokens"][p, w_, :L])
                np.testing.assert_allclose(s["extra"][p, w_, :L, 0], pr, rtol=2e-4, atol=2e-4)
                np.testing.assert_allclose(s["extra"][p, w_, :L, 1], sem, rtol=2e-4, atol=2e-5)
                checked += 1
            cand = s["live"][p] & (s["depth"][p] == 2)
            idx = np.nonzero(cand)[0]
            want = np.zeros(W, bool)
            if len(idx) >= 2:
                score = [s["extra"][p, i, int(s["length"][p, i]) - 1, 0] for i in idx]
                keep = survivors_reference(score, 0.5, 0.5)
                want[[i for j, i in enumerate(idx) if j not in keep]] = True
            np.testing.assert_array_equal(rec["out"][p], want)
            pruned_total += int(want.sum())
    assert checked > 0 and pruned_total > 0
    status = np.asarray(forest.leaf_status)
    assert int(np.sum(status == NodeStatus.PRUNED)) == pruned_total
    assert bool(info.complete) and np.all(np.asarray(forest.leaf_length) > 0)


@functools.lru_cache(maxsize=None)
def _arrol_rollout():
    tc = tree.TreeConfig(num_leaves=W, max_depth=4, segment_length=3, branch_factor=2, stop_ids=(63,),
                         init_divergence=W, branching=Recorded(_BothChannels(prune_depth=2, keep=0.5, rho=0.5)))
    return tree.make_tree_rollout(FNS, tc)


def test_arrol_waits_for_a_trained_probe_and_needs_one():
    params = transformer.init_params(CFG, jax.random.key(1))
    probe = {"w": jnp.ones((CFG.hidden_size,)), "b": jnp.float32(0.0), "ready": jnp.asarray(False)}
    rollout = _arrol_rollout()  # the same program as the test above: readiness is an input, not a recompile
    forest, _ = rollout(probe_lib.attach(params, {"arrol_head": probe}), PROMPTS, LENS, jax.random.key(3))
    assert not np.any(np.asarray(forest.leaf_status) == NodeStatus.PRUNED)
    with pytest.raises(ValueError, match="QualityHead"):
        rollout(params, PROMPTS, LENS, jax.random.key(3))


def _capped_ref(score, cap, live, total, spill=True):
    """One prompt: 1 child per live path, the extra budget down the descending scores (ties: lower index)."""
    n = int(live.sum())
    extra = max(int(total) - n, 0)
    counts = np.where(live, 1, 0)
    for i in sorted(np.nonzero(live)[0], key=lambda i: (-score[i], i)):
        take = min(int(cap[i]), extra)
        counts[i] += take
        extra -= take
    if spill and extra > 0 and n > 0:
        order = np.nonzero(live)[0]
        for j in range(extra):
            counts[order[j % n]] += 1
    return counts


@pytest.mark.parametrize("metric", ["cosine_entropy", pytest.param("cosine", marks=pytest.mark.slow),
                                    pytest.param("entropy", marks=pytest.mark.slow)])
def test_rose_branching_matches_reference(metric):
    params = transformer.init_params(CFG, jax.random.key(4))
    rule = B.RoseBranching(metric=metric)
    tc = tree.TreeConfig(num_leaves=W, max_depth=4, segment_length=3, branch_factor=2, stop_ids=(63,),
                         init_divergence=2, branching=Recorded(rule))
    RECORDS.clear()
    forest, info = tree.make_tree_rollout(FNS, tc)(params, PROMPTS, LENS, jax.random.key(5))
    jax.block_until_ready(forest)
    assert bool(info.complete) and RECORDS
    branched = 0
    for rec in RECORDS:
        s = rec["s"]
        t = np.arange(s["tokens"].shape[-1])
        for p in range(P):
            score = np.full(W, -np.inf)
            for w_ in range(W):
                seg = (t >= s["start"][p, w_]) & (t < s["length"][p, w_])
                f, h = s["extra"][p, w_, :, 0], s["entropy"][p, w_]
                x = {"cosine_entropy": -f * h, "cosine": -f, "entropy": h}[metric]
                if seg.any():
                    score[w_] = x[seg].max()
            live = s["live"][p]
            got = rec["out"][p]
            want = _capped_ref(score, np.full(W, 1), live, int(rec["total"][p]))
            np.testing.assert_array_equal(got, want)
            branched += int((got > 1).sum())
    assert branched > 0


def test_rose_epsilon_root_restarts_are_independent_exact_paths():
    """``epsilon = 1``: every new child restarts at the root, so the forest is W independent chains (no node but the
    root has two children), each path's recorded log-probs equal a full forward of prompt + path (the restarted
    row's KV is exact), and the counter reports the restarts."""
    params = transformer.init_params(CFG, jax.random.key(6))
    tc = tree.TreeConfig(num_leaves=W, max_depth=4, segment_length=3, branch_factor=2, stop_ids=(63,),
                         init_divergence=2, branching=B.RoseBranching(metric="entropy", epsilon=1.0))
    forest, info = tree.make_tree_rollout(FNS, tc)(params, PROMPTS, LENS, jax.random.key(7))
    assert bool(info.complete) and int(info.root_restarts) == P * (W - 2) == int(info.forks)
    parent = np.asarray(forest.node_parent)
    for p in range(P):
        kids = parent[p][parent[p] >= 0]
        assert np.bincount(kids)[1:].max(initial=0) <= 1  # below the root every node has at most one child
        assert np.sum(kids == 0) == W  # W chains from the root
    toks, lp, n = np.asarray(forest.tokens), np.asarray(forest.logprobs), np.asarray(forest.leaf_length)
    for p in range(P):
        for w_ in range(W):
            seq = np.zeros((1, 32), np.int32)
            seq[0, : LENS[p] + n[p, w_]] = np.concatenate([PROMPTS[p, : LENS[p]], toks[p, w_, : n[p, w_]]])
            h = _jit_forward()(params, jnp.asarray(seq), jnp.arange(32, dtype=jnp.int32)[None, :])
            z = np.asarray(transformer.logits(params, CFG, h[0]), np.float64)
            ref = [z[LENS[p] - 1 + t, toks[p, w_, t]] - np.log(np.exp(z[LENS[p] - 1 + t] - z[LENS[p] - 1 + t].max()).sum())
                   - z[LENS[p] - 1 + t].max() for t in range(n[p, w_])]
            np.testing.assert_allclose(lp[p, w_, : n[p, w_]], ref, rtol=1e-4, atol=1e-4)


def test_generate_records_the_probe_and_weighted_votes_follow_it():
    """The linear sampler's ``probe_logits`` equal the probe on a full forward's hidden states (the state that
    sampled each token), and ``maj_at_k`` with weights lets a few heavy votes beat a light majority."""
    from treejax.rl.evaluation import maj_at_k

    params = transformer.init_params(CFG, jax.random.key(8))
    w = np.asarray(jax.random.normal(jax.random.key(9), (CFG.hidden_size,)), np.float32)
    probe = {"w": jnp.asarray(w), "b": jnp.float32(-0.2)}
    out = decode.generate(params, FNS, PROMPTS, LENS, jax.random.key(10), 6, stop_ids=(63,), probe=probe)
    z, n, toks = np.asarray(out.probe_logits), np.asarray(out.lengths), np.asarray(out.tokens)
    for p in range(P):
        pr, _ = _forward_channels(params, probe, PROMPTS[p], LENS[p], toks[p, : n[p]])
        np.testing.assert_allclose(z[p, : n[p]], pr, rtol=2e-4, atol=2e-4)
        assert float(out.last_probe_logit()[p]) == pytest.approx(float(z[p, n[p] - 1]))
    answers, scores = [["1", "1", "2"]], [[0.0, 0.0, 1.0]]
    assert maj_at_k(answers, scores)[0] == 0.0
    assert maj_at_k(answers, scores, [[0.2, 0.3, 0.9]])[0] == 1.0
