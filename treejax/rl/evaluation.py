"""Held-out evaluation: greedy accuracy, and pass@k / maj@k over ``k`` sampled responses per problem.

For ``P`` problems the greedy pass decodes one response each (arg-max, ties to the lowest id); with ``k > 0`` a
sampled pass decodes ``k`` responses each at ``Temperature(temperature)``. Every response is scored by the task's
verifier (``task.score(text, example)``, correct iff the score is ``>= 1.0``, as in the training loop).

Metrics (``n = k`` samples per problem, ``c`` of them correct; every metric is a mean over problems):

* ``accuracy``   greedy response correct;
* ``pass@1``     ``c / k``: the chance that one sample is correct (the mean over samples);
* ``pass@j``     the unbiased estimator of Chen et al. 2021 (:func:`pass_at_k`) with ``n = k``, for ``j`` = 2, 4,
  8, ... ``< k``; ``pass@k`` itself (``j = n = k``) is ``1[c > 0]``: some sample is correct;
* ``maj@k``      the majority answer among the ``k`` samples is correct (:func:`maj_at_k`: one vote of all ``k``
  samples, answers extracted with the task's extraction mode; unparseable answers do not vote);
* ``wmaj@k``     (``EvalConfig.vote_probe``) the same vote with each sample weighted by a quality probe's predicted
  success ``sigmoid(w . h + b)`` at its last decoded token: ARRoL's test-time voting with its online head
  (:class:`treejax.rl.shaping.QualityHead`).

Decoding uses :func:`treejax.sampling.decode.generate` with a fixed batch of ``batch_size`` rows (the last batch is
padded with copies of its first prompt), so each pass compiles once per prompt-length bucket. The sampled pass
tiles the prompts problem-major (row ``i * k + s`` is sample ``s`` of problem ``i``) and draws batch ``b`` with the
key ``fold_in(key(seed), b)``: results are a deterministic function of (params, examples, config). Prompts are
formatted exactly like the training loop's (:func:`treejax.data.prompts.encode_examples`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Hashable, Optional, Sequence

import jax
import numpy as np

from treejax.data import verifiers
from treejax.data.prompts import encode_examples, pad_token_lists
from treejax.parallel.multihost import host_tree
from treejax.rl.scoring import decode_texts
from treejax.sampling.decode import bucket_length, generate, resolve_stop_ids
from treejax.sampling.strategies import Greedy, Temperature

__all__ = [
    "EvalConfig",
    "answer_key",
    "evaluate",
    "extract_answer",
    "maj_at_k",
    "majority_vote",
    "pass_at_k",
    "prompt_width_for",
]


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation settings.

    Attributes:
      num_problems: held-out problems evaluated (the first ``num_problems`` of the examples given; fewer if fewer
        are given).
      max_new_tokens: response budget per problem (greedy and sampled).
      batch_size: rows per decode call (one compile per pass; the last batch is padded).
      k: samples per problem for pass@k / maj@k; 0 = greedy only.
      temperature: sampling temperature of the ``k`` samples (> 0).
      seed: key of the sampled pass.
      vote_probe: name of the stateful shaper whose probe weights the votes (``"arrol_head"``: ARRoL's quality
        head) for ``wmaj@k``; needs ``k > 0`` and that shaper in ``RunConfig.shapers``.
    """

    num_problems: int = 32
    max_new_tokens: int = 128
    batch_size: int = 32
    k: int = 0
    temperature: float = 1.0
    seed: int = 0
    vote_probe: Optional[str] = None

    def __post_init__(self):
        for name, low in (("num_problems", 1), ("max_new_tokens", 1), ("batch_size", 1), ("k", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"EvalConfig.{name} must be an int, got {value!r}")
            if value < low:
                raise ValueError(f"EvalConfig.{name} must be >= {low}, got {value}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ValueError(f"EvalConfig.seed must be an int, got {self.seed!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float, np.floating)) \
                or not math.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(f"EvalConfig.temperature must be a finite number > 0, got {self.temperature!r}")
        if self.vote_probe is not None and self.k < 1:
            raise ValueError(f"EvalConfig.vote_probe = {self.vote_probe!r} weights the votes of k samples: set "
                             "EvalConfig.k >= 1")


# ----------------------------------------------------------------------------------------------- estimators
def pass_at_k(n, c, k: int):
    """Unbiased pass@k of Chen et al. 2021 (Codex, eq. 1), per problem.

    With ``n`` samples of which ``c`` are correct, the chance that ``k`` of them drawn without replacement contain
    a correct one is::

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i=0}^{k-1} (n - c - i) / (n - i)

    (the product form never forms the large binomials; it equals Codex's ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``).
    It is 1 when ``n - c < k`` (every k-subset holds a correct sample) and 0 when ``c = 0``; averaged over
    problems it is an unbiased estimate of the probability that ``k`` fresh samples contain a correct one.
    ``n`` and ``c`` broadcast (arrays over problems -> an array; scalars -> a float); requires ``1 <= k <= n`` and
    ``0 <= c <= n``.
    """
    n_arr, c_arr = np.broadcast_arrays(np.asarray(n), np.asarray(c))
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"pass_at_k: k must be an int >= 1, got {k!r}")
    if np.any(n_arr < k):
        raise ValueError(f"pass_at_k: need n >= k = {k}, got n = {n_arr.min()}")
    if np.any(c_arr < 0) or np.any(c_arr > n_arr):
        raise ValueError("pass_at_k: need 0 <= c <= n")
    n_f, c_f = n_arr.astype(np.float64), c_arr.astype(np.float64)
    miss = np.ones(n_arr.shape, np.float64)  # C(n - c, k) / C(n, k): no correct sample among the k drawn
    for i in range(int(k)):
        miss = miss * np.maximum(n_f - c_f - i, 0.0) / (n_f - i)
    out = 1.0 - miss
    return float(out) if out.ndim == 0 else out


