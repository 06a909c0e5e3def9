"""Multi-turn episodes as the loop's source (treejax.rl.multiturn): one chain leaf per episode with the whole
conversation as tokens, the loss mask zero on exactly the observation tokens, the policy's log-probs on sampled
tokens, the verifier's score of the answer turn as the reward; and a learning step on it trains only policy tokens."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.models import presets, transformer
from treejax.rl.multiturn import MultiTurnConfig, MultiTurnRollouts
from treejax.sampling import decode, tree
from treejax.sampling.strategies import Temperature
from treejax.testing.envs import ScriptedToolEnv
from treejax.testing.tokenizers import CharTokenizer as _Tok


CFG = presets.tiny_config("smollm2-135m", vocab_size=64)
FNS = decode.make_model_fns(CFG, attention="dense", cache_dtype="float32")
TC = tree.independent_config(2, 32, 8, strategy=Temperature(1.0), stop_ids=(63,))


@pytest.fixture(scope="module")
def params():
    """The tiny model's weights (the same key as each test used), built once for the module."""
    return transformer.init_params(CFG, jax.random.key(5))


class _Base:
    def __init__(self):
        self.cfg, self.pipeline = types.SimpleNamespace(), None
        self.rollout = types.SimpleNamespace(tree_config=TC)
        self.sampler_fns, self.tokenizer, self.task = FNS, _Tok(), None

    def draw(self):
        return ["a", "b"], np.array([[1, 2, 3], [1, 4, 0]], np.int32), np.array([3, 2], np.int32)

    def rewards(self, scores, lengths):
        return (2.0 * scores - 1.0).astype(np.float32)


def test_episodes_become_chain_leaves_with_observations_masked(params):
    src = MultiTurnRollouts(_Base(), MultiTurnConfig(max_turns=3, turn_tokens=10, chunk=4), make_env=ScriptedToolEnv)
    ro = src.sample(params, jax.random.key(0), 0)
    f = ro.forest
    assert f.tokens.shape == (2, 2, 32) and ro.num_rows == 2
    mask, tokens = np.asarray(f.loss_mask), np.asarray(f.tokens)
    obs = np.array(_Tok().encode("OK"))
    n_obs = 0
    for p in range(2):
        for w in range(2):
            n = int(f.leaf_length[p, w])
            row, m = tokens[p, w, :n], mask[p, w, :n]
            runs, i = [], 0  # the masked runs are exactly the "OK" observations
            while i < n:
                if m[i] == 0:
                    j = i
                    while j < n and m[j] == 0:
                        j += 1
                    runs.append(list(row[i:j]))
                    i = j
                else:
                    i += 1
            assert all(r == list(obs) for r in runs)
            n_obs += len(runs)
            assert np.all(mask[p, w, n:] == 0)
            lp = np.asarray(f.logprobs)[p, w, :n]
            assert np.all(lp[m == 0] == 0) and np.all(lp[m == 1] < 0)
    assert n_obs > 0 and ro.extra_metrics["multiturn/appended_tokens"] == 2 * n_obs
    assert ro.counters.decoded_tokens == int(mask.sum())
    assert set(np.unique(ro.scores_PxW)) <= {0.0, 1.0}
    np.testing.assert_array_equal(np.asarray(ro.rewards_PxW), 2 * ro.scores_PxW - 1)


