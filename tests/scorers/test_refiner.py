"""The refiner role: what it writes carries behaviour log-probs equal to a teacher-forced forward of its model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.scorers.refiner import RefinerConfig, check_tokenizer, cut_span, load_refiner, refine, refiner_context


def teacher_forced_logp(model_config, params, context, span) -> np.ndarray:
    """``log softmax(f(context + span[:t]))[span[t]]`` for each span token: one plain forward of the whole row
    (:func:`treejax.models.transformer.forward`, not the sampler)."""
    from treejax.models import transformer

    ids = list(context) + list(span)
    width = 64 * (1 + len(ids) // 64)
    tokens = np.zeros((1, width), np.int32)
    tokens[0, : len(ids)] = ids
    seg = (np.arange(width) < len(ids)).astype(np.int32)[None]
    h = jax.jit(transformer.forward, static_argnums=1)(params, model_config, jnp.asarray(tokens),
                                                       jnp.arange(width, dtype=jnp.int32)[None], jnp.asarray(seg))
    logp = np.asarray(jax.nn.log_softmax(transformer.logits(params, model_config, h[0]).astype(jnp.float32), -1))
    return np.array([logp[len(context) - 1 + t, span[t]] for t in range(len(span))], np.float32)


@pytest.fixture(scope="module")
def refiner(tiny_checkpoint):
    return load_refiner(RefinerConfig(model=tiny_checkpoint, max_new_tokens=6, batch_size=2, stop_at_newline=False))


def test_refined_tokens_carry_the_refiner_models_log_probs(refiner):
    """Three spans in two decode batches (the last padded): every kept token's log q equals a direct
    teacher-forced forward of the refiner at temperature 1 (rtol 1e-4); no stop token is kept."""
    contexts = [refiner_context(refiner, "What is 12 + 30?", "12 + 30", "= 41"),
                refiner_context(refiner, "What is 5 + 5?", "", "5 + 5 = 11"),
                refiner_context(refiner, "What is 1 + 1?", "1 + 1 = 2\n", "Answer: 3")]
    spans = refine(refiner, contexts, jax.random.key(3))
    assert spans.tokens_NxK.shape == (3, 6) and (spans.lengths_N > 0).all()
    eos = set(refiner.model_config.eos_token_ids)
    for i, ctx in enumerate(contexts):
        n = int(spans.lengths_N[i])
        span = spans.tokens_NxK[i, :n].tolist()
        assert not eos & set(span)
        np.testing.assert_allclose(spans.logprobs_NxK[i, :n], teacher_forced_logp(refiner.model_config,
                                                                                  refiner.params, ctx, span),
                                   rtol=1e-4, atol=1e-5)
        assert not spans.logprobs_NxK[i, n:].any() and not spans.tokens_NxK[i, n:].any()


def test_cut_span_drops_the_stop_token_and_ends_a_line():
    toks, lps = np.array([5, 9, 7, 2, 4]), np.array([-1.0, -2.0, -3.0, -4.0, -5.0])
    t, lp = cut_span(toks, lps, 5, {2}, {9}, stop_at_newline=True)
    assert t.tolist() == [5, 9] and lp.tolist() == [-1.0, -2.0]
    t, lp = cut_span(toks, lps, 5, {2}, {9}, stop_at_newline=False)
    assert t.tolist() == [5, 9, 7] and lp.tolist() == [-1.0, -2.0, -3.0]
    t, _ = cut_span(np.array([2, 5]), lps[:2], 2, {2}, set(), stop_at_newline=True)
    assert t.tolist() == []
    t, _ = cut_span(toks, lps, 2, {2}, set(), stop_at_newline=True)  # only the decoded length counts
    assert t.tolist() == [5, 9]


@pytest.mark.parametrize("kw,match", [(dict(template="no prefix here"), "must contain [{]prefix[}]"),
                                      (dict(temperature=-1.0), "temperature must be >= 0"),
                                      (dict(compute_dtype="int8"), "compute_dtype must be one of"),
                                      (dict(max_new_tokens=0), "max_new_tokens >= 1")])
def test_config_errors_are_one_line_with_the_fix(kw, match):
    with pytest.raises(ConfigError, match=match) as e:
        RefinerConfig(**kw)
    assert "\n" not in str(e.value)


def test_a_refiner_with_another_tokenizer_is_refused(refiner):
    class Other:
        eos_ids = (2,)

        def encode(self, text):
            return [ord(c) for c in text]

    check_tokenizer(refiner, refiner.tokenizer)
    with pytest.raises(ConfigError, match="another tokenizer than the policy's.*fix: RefinerConfig.model = 'policy'"):
        check_tokenizer(refiner, Other())