def answer_key(answer: Optional[str]) -> Optional[Hashable]:
    """The vote an extracted answer casts: ``None`` for no/empty answer (it does not vote); the exact rational
    value for a plain number (``"1,000"``, ``"1000.0"`` and ``"\\frac{2000}{2}"`` vote together); else the
    normalised string (wrappers, ``\\text{}``, ``\\left``/``\\right`` and whitespace removed, lower case)."""
    if answer is None or not answer.strip():
        return None
    number = verifiers.parse_number(answer)
    if number is not None:
        return ("number", number)
    text = verifiers._normalise_string(answer)
    return ("text", text) if text else None


def majority_vote(answers: Sequence[Optional[str]], weights: Optional[Sequence[float]] = None) -> Optional[int]:
    """Index of the sample that represents the majority answer, or None when no sample has an answer.

    Answers are grouped by :func:`answer_key` (unparseable ones excluded); the group with the most votes (each
    sample's ``weights[i]``, default 1) wins, ties going to the group whose first member comes first in sample
    order; the representative is that group's first sample."""
    first: dict[Hashable, int] = {}
    votes: dict[Hashable, float] = {}
    for i, a in enumerate(answers):
        key = answer_key(a)
        if key is None:
            continue
        first.setdefault(key, i)
        votes[key] = votes.get(key, 0.0) + (1.0 if weights is None else float(weights[i]))
    if not votes:
        return None
    best = max(votes, key=lambda key: (votes[key], -first[key]))
    return first[best]