def test_turn_trees_share_decoded_turns(params):
    """roots=1, 4 slots, forks after the first turn: the first turn is decoded once for all 4 slots, the counters
    count each node once, the forest's nodes are the turns (spans) and a tree estimator reads them."""
    from treejax.rl.advantages.registry import estimator_spec

    base = _Base()
    base.rollout = types.SimpleNamespace(tree_config=tree.independent_config(4, 32, 8, strategy=Temperature(1.0),
                                                                             stop_ids=(63,)))
    cfg = MultiTurnConfig(max_turns=3, turn_tokens=10, chunk=4, roots=1, branch_factor=2, fork_turns=2)
    ro = MultiTurnRollouts(base, cfg, make_env=ScriptedToolEnv).sample(params, jax.random.key(1), 0)
    f = ro.forest
    assert not f.fixed_segments and f.leaf_path.shape == (2, 4, 4) and f.node_parent.shape == (2, 13)
    path, spans = np.asarray(f.leaf_path), np.asarray(f.spans())
    assert np.all(path[:, :, 1] == path[:, :1, 1])  # one root: every slot starts with the same first turn
    assert ro.counters.forks == ro.extra_metrics["multiturn/forks"] > 0
    mask = np.asarray(f.loss_mask)
    distinct_policy = 0
    for p in range(2):
        for n in set(path[p, :, 1:].ravel()) - {-1}:
            w = int(np.argmax(np.any(path[p] == n, axis=-1)))
            a, L = spans[p, n]
            distinct_policy += int(mask[p, w, a:a + L].sum())
    assert ro.counters.decoded_tokens == distinct_policy < int(mask.sum())
    np.testing.assert_array_equal(np.asarray(f.leaf_weights()), 1.0)
    spec = estimator_spec("treepo")
    adv = jax.jit(lambda f, r: spec.fn(f, r, spec.default_options()))(f, ro.rewards_PxW)  # one program, not eager ops
    assert np.all(np.asarray(adv.tokens)[mask == 0] == 0)


def test_config_checks():
    from treejax.rl.config import RunConfig

    with pytest.raises(ConfigError, match="branch_factor"):
        RunConfig(rollouts=[MultiTurnConfig()])
    chains = tree.independent_config(4, 64, 16)
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        RunConfig(rollouts=[MultiTurnConfig()], rollout=chains, estimator="grpo", dynamic_sampling=True)
    RunConfig(rollouts=[MultiTurnConfig()], rollout=chains, estimator="grpo")
    with pytest.raises(ConfigError, match="max_turns"):
        MultiTurnConfig(max_turns=0)
    with pytest.raises(ConfigError, match="roots"):
        MultiTurnConfig(roots=0)
    with pytest.raises(ConfigError, match=r"reads \['truth_logp_PxN'\].*\(\['MultiTurnConfig'\]\)"):
        RunConfig(rollout=chains, estimator="igpo")
    RunConfig(rollouts=[MultiTurnConfig(roots=2)], rollout=chains, estimator="portool_tool")
    RunConfig(rollouts=[MultiTurnConfig()], rollout=chains, estimator="grpo", packed_update=True)
    with pytest.raises(ConfigError, match="exceeds the 4 leaf slots"):
        RunConfig(rollouts=[MultiTurnConfig(roots=5)], rollout=chains, estimator="grpo")


