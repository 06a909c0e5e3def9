"""treejax.testing.envs.ToyToolEnv: its rules on hand-written turns, clone independence, CharTokenizer-safe text."""

import pytest

from treejax.testing.envs import ToyToolEnv
from treejax.testing.tokenizers import CharTokenizer


def test_rules_and_clone():
    env = ToyToolEnv(max_calls=2, tolerance=1)
    assert env.reset({"target": 5}) == ""
    ok = env.step("a1b2C")
    assert (ok.observation, ok.reward, ok.done) == ("<OUT=3>", 0.0, False) and ok.info["tool_error"] is False
    branch = env.clone()
    err = env.step("1?Z")
    assert (err.observation, err.done, err.info["tool_error"]) == ("<ERR=?>", False, True)
    limit = env.step("QQ")  # a third call: past max_calls, the episode ends without an answer
    assert limit.done and limit.reward == 0.0 and limit.info["answered"] is False
    # the clone went on from after the first call: one call left, then an answer
    assert branch.calls == 1 and not branch.done
    right = branch.step("x4")  # last digit 4, within 1 of 5
    assert right.done and right.reward == 1.0 and right.info == {"tool_calls": 1, "answered": True, "answer": 4}
    wrong, none = ToyToolEnv(), ToyToolEnv()
    wrong.reset({"target": 9}), none.reset({"target": 9})
    assert wrong.step("9a1").reward == 0.0  # the last digit counts
    assert none.step("abc").info["answered"] is False
    tok = CharTokenizer()
    for text in ("<OUT=3>", "<ERR=?>", "<ERR=LIMIT>"):
        assert tok.decode(tok.encode(text)) == text


def test_errors():
    with pytest.raises(RuntimeError, match="before reset"):
        ToyToolEnv().step("A")
    env = ToyToolEnv()
    env.reset("q")
    assert 0 <= env.target <= 9
    env.step("1")
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("2")
    with pytest.raises(ValueError, match="max_calls"):
        ToyToolEnv(max_calls=-1)
