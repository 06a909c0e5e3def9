"""Trees of turns (treejax.sampling.multiturn.run_turn_trees): a fork copies the KV row and the environment, so every
branch continues independently and exactly (each slot's log-probs equal a full forward of its whole conversation,
each branch's observations equal those of a fresh environment replaying its own actions); independent roots draw
exactly what one-row-per-episode decoding draws; the slots split as the config says; the turn forest's spans,
masks and weights."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from treejax.envs.base import StepResult
from treejax.forest import NodeStatus
from treejax.models import presets, transformer
from treejax.sampling import decode
from treejax.sampling.multiturn import TurnLimits, TurnTreeConfig, run_episodes, run_turn_trees, turn_forest
from treejax.sampling.strategies import Temperature
from treejax.testing.references import full_forward_logp
from treejax.testing.tokenizers import CharTokenizer as _Tok

CFG = presets.tiny_config("smollm2-135m", vocab_size=64)
FNS = decode.make_model_fns(CFG, attention="dense", cache_dtype="float32")
LIMITS = TurnLimits(max_turns=4, turn_tokens=10, max_tokens=96, chunk=4)


class _Counter:
    """Its observation depends on every action so far (the total length of the actions, as digits), so a clone
    that shared state with its parent would answer a branch wrongly. Turns end on '5' or '7'; done after
    ``turns`` turns with reward = the total length mod 2."""

    stop_strings = ("5", "7")

    def __init__(self, turns=3):
        self.turns, self.actions = turns, []

    def reset(self, example):
        self.actions = []
        return "go"

    def step(self, action):
        self.actions.append(action)
        total = sum(len(a) for a in self.actions)
        done = len(self.actions) >= self.turns
        return StepResult(f"n{total}", float(total % 2) if done else 0.0, done, {"total": total})

    def clone(self):
        c = _Counter(self.turns)
        c.actions = list(self.actions)
        return c


@pytest.fixture(scope="module")
def params():
    return transformer.init_params(CFG, jax.random.key(7))


_REF_WIDTH = 104  # a 4-token prompt + a conversation's max_tokens = 96


def _full_logp(params, seq):
    """One full forward's log-probs over ``seq`` (padded to ``_REF_WIDTH``: one program for every length)."""
    return full_forward_logp(params, CFG, seq, _REF_WIDTH)


PROMPTS = np.array([[1, 2, 3, 4], [1, 9, 0, 0]], np.int32)
LENS = np.array([4, 2], np.int32)


def test_forks_copy_the_kv_and_the_environment(params, monkeypatch):
    from treejax.sampling.turns import stages

    appended = []  # (rows in the append program, rows with an observation) per call

    def recording_append(params, cache, rows, pending, position, tokens, length, *, model):
        appended.append((int(rows.shape[0]), int((np.asarray(length) > 0).sum())))
        return original(params, cache, rows, pending, position, tokens, length, model=model)

    original = stages._append
    monkeypatch.setattr(stages, "_append", recording_append)
    tok = _Tok()
    tree_cfg = TurnTreeConfig(num_slots=6, roots=2, branch_factor=2, fork_turns=2)
    trees = run_turn_trees(params, FNS, tok, lambda p: _Counter(3), ["x", "y"], PROMPTS, LENS, jax.random.key(3),
                           Temperature(1.0), LIMITS, tree_cfg, stop_ids=(63,))
    assert sum(t.forks for t in trees) > 0
    # the append program's row count is a power of two (or all 12 rows), whatever the count of rows appending: a
    # few programs, not one per count (rows given no tokens are unchanged: the exactness checks below hold)
    assert len({real for _, real in appended}) > 1, appended
    assert all(n == 12 or n & (n - 1) == 0 for n, _ in appended) and all(r <= n for n, r in appended), appended
    for p, t in enumerate(trees):
        children = {}
        for n, node in enumerate(t.nodes[1:], start=1):
            children.setdefault(node.parent, []).append(n)
            assert node.depth == t.nodes[node.parent].depth + 1 and node.end > node.start
            assert node.start == t.nodes[node.parent].end or node.parent == 0
        assert len(children[0]) == 2  # the two roots
        assert all(len(c) <= 2 for c in children.values())
        for w, (sp, ep) in enumerate(zip(t.slot_path, t.slot_episode)):
            assert sp[0] == 0 and t.nodes[sp[-1]].end == len(ep.tokens)
            # the KV fork is exact: every sampled token's log-prob is the full forward's over the conversation
            seq = list(PROMPTS[p, :LENS[p]]) + ep.tokens
            full = _full_logp(params, seq)
            for i, (tk, lp, pol) in enumerate(zip(ep.tokens, ep.logprobs, ep.policy_mask)):
                if pol:
                    np.testing.assert_allclose(lp, full[LENS[p] - 1 + i, tk], atol=1e-4)
            # the environment fork is independent: a fresh environment replaying this branch's actions answers
            # exactly what the branch saw
            env = _Counter(3)
            env.reset("x")
            policy_turns = [(a, b) for a, b, k in ep.turns if k == "policy"]
            env_turns = [(a, b) for a, b, k in ep.turns if k == "env"][1:]  # after the reset's
            for i, (a, b) in enumerate(policy_turns):
                r = env.step(tok.decode(ep.tokens[a:b]))
                if i < len(env_turns):
                    assert tok.decode(ep.tokens[slice(*env_turns[i])]) == r.observation
                assert r.reward == ep.rewards[i]
        # slots: each root owns 3; shared nodes hold identical tokens on every slot through them
        assert sorted({sp[1] for sp in t.slot_path}) == children[0]
        assert [sum(sp[1] == c for sp in t.slot_path) for c in children[0]] == [3, 3]


