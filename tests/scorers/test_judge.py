"""The judge: verdict parsing, verdict-token log-probs against a direct forward of the model, the decode mode, and
the scorer's config checks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.scorers import ScorerConfig
from treejax.scorers.verdicts import parse_verdict


@pytest.mark.parametrize("text, pattern, kw, expected", [
    ("ok <verdict>yes</verdict>", r"<verdict>\s*(\w+)\s*</verdict>", {}, 1.0),
    ("<verdict> No </verdict> then yes", r"<verdict>\s*(\w+)\s*</verdict>", {}, 0.0),
    ("Score: 7/10", r"Score:\s*(\d+)", {"score_range": (1, 10)}, 6 / 9),
    ("Score: 12", r"Score:\s*(\d+)", {"score_range": (1, 10)}, 1.0),
    ("no verdict here", r"<verdict>(\w+)</verdict>", {}, math.nan),
    ("<verdict>maybe</verdict>", r"<verdict>(\w+)</verdict>", {}, math.nan),
    (r"the earliest error: \boxed{-1}", r"\\boxed\{(-?\d+)\}", {"yes_words": ("-1",), "no_words": ("*",)}, 1.0),
    (r"the earliest error: \boxed{3}", r"\\boxed\{(-?\d+)\}", {"yes_words": ("-1",), "no_words": ("*",)}, 0.0),
    ("Yes.", r"(?i)\b(yes|no)\b", {}, 1.0),
])
def test_parse_verdict(text, pattern, kw, expected):
    got = parse_verdict(text, pattern, **kw)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected, abs=1e-6)


def test_scorer_config_refuses_what_does_not_fit():
    with pytest.raises(ConfigError, match="mode must be one of"):
        ScorerConfig(mode="sample")
    with pytest.raises(ConfigError, match="disjoint"):
        ScorerConfig(yes_tokens=("Yes",), no_tokens=("Yes",))
    with pytest.raises(ConfigError, match=r"must contain \{response\}"):
        ScorerConfig(template="{question}")
    with pytest.raises(ConfigError, match="one capturing group"):
        ScorerConfig(verdict_pattern="yes|no")
    with pytest.raises(ConfigError, match="score_range"):
        ScorerConfig(score_range=(10, 1))


@pytest.fixture(scope="module")
def scorer(tiny_checkpoint):
    from treejax.scorers.model import load_scorer

    return load_scorer(ScorerConfig(model=tiny_checkpoint, batch_size=2))


def test_a_verdict_token_of_two_tokens_is_refused(tiny_checkpoint):
    from treejax.scorers.model import from_params, load_scorer

    s = load_scorer(ScorerConfig(model=tiny_checkpoint))
    with pytest.raises(ConfigError, match="is 2 tokens"):
        from_params(ScorerConfig(yes_tokens=("Yes indeed",)), s.model_config, s.params, s.tokenizer)


def test_policy_means_the_policy_model(tiny_checkpoint):
    from treejax.scorers.model import resolve_model

    assert resolve_model(ScorerConfig(model="policy"), tiny_checkpoint) == tiny_checkpoint
    with pytest.raises(ValueError, match="RunConfig.model"):
        resolve_model(ScorerConfig(model="policy"), None)


def _direct(scorer, ids):
    """The verdict probability from one unpadded forward of the model (treejax.models.transformer)."""
    from treejax.models import transformer

    t = jnp.asarray([ids], jnp.int32)
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]
    h = transformer.forward(scorer.params, scorer.model_config, t, pos)
    logp = np.asarray(jax.nn.log_softmax(transformer.logits(scorer.params, scorer.model_config, h[:, -1]), -1))[0]
    py = sum(math.exp(logp[i]) for i in scorer.yes_ids)
    pn = sum(math.exp(logp[i]) for i in scorer.no_ids)
    return py / (py + pn)


def test_verdict_logprobs_equal_a_direct_forward(scorer):
    from treejax.scorers.judge import judge_rows, judge_scores

    qs = ["What is 2 + 3?", "What is 40 + 2?", "What is 7 + 8?"]
    rs = ["2 + 3 = 5\nAnswer: 5", "40 + 2 = 41\nAnswer: 41", "Answer: 15"]
    got = judge_scores(scorer, qs, rs)  # 3 rows in batches of 2: a padded last batch
    rows = judge_rows(scorer, qs, rs)
    want = np.array([_direct(scorer, r) for r in rows])
    assert got.shape == (3,) and np.all((got > 0) & (got < 1))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert scorer.tokenizer.decode(rows[0]).endswith("<|im_start|>assistant\n")  # the verdict is the next token


def test_choice_logprobs_equal_a_direct_forward(scorer):
    """The multiple-choice reading (Search-R2's flawed-step index): each choice's next-token log-prob after each
    row, logsumexp over its one-token spellings, equals one unpadded forward; 3 rows in batches of 2."""
    from treejax.models import transformer
    from treejax.scorers.judge import chat_ids, choice_ids, choice_logprobs

    rows = [chat_ids(scorer, t) for t in ("Steps: 1, 2. Which is wrong?", "Pick 0, 1 or 2.", "Reply with 2")]
    choices = ("0", "1", "2")
    got = choice_logprobs(scorer, rows, choices)
    groups = choice_ids(scorer, choices)
    assert got.shape == (3, 3) and all(len(g) >= 1 for g in groups)
    for i, ids in enumerate(rows):
        t, pos = jnp.asarray([ids], jnp.int32), jnp.arange(len(ids), dtype=jnp.int32)[None]
        h = transformer.forward(scorer.params, scorer.model_config, t, pos)
        logp = np.asarray(jax.nn.log_softmax(transformer.logits(scorer.params, scorer.model_config, h[:, -1]), -1))[0]
        want = [math.log(sum(math.exp(logp[j]) for j in g)) for g in groups]
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="'not one token' is not one token"):
        choice_ids(scorer, ("not one token",))


def test_decode_mode_parses_the_sampler_greedy_text(scorer):
    import dataclasses

    from treejax.sampling.decode import generate
    from treejax.scorers.judge import decode_verdicts, judge_rows

    s = dataclasses.replace(scorer, config=dataclasses.replace(scorer.config, mode="decode", max_new_tokens=4,
                                                               verdict_pattern=r"(.+)", no_tokens=("*",)))
    rows = judge_rows(s, ["What is 2 + 3?"], ["Answer: 5"])
    scores, texts = decode_verdicts(s, rows)
    out = generate(s.params, s.model_config, np.asarray([rows[0]], np.int32), np.asarray([len(rows[0])], np.int32),
                   jax.random.key(0), 4)
    n = int(out.lengths[0])
    assert texts[0] == s.tokenizer.decode(np.asarray(out.tokens)[0, :n].tolist(), skip_special_tokens=True)
    want = parse_verdict(texts[0], r"(.+)", ("yes",), ("*",))
    assert (math.isnan(scores[0]) and math.isnan(want)) or scores[0] == want


@pytest.mark.devices(8)
def test_a_mesh_sharded_scorer_scores_as_the_one_device_scorer(scorer):
    """``ScorerConfig.sharding = "mesh"``: the weights laid out over a 2 x 4 (data x fsdp) mesh by the policy's rules
    (every matrix split over fsdp), rows of each forward over the batch axes; the judge's and the PRM's scores equal
    the one-device scorer's; decode mode and a mesh-less load are refused."""
    from jax.sharding import Mesh

    from treejax.scorers.judge import judge_scores
    from treejax.scorers.model import from_params
    from treejax.scorers.prm import line_steps, step_scores

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4, 1), ("data", "fsdp", "tensor"))
    cfg = ScorerConfig(model=scorer.config.model, batch_size=4, sharding="mesh")
    sharded = from_params(cfg, scorer.model_config, scorer.params, scorer.tokenizer, mesh)
    shards = {len(x.sharding.device_set) for x in jax.tree.leaves(sharded.params)}
    assert shards == {8} and sharded.mesh is mesh
    big = max(jax.tree.leaves(sharded.params), key=lambda x: x.size)
    assert big.addressable_shards[0].data.size == big.size // 4  # split over fsdp, replicated over data
    qs = ["What is 2 + 3?", "What is 40 + 2?", "What is 7 + 8?", "What is 1 + 1?", "What is 9 + 9?"]
    rs = ["2 + 3 = 5\nAnswer: 5", "40 + 2 = 41\nAnswer: 41", "Answer: 15", "Answer: 2", "9 + 9 = 18\nAnswer: 18"]
    one = from_params(ScorerConfig(model=scorer.config.model, batch_size=4), scorer.model_config, scorer.params,
                      scorer.tokenizer)
    np.testing.assert_allclose(judge_scores(sharded, qs, rs), judge_scores(one, qs, rs), rtol=1e-5, atol=1e-6)
    steps = [line_steps(r) for r in rs]
    np.testing.assert_allclose(step_scores(sharded, qs, steps), step_scores(one, qs, steps), rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="mode = 'decode' decodes with the sampler on one device"):
        ScorerConfig(sharding="mesh", mode="decode")
    with pytest.raises(ConfigError, match="sharding must be one of"):
        ScorerConfig(sharding="fsdp")
    with pytest.raises(ValueError, match="needs the run's mesh"):
        from_params(cfg, scorer.model_config, scorer.params, scorer.tokenizer)
