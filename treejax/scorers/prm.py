"""A process reward model from a judge: per-step scores of a response in ONE teacher-forced pass.

The scheme (Math-Shepherd's step tag, read with the judge's verdict tokens): the input is the scorer's chat
template around ``step_template`` (the question), the assistant turn opened, then the response's steps, each
followed by ``step_tag``::

    [user: step_template(question)] [assistant:] step_1 TAG step_2 TAG ... step_S TAG

The score of step ``k`` is ``p(yes) / (p(yes) + p(no))`` of the next-token distribution at the last token of the
``k``-th tag. Causal attention makes it a function of ``step_1 TAG ... step_k TAG`` alone, so one pass over the
whole sequence gives the same numbers as re-running the model on each prefix (``tests/scorers/test_prm.py``
checks it against that loop); earlier steps keep their tags in the context, as a PRM trained with step tags
sees them. Each step is tokenized on its own (the tag boundaries are token boundaries).

Steps: :func:`line_steps` (non-empty lines of the text) or :func:`segment_steps` (the tree's fixed segments of
policy tokens, decoded one by one); a multi-turn caller passes its turns. Rows longer than ``max_length`` drop
their last steps (scored ``NaN``)."""

from __future__ import annotations

import numpy as np

from treejax.scorers.judge import chat_ids, pad_rows, verdict_logprobs_at
from treejax.scorers.model import Scorer


def line_steps(text: str) -> list[str]:
    """The non-empty lines of ``text``, each with its newline (the last one without)."""
    lines = text.split("\n")
    out = [line + "\n" for line in lines[:-1]] + [lines[-1]]
    return [s for s in out if s.strip()]


def segment_steps(tokenizer, tokens, length: int, segment_length: int) -> list[str]:
    """The texts of a leaf's fixed segments of ``segment_length`` policy tokens (the tree's node boundaries)."""
    ids = [int(t) for t in tokens[:length]]
    return [tokenizer.decode(ids[i:i + segment_length], skip_special_tokens=True)
            for i in range(0, len(ids), segment_length)]


def step_row(scorer: Scorer, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
    """``(ids, tag_ends)``: the PRM's input for one response and the position of each step's tag end (steps that
    do not fit in ``max_length`` are left out)."""
    cfg, tok = scorer.config, scorer.tokenizer
    ids = chat_ids(scorer, cfg.step_template.format(question=question))
    tag = tok.encode(cfg.step_tag)
    ends = []
    for step in steps:
        piece = tok.encode(step) + tag
        if len(ids) + len(piece) > cfg.max_length:
            break
        ids += piece
        ends.append(len(ids) - 1)
    return ids, ends


def step_scores(scorer: Scorer, questions, steps_lists) -> np.ndarray:
    """float32 ``[N, S]`` (``S`` the most steps of any response): each step's score, ``NaN`` past a response's
    steps; ``batch_size`` responses per forward."""
    built = [step_row(scorer, q, s) for q, s in zip(questions, steps_lists)]
    S = max([len(s) for s in steps_lists] + [1])
    out = np.full((len(built), S), np.nan, np.float32)
    bs = scorer.config.batch_size
    for i in range(0, len(built), bs):
        chunk = built[i:i + bs]
        tokens, lengths = pad_rows([ids for ids, _ in chunk], bs, scorer.pad_id)
        gather = np.zeros((bs, S), np.int32)
        for j, (_, ends) in enumerate(chunk):
            gather[j, : len(ends)] = ends
        ly, ln = verdict_logprobs_at(scorer.params, *scorer.place_rows(tokens, lengths, gather),
                                     model_config=scorer.model_config, yes_ids=scorer.yes_ids, no_ids=scorer.no_ids)
        p = 1.0 / (1.0 + np.exp(-np.asarray(ly - ln, np.float32)))
        for j, (_, ends) in enumerate(chunk):
            out[i + j, : len(ends)] = p[j, : len(ends)]
    return out