@pytest.mark.slow
def test_independent_roots_draw_what_one_row_per_episode_draws(params):
    W = 3
    trees = run_turn_trees(params, FNS, _Tok(), lambda p: _Counter(2), ["x", "y"], PROMPTS, LENS, jax.random.key(4),
                           Temperature(1.0), LIMITS, TurnTreeConfig(num_slots=W, roots=W), stop_ids=(63,))
    eps = run_episodes(params, FNS, _Tok(), [_Counter(2) for _ in range(2 * W)], ["x"] * W + ["y"] * W,
                       np.repeat(PROMPTS, W, 0), np.repeat(LENS, W), jax.random.key(4), Temperature(1.0), LIMITS,
                       stop_ids=(63,))
    for p, t in enumerate(trees):
        assert t.forks == 0 and len(t.nodes) - 1 == sum(len(sp) - 1 for sp in t.slot_path)
        for w in range(W):
            assert t.slot_episode[w].tokens == eps[p * W + w].tokens
            assert t.slot_episode[w].rewards == eps[p * W + w].rewards


def test_turn_forest_spans_masks_and_weights(params):
    tok = _Tok()
    trees = run_turn_trees(params, FNS, tok, lambda p: _Counter(3), ["x", "y"], PROMPTS, LENS, jax.random.key(5),
                           Temperature(1.0), LIMITS, TurnTreeConfig(num_slots=4, roots=1, branch_factor=2,
                                                                    fork_turns=2), stop_ids=(63,))
    f = turn_forest(trees, LIMITS.max_tokens)
    assert not f.fixed_segments and f.tokens.shape == (2, 4, LIMITS.max_tokens)
    np.testing.assert_array_equal(np.asarray(f.leaf_weights()), 1.0)
    spans, nodes = np.asarray(f.spans()), np.asarray(f.token_nodes())
    for p, t in enumerate(trees):
        for w, ep in enumerate(t.slot_episode):
            k = len(ep.tokens)
            assert int(f.leaf_length[p, w]) == k
            np.testing.assert_array_equal(np.asarray(f.tokens[p, w, :k]), ep.tokens)
            np.testing.assert_array_equal(np.asarray(f.loss_mask[p, w, :k]), np.asarray(ep.policy_mask, np.float32))
            np.testing.assert_array_equal(np.asarray(f.loss_mask[p, w, k:]), 0.0)
            for n in t.slot_path[w][1:]:
                a, L = spans[p, n]
                assert (a, a + L) == (t.nodes[n].start, t.nodes[n].end)
                assert np.all(nodes[p, w, a:a + L] == n)
            assert int(f.leaf_status[p, w]) == int(NodeStatus.EOS if ep.status == "done" else NodeStatus.TRUNCATED)


@pytest.mark.slow
def test_fork_rule_and_bad_input(params):
    calls = []

    def rule(reqs):
        calls.extend((r.prompt, r.episode.policy_turns, r.slots) for r in reqs)
        return [1] * len(reqs)  # never branch: one path holds all the slots

    trees = run_turn_trees(params, FNS, _Tok(), lambda p: _Counter(2), ["x"], PROMPTS[:1], LENS[:1],
                           jax.random.key(6), Temperature(1.0), LIMITS,
                           TurnTreeConfig(num_slots=4, roots=1, fork_turns=3), stop_ids=(63,), fork_rule=rule)
    assert calls and all(n == 4 for _, _, n in calls)
    t = trees[0]
    assert t.forks == 0 and all(sp == t.slot_path[0] for sp in t.slot_path)
    assert all(ep is t.slot_episode[0] for ep in t.slot_episode)
    with pytest.raises(ValueError, match="fork_rule gave 5"):
        run_turn_trees(params, FNS, _Tok(), lambda p: _Counter(2), ["x"], PROMPTS[:1], LENS[:1], jax.random.key(6),
                       Temperature(1.0), LIMITS, TurnTreeConfig(num_slots=4, roots=1), stop_ids=(63,),
                       fork_rule=lambda reqs: [5] * len(reqs))
    with pytest.raises(ValueError, match="roots"):
        TurnTreeConfig(num_slots=2, roots=3)
    with pytest.raises(ValueError, match="does not fit"):
        run_turn_trees(params, FNS, _Tok(), lambda p: _Counter(2), ["x"], PROMPTS[:1], LENS[:1], jax.random.key(6),
                       Temperature(1.0), TurnLimits(max_tokens=2), TurnTreeConfig())