def maj_at_k(answers: Sequence[Sequence[Optional[str]]], scores: Sequence[Sequence[float]],
             weights: Optional[Sequence[Sequence[float]]] = None) -> np.ndarray:
    """Per-problem majority-vote correctness (0/1) over all the samples given (``n = k``: one vote of ``k``).

    ``answers[p][s]``: the answer extracted from sample ``s`` of problem ``p`` (None = unparseable);
    ``scores[p][s]``: that sample's verifier score. The vote (:func:`majority_vote`) picks a representative sample
    whose answer is the majority answer; the problem counts as solved iff that sample's score is ``>= 1.0`` (the
    score of the voted answer as the task sees it, without re-scoring). No answer at all counts as wrong.
    ``weights[p][s]``: each sample's vote (default 1)."""
    if len(answers) != len(scores):
        raise ValueError(f"maj_at_k: {len(answers)} answer lists but {len(scores)} score lists")
    out = np.zeros(len(answers), np.float64)
    for p, (a, s) in enumerate(zip(answers, scores)):
        if len(a) != len(s):
            raise ValueError(f"maj_at_k: problem {p} has {len(a)} answers but {len(s)} scores")
        rep = majority_vote(a, None if weights is None else weights[p])
        out[p] = float(rep is not None and s[rep] >= 1.0)
    return out


def extract_answer(task, text: str) -> Optional[str]:
    """The answer a task's verifier reads from a response: ``task.extract_answer(text)`` when the task defines it,
    else :func:`treejax.data.verifiers.extract_answer` with the task's ``extraction`` mode (``"auto"`` if none)."""
    own = getattr(task, "extract_answer", None)
    if callable(own):
        return own(text)
    return verifiers.extract_answer(text, getattr(task, "extraction", "auto"))


# ----------------------------------------------------------------------------------------------- decoding
def prompt_width_for(tokenizer, examples, system_prompt=None, instruction=None) -> int:
    """A prompt width covering every example's formatted prompt (a power-of-two length bucket)."""
    return bucket_length(max(len(t) for t in encode_examples(tokenizer, examples, system_prompt, instruction)))


def _decode(params, model_config, tokenizer, token_lists, prompt_width, max_new_tokens, batch_size, strategy, key,
            probe=None):
    """Responses (texts, lengths) of ``token_lists`` in fixed batches of ``batch_size`` rows; with a ``probe``
    also its logit at each response's last decoded token (a third list)."""
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    stop_ids = resolve_stop_ids(None, tokenizer=tokenizer)
    texts, lengths, probe_logits = [], [], []
    for b, start in enumerate(range(0, len(token_lists), batch_size)):
        chunk = list(token_lists[start: start + batch_size])
        real = len(chunk)
        chunk += [chunk[0]] * (batch_size - real)
        prompts, lens = pad_token_lists(chunk, prompt_width, pad_id)
        out = generate(params, model_config, prompts, lens, jax.random.fold_in(key, b), max_new_tokens, strategy,
                       stop_ids=stop_ids, probe=probe)
        # all-gathered where the rows span other processes (every process decodes and scores the same problems)
        tokens, out_lens = host_tree((out.tokens, out.lengths))
        texts += decode_texts(tokenizer, tokens[:real], out_lens[:real])
        lengths += [int(n) for n in out_lens[:real]]
        if probe is not None:
            probe_logits += [float(z) for z in np.asarray(host_tree(out.last_probe_logit()))[:real]]
    if probe is not None:
        return texts, lengths, probe_logits
    return texts, lengths


