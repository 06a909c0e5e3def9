"""The judge: a score in [0, 1] for each (question, response) pair.

Log-prob mode (no decoding): the judge's input is its chat template around ``ScorerConfig.template`` (the question
and the policy's response), the assistant turn opened, and ``answer_prefix``; one teacher-forced forward gives the
next-token distribution ``p`` at the last position, and

    score = p(yes) / (p(yes) + p(no)),   p(yes) = sum_{v in yes_tokens} p(v),  p(no) likewise,
    log-odds = log p(yes) - log p(no)    (score = sigmoid(log-odds)).

Decode mode: the same input, greedy decoding of ``max_new_tokens`` with the sampler
(:func:`treejax.sampling.decode.generate`), and :func:`treejax.scorers.verdicts.parse_verdict` of the text.

Rows are right-padded to a length bucket (64 times a power of two) and grouped in batches of ``batch_size`` (the
last one padded), so one program is compiled per bucket. A row longer than ``max_length`` keeps its last
``max_length`` tokens (the end of the response and the verdict question)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from treejax.models import transformer
from treejax.scorers.model import Scorer
from treejax.scorers.verdicts import parse_verdict

BUCKET = 64


def chat_ids(scorer: Scorer, user_text: str, assistant_prefix: str = "") -> list[int]:
    """Token ids of one user turn in the scorer's chat template, the assistant turn opened, then
    ``assistant_prefix`` (the plain text when the tokenizer has no chat template)."""
    tok = scorer.tokenizer
    if tok.chat_template:
        ids = list(tok.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True,
                                           tokenize=True))
    else:
        ids = tok.encode(user_text + "\n")
    return ids + (tok.encode(assistant_prefix) if assistant_prefix else [])


def judge_rows(scorer: Scorer, questions, responses, answers=None) -> list[list[int]]:
    """The judge's input ids of each pair (module docstring), cut to their last ``max_length`` tokens."""
    cfg = scorer.config
    answers = answers if answers is not None else [""] * len(questions)
    rows = [chat_ids(scorer, cfg.render(q, r, a), cfg.answer_prefix) for q, r, a in zip(questions, responses, answers)]
    return [r[-cfg.max_length:] for r in rows]


