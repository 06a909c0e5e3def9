"""The refiner / generator role (issue 47, role (d)): a second model that *writes* a span of the policy's response.

A judge or a PRM reads the policy's text and returns numbers; a refiner returns tokens. Given a context (its chat
template around :attr:`RefinerConfig.template`: the question, the response so far, the span to replace), it decodes
a replacement span with the sampler (:func:`treejax.sampling.decode.generate`, the same linear sampler a judge's
decode mode uses) and returns, for every token it wrote, its **behaviour log-probability**

    log q(y_t | c, y_<t) = log softmax(f_refiner(c, y_<t))[y_t]      (temperature 1, the true vocabulary)

recorded by the sampler while decoding. These are what a rollout row needs to carry so the learner can treat the
span as off-policy, exactly as it treats a replayed row (:mod:`treejax.rl.replay`): the row's ``Forest.logprobs``
hold ``log q`` on the refiner's tokens (and the policy sampler's own log-probs elsewhere), and with
``RunConfig.old_logp = 'trainer'`` and ``LossConfig.tis_cap = C`` the loss weighs each token by
``min(pi_prox(y_t) / q(y_t), C)`` (truncated IS, :mod:`treejax.rl.losses`); or a stage keeps the span out of the
loss (``loss_mask = 0``). ``tests/scorers/test_refiner.py`` checks ``log q`` against a direct teacher-forced
forward of the refiner model (:func:`treejax.models.transformer.forward`).

Conventions (the same as the policy's own rows): ``log q`` is the refiner's temperature-1 log-prob. With
``temperature = 1.0`` (the default) that is exactly the distribution the token was drawn from; with another
temperature (``0``: greedy) it is the refiner model's probability, as the forest stores the policy's own sampled
tokens at temperature 1 whatever the sampler's temperature. A span ends at the refiner's stop token (EOS, which is
*not* kept: the policy continues after the span), after ``max_new_tokens``, or with ``stop_at_newline`` after the
first token whose text holds a newline (kept: one line is one step). Cutting a span by a rule of the tokens
decoded so far keeps every kept token's ``log q`` exact (per-token importance weights need nothing else).

The refiner's tokens must be policy tokens: :func:`check_tokenizer` refuses a refiner whose tokenizer encodes
differently from the policy's (``model = "policy"``, the policy's frozen initial weights, always passes; so does
the embedded SmolLM2-135M-Instruct with a SmolLM2 policy).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from treejax.errors import ConfigError

#: The refiner's default user turn: ``{question}``, ``{prefix}`` (the response before the span), ``{step}`` (the
#: span it replaces). The assistant turn is opened after it; what the refiner writes there is the new span.
DEFAULT_REFINE_TEMPLATE = ("Here is a math problem and the start of a solution.\n\nProblem: {question}\n\n"
                           "Solution so far:\n{prefix}\n\nThis next step is wrong:\n{step}\n\n"
                           "Write a correct next step instead, one line only.")
DTYPES = ("float32", "bfloat16", "float16")
#: the text the policy's and the refiner's tokenizers must encode alike (:func:`check_tokenizer`)
PROBE_TEXT = "Step 1: 67 + 75 = 142\n  Answer: 142.\tIs it (x^2 - 1)/2? Yes, no; 0123456789 {}[]<>"


@dataclasses.dataclass(frozen=True)
class RefinerConfig:
    """A model that rewrites a span of the policy's response (module docstring). gin: ``@RefinerConfig()``.

    * ``model``: what ``RunConfig.model`` takes (embedded name, HF folder, ``.gguf``) or ``"policy"`` (the
      policy's initial weights, frozen); its tokenizer must be the policy's;
    * ``compute_dtype``: its weights and compute (its own precision, apart from the policy's);
    * ``template``: its user turn, with ``{prefix}`` and optionally ``{question}`` and ``{step}``;
    * ``max_new_tokens``: the longest span; ``temperature``: its sampling temperature (``0``: greedy);
      ``stop_at_newline``: a span is one line;
    * ``batch_size``: rows per decode call (the last batch padded); ``max_length``: a context keeps its last
      ``max_length`` tokens."""

    model: str = "policy"
    compute_dtype: str = "float32"
    template: str = DEFAULT_REFINE_TEMPLATE
    max_new_tokens: int = 32
    temperature: float = 1.0
    stop_at_newline: bool = True
    batch_size: int = 16
    max_length: int = 1024

    def __post_init__(self):
        if self.compute_dtype not in DTYPES:
            raise ConfigError(f"RefinerConfig.compute_dtype must be one of {DTYPES}, got {self.compute_dtype!r}; "
                              "fix: RefinerConfig.compute_dtype = 'float32'")
        if "{prefix}" not in self.template:
            raise ConfigError("RefinerConfig.template must contain {prefix} (the response before the span); fix: "
                              "see treejax.scorers.refiner.DEFAULT_REFINE_TEMPLATE")
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.max_length < 8:
            raise ConfigError(f"RefinerConfig: max_new_tokens >= 1, batch_size >= 1 and max_length >= 8 required, "
                              f"got {self.max_new_tokens}, {self.batch_size}, {self.max_length}")
        if not self.temperature >= 0.0:
            raise ConfigError(f"RefinerConfig.temperature must be >= 0 (0: greedy), got {self.temperature}; fix: "
                              "RefinerConfig.temperature = 1.0")

    def render(self, question: str, prefix: str, step: str) -> str:
        """The refiner's user turn for one span."""
        return self.template.format(question=question, prefix=prefix, step=step)


@dataclasses.dataclass(frozen=True, eq=False)
class Refiner:
    """A loaded refiner: its settings, model config, frozen weights and tokenizer."""

    config: RefinerConfig
    model_config: Any
    params: Any
    tokenizer: Any

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0


@dataclasses.dataclass(frozen=True)
class RefinedSpans:
    """What the refiner wrote, ``N`` spans of at most ``K = max_new_tokens`` tokens: ``tokens_NxK`` (0 past the
    end), ``logprobs_NxK`` (``log q`` of each kept token, 0 past the end), ``lengths_N``."""

    tokens_NxK: np.ndarray
    logprobs_NxK: np.ndarray
    lengths_N: np.ndarray


def load_refiner(config: RefinerConfig, policy_model: str | None = None) -> Refiner:
    """Loads ``config.model`` (``"policy"``: ``policy_model`` again) with ``config.compute_dtype`` weights and
    compute, through the policy's loader (:func:`treejax.models.registry.load_model`)."""
    from treejax.models.registry import load_model

    if config.model == "policy" and not policy_model:
        raise ValueError("RefinerConfig.model = 'policy' needs the policy's model (RunConfig.model); pass "
                         "policy_model=")
    name = policy_model if config.model == "policy" else config.model
    model_config, params, tokenizer = load_model(name, param_dtype=config.compute_dtype,
                                                 compute_dtype=config.compute_dtype)
    return Refiner(config, model_config, params, tokenizer)


def check_tokenizer(refiner: Refiner, policy_tokenizer) -> None:
    """Refuses (one line) a refiner whose tokens are not the policy's: :data:`PROBE_TEXT` and the EOS ids must
    encode alike (its spans are written into the policy's rows as token ids)."""
    ours, theirs = refiner.tokenizer, policy_tokenizer
    if (ours.encode(PROBE_TEXT) != theirs.encode(PROBE_TEXT)
            or tuple(getattr(ours, "eos_ids", ())) != tuple(getattr(theirs, "eos_ids", ()))):
        raise ConfigError(f"RefinerConfig.model = {refiner.config.model!r} has another tokenizer than the policy's; "
                          "its tokens are written into the policy's rows, so it must share it; fix: "
                          "RefinerConfig.model = 'policy' (or a model of the policy's family)")


def refiner_context(refiner: Refiner, question: str, prefix: str, step: str) -> list[int]:
    """The refiner's input ids for one span: its chat template around the rendered template, the assistant turn
    opened; cut to its last ``max_length`` tokens."""
    from treejax.scorers.judge import chat_ids

    return chat_ids(refiner, refiner.config.render(question, prefix, step))[-refiner.config.max_length:]


def _newline_ids(tokenizer, ids) -> set[int]:
    return {int(i) for i in set(ids) if "\n" in tokenizer.decode([int(i)])}


def cut_span(tokens_K, logprobs_K, length: int, stop_ids, newline_ids, stop_at_newline: bool):
    """``(tokens, logprobs)`` of one decoded span as kept (module docstring): up to (not with) its first stop
    token, and with ``stop_at_newline`` through its first newline token."""
    keep = []
    for t in range(int(length)):
        tok = int(tokens_K[t])
        if tok in stop_ids:
            break
        keep.append(t)
        if stop_at_newline and tok in newline_ids:
            break
    return (np.asarray([int(tokens_K[t]) for t in keep], np.int32),
            np.asarray([float(logprobs_K[t]) for t in keep], np.float32))


def refine(refiner: Refiner, contexts: list[list[int]], key: jax.Array) -> RefinedSpans:
    """The refiner's spans after each context (``batch_size`` rows per :func:`~treejax.sampling.decode.generate`
    call, batch ``i`` with ``fold_in(key, i)``), with their behaviour log-probs (module docstring)."""
    from treejax.sampling.decode import generate
    from treejax.sampling.strategies import Greedy, Temperature
    from treejax.scorers.judge import pad_rows

    cfg, K = refiner.config, refiner.config.max_new_tokens
    strategy = Greedy() if cfg.temperature == 0.0 else Temperature(float(cfg.temperature))
    stop_ids = set(int(i) for i in (refiner.model_config.eos_token_ids or ()))
    tokens, logps = np.zeros((len(contexts), K), np.int32), np.zeros((len(contexts), K), np.float32)
    lengths = np.zeros((len(contexts),), np.int32)
    for b, i in enumerate(range(0, len(contexts), cfg.batch_size)):
        chunk = contexts[i:i + cfg.batch_size]
        prompts, lens = pad_rows(chunk, cfg.batch_size, refiner.pad_id)
        out = generate(refiner.params, refiner.model_config, prompts, lens, jax.random.fold_in(key, b), K, strategy)
        toks, lps, ns = (np.asarray(x) for x in jax.device_get((out.tokens, out.logprobs, out.lengths)))
        newline = _newline_ids(refiner.tokenizer, toks[: len(chunk)].ravel()) if cfg.stop_at_newline else set()
        for j in range(len(chunk)):
            t, lp = cut_span(toks[j], lps[j], ns[j], stop_ids, newline, cfg.stop_at_newline)
            tokens[i + j, : len(t)], logps[i + j, : len(t)], lengths[i + j] = t, lp, len(t)
    return RefinedSpans(tokens, logps, lengths)


__all__ = ["DEFAULT_REFINE_TEMPLATE", "RefinedSpans", "Refiner", "RefinerConfig", "check_tokenizer", "cut_span",
           "load_refiner", "refine", "refiner_context"]