def evaluate(params, model_config, tokenizer, task, examples, prompt_width: int, config: EvalConfig,
             system_prompt=None, instruction=None, *, with_details: bool = False, probe=None) -> dict[str, Any]:
    """Greedy accuracy and, when ``config.k > 0``, pass@1 / pass@j / pass@k / maj@k of ``k`` samples per problem.

    ``examples``: held-out :class:`~treejax.data.tasks.Example` s (the first ``config.num_problems`` are used);
    ``prompt_width``: padded prompt width (>= the longest formatted prompt; see :func:`prompt_width_for`);
    ``system_prompt`` / ``instruction``: as in the training loop (None keeps the task's own).

    Returns ``{"accuracy", "mean_length", "n"}`` (greedy; ``n`` = problems evaluated) and, with ``k > 0``,
    ``"k"``, ``"pass@1"``, ``"pass@{j}"`` for ``j = 2, 4, ... < k``, ``"pass@{k}"``, ``"maj@{k}"`` (e.g.
    ``"pass@8"``, ``"maj@8"``), the aliases ``"pass@k"`` / ``"maj@k"`` (same values, for callers that do not know
    ``k``) and ``"sample_mean_length"``. ``with_details=True`` adds ``"problems"``: per problem its uid, question,
    ground truth, greedy text/answer/score/length and the samples' texts/answers/scores/voted answer.
    ``probe`` (``{"w", "b"}``, with ``config.vote_probe``): adds ``"wmaj@{k}"`` / ``"wmaj@k"``, the vote weighted
    by each sample's predicted success (module docstring).
    """
    if not isinstance(config, EvalConfig):
        raise TypeError(f"config must be an EvalConfig, got {type(config).__name__}")
    examples = list(examples)[: config.num_problems]
    if not examples:
        raise ValueError("evaluate: no examples given")
    toks = encode_examples(tokenizer, examples, system_prompt, instruction)
    longest = max(len(t) for t in toks)
    if longest > prompt_width:
        raise ValueError(f"a prompt of {longest} tokens exceeds the prompt width {prompt_width}")
    P = len(examples)

    g_texts, g_lens = _decode(params, model_config, tokenizer, toks, prompt_width, config.max_new_tokens,
                              config.batch_size, Greedy(), jax.random.key(0))
    g_scores = np.array([task.score(t, ex) for t, ex in zip(g_texts, examples)], np.float64)
    result: dict[str, Any] = {"accuracy": float(np.mean(g_scores >= 1.0)), "mean_length": float(np.mean(g_lens)),
                              "n": P}
    details = [{"uid": ex.metadata.get("uid"), "question": ex.metadata.get("question"),
                "ground_truth": ex.ground_truth, "greedy_text": t, "greedy_answer": extract_answer(task, t),
                "greedy_score": float(s), "greedy_length": n}
               for ex, t, s, n in zip(examples, g_texts, g_scores, g_lens)] if with_details else None

    k = config.k
    if config.vote_probe is not None and probe is None:
        raise ValueError(f"EvalConfig.vote_probe = {config.vote_probe!r} but evaluate got no probe")
    if k > 0:
        rows = [t for t in toks for _ in range(k)]
        decoded = _decode(params, model_config, tokenizer, rows, prompt_width, config.max_new_tokens,
                          config.batch_size, Temperature(float(config.temperature)), jax.random.key(config.seed),
                          probe if config.vote_probe is not None else None)
        s_texts, s_lens = decoded[0], decoded[1]
        scores = np.array([task.score(t, examples[r // k]) for r, t in enumerate(s_texts)], np.float64).reshape(P, k)
        answers = [[extract_answer(task, t) for t in s_texts[p * k: (p + 1) * k]] for p in range(P)]
        c = np.sum(scores >= 1.0, axis=1)
        result["k"] = k
        j = 1
        while j < k:
            result[f"pass@{j}"] = float(np.mean(pass_at_k(k, c, j)))
            j *= 2
        result[f"pass@{k}"] = result["pass@k"] = float(np.mean(pass_at_k(k, c, k)))
        maj = maj_at_k(answers, scores)
        result[f"maj@{k}"] = result["maj@k"] = float(np.mean(maj))
        if config.vote_probe is not None:
            w = 1.0 / (1.0 + np.exp(-np.asarray(decoded[2], np.float64).reshape(P, k)))
            result[f"wmaj@{k}"] = result["wmaj@k"] = float(np.mean(maj_at_k(answers, scores, w.tolist())))
        result["sample_mean_length"] = float(np.mean(s_lens))
        if details is not None:
            for p, d in enumerate(details):
                rep = majority_vote(answers[p])
                d.update(sample_answers=answers[p], sample_scores=scores[p].tolist(),
                         voted_answer=None if rep is None else answers[p][rep], maj_correct=bool(maj[p]),
                         sample_texts=s_texts[p * k: (p + 1) * k])
    if details is not None:
        result["problems"] = details
    return result
