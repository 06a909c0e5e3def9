"""Multi-turn episodes (treejax.sampling.multiturn): turns end on a stop string (tokens past it dropped), a stop
token or the turn cap; observations are appended over the cached prefix; every policy token's log-prob equals a
full forward of the whole conversation (fp32); observation tokens are never policy tokens; the limits end
episodes with their status."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from treejax.envs.base import StepResult
from treejax.models import presets, transformer
from treejax.sampling import decode
from treejax.sampling.multiturn import Episode, TurnLimits, chat_observation, run_episodes
from treejax.sampling.strategies import Temperature
from treejax.testing.references import full_forward_logp
from treejax.testing.tokenizers import CharTokenizer as _Tok

CFG = presets.tiny_config("smollm2-135m", vocab_size=64)
FNS = decode.make_model_fns(CFG, attention="dense", cache_dtype="float32")


class _Echo:
    """Ends a turn on '5' or '7'; answers "OK" plus the turn's length; done after ``turns`` turns, reward 1 then."""

    stop_strings = ("5", "7")

    def __init__(self, turns=3):
        self.turns, self.seen = turns, []

    def reset(self, example):
        self.seen = []
        return "ab" if example == "greet" else ""

    def step(self, action):
        self.seen.append(action)
        done = len(self.seen) >= self.turns
        return StepResult(f"OK{len(action) % 10}", float(done), done, {"n": len(self.seen)})

    def clone(self):
        return self


_REF_WIDTH = 72  # a 4-token prompt + an episode's max_tokens = 64


def _full_logp(params, seq):
    """One full forward's log-probs over ``seq`` (padded to ``_REF_WIDTH``: one program for every length)."""
    return full_forward_logp(params, CFG, seq, _REF_WIDTH)


@pytest.fixture(scope="module")
def params():
    return transformer.init_params(CFG, jax.random.key(5))


def test_episodes_match_a_full_forward_and_keep_observations_out(params):
    prompts = np.array([[1, 2, 3, 4], [1, 9, 0, 0], [1, 5, 6, 0]], np.int32)
    lens = np.array([4, 2, 3], np.int32)
    envs = [_Echo(3), _Echo(2), _Echo(3)]
    eps = run_episodes(params, FNS, _Tok(), envs, ["greet", "x", "x"], prompts, lens, jax.random.key(0),
                       Temperature(1.0), TurnLimits(max_turns=3, turn_tokens=12, max_tokens=64, chunk=4),
                       stop_ids=(63,))
    tok = _Tok()
    for b, ep in enumerate(eps):
        assert len(ep.tokens) == len(ep.policy_mask) == len(ep.logprobs) <= 64
        assert ep.status in ("done", "max_turns", "max_tokens")
        spans = ep.turns
        assert spans[0][0] == 0 and all(a[1] == c[0] for a, c in zip(spans, spans[1:])) and spans[-1][1] == len(ep.tokens)
        for start, end, kind in spans:  # observation tokens are never policy tokens
            assert all(m == (kind == "policy") for m in ep.policy_mask[start:end])
            if kind == "policy":  # a turn ends at its first stop string, a stop token or the cap
                text = tok.decode(ep.tokens[start:end])
                cut = [i for i in range(1, end - start) if tok.decode(ep.tokens[start:start + i])[-1:] in ("5", "7")]
                assert not cut, (text, cut)
                assert text[-1:] in ("5", "7") or ep.tokens[end - 1] == 63 or end - start == 12
        # the policy's log-probs are those of a full forward over prompt + response
        seq = list(prompts[b, :lens[b]]) + ep.tokens
        full = _full_logp(params, seq)
        for i, (t, lp, pol) in enumerate(zip(ep.tokens, ep.logprobs, ep.policy_mask)):
            if pol:
                np.testing.assert_allclose(lp, full[lens[b] - 1 + i, t], atol=1e-4)
            else:
                assert lp == 0.0
    assert eps[0].turns[0] == (0, 2, "env") and eps[0].tokens[:2] == tok.encode("ab")  # reset's observation
    assert all(len(e.rewards) == e.policy_turns for e in eps)
    assert eps[1].policy_turns <= 2 and (eps[1].status != "done" or eps[1].reward == 1.0)


def test_limits_end_episodes():
    params = transformer.init_params(CFG, jax.random.key(5))
    prompts, lens = np.array([[1, 2]], np.int32), np.array([2], np.int32)
    ep = run_episodes(params, FNS, _Tok(), [_Echo(99)], ["x"], prompts, lens, jax.random.key(1), Temperature(1.0),
                      TurnLimits(max_turns=2, turn_tokens=6, max_tokens=64, chunk=4))[0]
    assert ep.status == "max_turns" and ep.policy_turns == 2
    ep = run_episodes(params, FNS, _Tok(), [_Echo(99)], ["x"], prompts, lens, jax.random.key(1), Temperature(1.0),
                      TurnLimits(max_turns=50, turn_tokens=6, max_tokens=20, chunk=4))[0]
    assert ep.status == "max_tokens" and len(ep.tokens) <= 20
    with pytest.raises(ValueError, match="extend"):
        run_episodes(params, decode.dataclasses.replace(FNS, extend=None), _Tok(), [_Echo()], ["x"], prompts, lens,
                     jax.random.key(1), Temperature(1.0))
    with pytest.raises(ValueError, match="environments"):
        run_episodes(params, FNS, _Tok(), [], ["x"], prompts, lens, jax.random.key(1), Temperature(1.0))


def test_chat_observation_uses_the_template():
    from treejax.models.registry import embedded_model_path
    from treejax.models.tokenizer import TextTokenizer

    tok = TextTokenizer.from_gguf(embedded_model_path("smollm2-135m-instruct"))
    fmt = chat_observation(tok)
    text = fmt("Higher.")
    assert "Higher." in text and text.rstrip().endswith("assistant") and "user" in text
    assert Episode().reward == 0.0