@pytest.mark.slow
def test_turn_inputs_for_igpo_and_portool(params):
    """The source supplies IGPO's ground-truth scores (the learner's forward, one per node) and PORTool's tool
    success per node, shaped [P, N] like the forest, and both estimators run on them."""
    from treejax.rl.advantages.registry import estimator_spec

    base = _Base()
    base.draw = lambda: ([types.SimpleNamespace(ground_truth="3"), types.SimpleNamespace(ground_truth="42")],
                         np.array([[1, 2, 3], [1, 4, 0]], np.int32), np.array([3, 2], np.int32))
    base.rollout = types.SimpleNamespace(tree_config=tree.independent_config(4, 32, 8, strategy=Temperature(1.0),
                                                                             stop_ids=(63,)))
    cfg = MultiTurnConfig(max_turns=3, turn_tokens=10, chunk=4, roots=2, branch_factor=2, fork_turns=1)
    src = MultiTurnRollouts(base, cfg, make_env=ScriptedToolEnv, estimator_inputs=("truth_logp_PxN", "tool_success_PxN",
                                                                         "state_cluster_PxN"),
                            model_config=CFG, truth_prefix="A")
    ro = src.sample(params, jax.random.key(2), 0)
    f = ro.forest
    truth, success = np.asarray(ro.estimator_inputs["truth_logp_PxN"]), np.asarray(ro.estimator_inputs["tool_success_PxN"])
    assert truth.shape == success.shape == tuple(f.node_parent.shape)
    used = np.asarray(f.node_depth) >= 0
    assert np.all(np.isfinite(truth[used])) and np.all(truth[used] < 0)
    # ScriptedToolEnv's first two turns are successful tool calls, the third is the answer
    depth = np.asarray(f.node_depth)
    assert np.all(success[used & (depth >= 1) & (depth <= 2)] == 1.0) and np.all(np.isnan(success[depth == 3]))
    clusters = np.asarray(ro.estimator_inputs["state_cluster_PxN"])
    assert clusters.shape == truth.shape and np.all(clusters[used & (depth <= 2) & (depth >= 1)] == 0)  # all "OK"
    for name, inputs in (("igpo", {"truth_logp_PxN": truth}), ("portool_tool", {"tool_success_PxN": success}),
                         ("gigpo_similar", {"state_cluster_PxN": clusters})):
        spec = estimator_spec(name)
        adv = spec.fn(f, ro.rewards_PxW, spec.default_options(), **inputs)
        assert np.all(np.isfinite(np.asarray(adv.tokens)))
        assert np.all(np.asarray(adv.tokens)[np.asarray(f.loss_mask) == 0] == 0)
    with pytest.raises(ConfigError, match="supply only"):
        MultiTurnRollouts(base, cfg, make_env=ScriptedToolEnv, estimator_inputs=("greedy_reward_P",))


def test_environment_choice_scores_and_tool_evaluation(monkeypatch, params):
    """The game environment is built from the config; game episodes score their total reward, code-tool episodes
    their answer turn's; the held-out evaluation with the environment runs greedy episodes."""
    from treejax.envs.guess import GuessNumberEnv
    from treejax.rl.multiturn import episode_score, episode_status
    from treejax.sampling.multiturn import Episode

    base = _Base()
    src = MultiTurnRollouts(base, MultiTurnConfig(environment="guess_number", max_turns=5))
    env = src.make_env()
    assert isinstance(env, GuessNumberEnv) and env.max_turns == 5
    game = Episode(rewards=[0.0, 0.0, 1.0], infos=[{"found": False}, {"found": False}, {"found": True}], status="done")
    tool = Episode(rewards=[0.0, 1.0], infos=[{"tool_seconds": 0.1}, {"answered": True}], status="done")
    limit = Episode(rewards=[0.0, 1.0], infos=[{"tool_seconds": 0.1}, {"answered": False}], status="done")
    assert [episode_score(e) for e in (game, tool, limit)] == [1.0, 1.0, 0.0]
    assert episode_status(limit) == 3 and episode_status(tool) == 2  # EOS, FINISHED
    with pytest.raises(ConfigError, match="environment"):
        MultiTurnConfig(environment="chess")

    src = MultiTurnRollouts(base, MultiTurnConfig(max_turns=3, turn_tokens=10, chunk=4), make_env=ScriptedToolEnv)
    examples = [types.SimpleNamespace(prompt_messages=[{"role": "user", "content": "1"}], ground_truth="3",
                                      metadata={}) for _ in range(3)]
    import treejax.data.prompts as prompts_lib

    monkeypatch.setattr(prompts_lib, "encode_examples", lambda tok, exs, *a: [[1, 2, 3]] * len(exs))  # no template
    out = src.evaluate_episodes(params, examples, prompt_width=4, batch_size=2)
    assert set(out) == {"tool_accuracy", "tool_score", "tool_calls_mean", "tool_turns_mean"}
    assert 0.0 <= out["tool_accuracy"] <= 1.0 and 1.0 <= out["tool_turns_mean"] <= 3.0