def pad_rows(rows: list[list[int]], batch: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [batch, L], lengths [batch])``: rows right-padded to :data:`BUCKET` times a power of two (few
    length buckets: one compiled program each); missing rows are one pad token (their outputs are dropped)."""
    width = BUCKET
    while width < max(len(r) for r in rows):
        width *= 2
    tokens = np.full((batch, width), pad_id, np.int32)
    lengths = np.ones((batch,), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
        lengths[i] = len(r)
    return tokens, lengths


def _group_logp(logp_BxV: jax.Array, ids: tuple[int, ...]) -> jax.Array:
    return jax.nn.logsumexp(logp_BxV[:, jnp.asarray(ids, jnp.int32)], axis=-1)


@functools.partial(jax.jit, static_argnames=("model_config", "yes_ids", "no_ids"))
def verdict_logprobs_at(params, tokens_BxL, lengths_B, gather_BxS, *, model_config, yes_ids, no_ids):
    """``(log p(yes), log p(no))``, each ``[B, S]``: the verdict groups' next-token log-probabilities at positions
    ``gather[b, s]`` of right-padded rows (one forward; full-vocabulary softmax in float32)."""
    B, L = tokens_BxL.shape
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None], (B, L))
    segment_ids = (positions < lengths_B[:, None]).astype(jnp.int32)
    hidden = transformer.forward(params, model_config, tokens_BxL, positions, segment_ids)
    h = jnp.take_along_axis(hidden, gather_BxS[..., None], axis=1)  # [B, S, E]
    logp = jax.nn.log_softmax(transformer.logits(params, model_config, h), axis=-1)  # [B, S, V]
    flat = logp.reshape(-1, logp.shape[-1])
    return (_group_logp(flat, yes_ids).reshape(gather_BxS.shape),
            _group_logp(flat, no_ids).reshape(gather_BxS.shape))


def verdict_logodds(scorer: Scorer, rows: list[list[int]]) -> np.ndarray:
    """float32 ``[N]``: ``log p(yes) - log p(no)`` at the last token of each row, ``batch_size`` rows a call."""
    bs = scorer.config.batch_size
    out = []
    for i in range(0, len(rows), bs):
        chunk = rows[i:i + bs]
        tokens, lengths = pad_rows(chunk, bs, scorer.pad_id)
        tokens, lengths_, gather = scorer.place_rows(tokens, lengths, (lengths[:, None] - 1).astype(np.int32))
        ly, ln = verdict_logprobs_at(scorer.params, tokens, lengths_, gather, model_config=scorer.model_config,
                                     yes_ids=scorer.yes_ids, no_ids=scorer.no_ids)
        out.append(np.asarray(ly - ln, np.float32)[: len(chunk), 0])
    return np.concatenate(out) if out else np.zeros((0,), np.float32)


@functools.partial(jax.jit, static_argnames=("model_config", "groups"))
def choice_logprobs_at(params, tokens_BxL, lengths_B, gather_B, *, model_config, groups):
    """float32 ``[B, C]``: each choice group's next-token log-probability (logsumexp over its ids) at position
    ``gather[b]`` of right-padded rows (one forward; full-vocabulary softmax in float32)."""
    B, L = tokens_BxL.shape
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None], (B, L))
    segment_ids = (positions < lengths_B[:, None]).astype(jnp.int32)
    hidden = transformer.forward(params, model_config, tokens_BxL, positions, segment_ids)
    h = jnp.take_along_axis(hidden, gather_B[:, None, None], axis=1)[:, 0]  # [B, E]
    logp = jax.nn.log_softmax(transformer.logits(params, model_config, h).astype(jnp.float32), axis=-1)
    return jnp.stack([_group_logp(logp, ids) for ids in groups], axis=-1)


def choice_ids(scorer: Scorer, choices: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """The token ids of each choice string, with and without a leading space (each a single token; a choice that
    is not one token either way is a ValueError naming it)."""
    out = []
    for c in choices:
        ids = {t[0] for t in (scorer.tokenizer.encode(c), scorer.tokenizer.encode(" " + c)) if len(t) == 1}
        if not ids:
            raise ValueError(f"choice {c!r} is not one token of the scorer's tokenizer")
        out.append(tuple(sorted(ids)))
    return tuple(out)


def choice_logprobs(scorer: Scorer, rows: list[list[int]], choices: tuple[str, ...]) -> np.ndarray:
    """float32 ``[N, C]``: the scorer's next-token log-probability of each choice after each row (its last token),
    ``batch_size`` rows a call: a multiple-choice reading of the judge with no decoding (e.g. Search-R2's index of
    the earliest flawed step, choices ``"0" .. "K"``)."""
    groups, bs, out = choice_ids(scorer, choices), scorer.config.batch_size, []
    for i in range(0, len(rows), bs):
        chunk = rows[i:i + bs]
        tokens, lengths = pad_rows(chunk, bs, scorer.pad_id)
        tokens, lengths_, gather = scorer.place_rows(tokens, lengths, (lengths - 1).astype(np.int32))
        lp = choice_logprobs_at(scorer.params, tokens, lengths_, gather, model_config=scorer.model_config,
                                groups=groups)
        out.append(np.asarray(lp, np.float32)[: len(chunk)])
    return np.concatenate(out) if out else np.zeros((0, len(choices)), np.float32)


def decode_verdicts(scorer: Scorer, rows: list[list[int]], key=None) -> tuple[np.ndarray, list[str]]:
    """Decode mode: ``(scores [N], texts)``: greedy verdicts (the sampler) parsed by ``verdict_pattern``."""
    from treejax.sampling.decode import generate

    cfg, bs = scorer.config, scorer.config.batch_size
    key = jax.random.key(0) if key is None else key
    texts = []
    for i in range(0, len(rows), bs):
        chunk = rows[i:i + bs]
        tokens, lengths = pad_rows(chunk, bs, scorer.pad_id)
        out = generate(scorer.params, scorer.model_config, tokens, lengths, key, cfg.max_new_tokens)
        toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
        texts += [scorer.tokenizer.decode(toks[j, : lens[j]].tolist(), skip_special_tokens=True)
                  for j in range(len(chunk))]
    yes = tuple(t.strip().lower() for t in cfg.yes_tokens)
    no = tuple(t.strip().lower() for t in cfg.no_tokens)
    scores = np.array([parse_verdict(t, cfg.verdict_pattern, yes, no, cfg.score_range) for t in texts], np.float32)
    return scores, texts


def judge_scores(scorer: Scorer, questions, responses, answers=None) -> np.ndarray:
    """float32 ``[N]`` scores in [0, 1] (``NaN``: a decoded verdict that did not parse) of each pair."""
    rows = judge_rows(scorer, questions, responses, answers)
    if not rows:
        return np.zeros((0,), np.float32)
    if scorer.config.mode == "decode":
        return decode_verdicts(scorer, rows)[0]
    return (1.0 / (1.0 + np.exp(-verdict_logodds(scorer, rows)))).astype(np.float32)
