"""In-context exemplars for prompts whose rollouts all fail (XRPO, arXiv 2510.06672, §3.2).

A prompt whose ``W`` rollouts are all wrong gives GRPO no signal (every advantage is 0), and dynamic sampling
would just drop it. XRPO instead re-rolls it with a solved example in its context: :class:`ExemplarRollouts`
rolls out the step's ``P`` prompts as usual, and every prompt with no correct leaf is rolled out again with
``shots`` earlier solved problems put before it as chat turns (``user``: that problem as the task asks it,
``assistant``: a response the verifier accepted), in one more sampler call. The exemplar-conditioned rollouts
replace the failed ones in the batch: their tokens, log-probs and rewards are those of the policy given the
longer prompt, which is the prompt the learner then reads (the update conditions on the same context the tokens
were sampled in, so the ratio and the importance weights stay exact).

The exemplar bank holds the last ``bank_size`` solved problems of earlier steps (the first correct leaf of each
plain-prompt row with one; a question at most once, newest kept). For a failed prompt the exemplars are the
``shots`` bank entries most similar to its question (cosine of hashed character 3-gram counts,
:func:`treejax.rl.selection.ngram_embeddings`; XRPO retrieves by similarity as well, its encoder is not public), never
the question itself.

Static shapes: every row of every step is padded to ``prompt_width`` (default twice the run's prompt width), so the
update compiles once; a failed prompt whose exemplar prompt does not fit is left as it was (``exemplars/too_long``).

Not built: XRPO's novelty sharpening of low-likelihood correct answers (its exact form is not public).

Metrics: ``exemplars/injected`` (rows re-rolled with exemplars), ``exemplars/rescued`` (of those, rows with a
correct leaf), ``exemplars/too_long``, ``exemplars/bank_size``. The bank is saved in the checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import numpy as np

from treejax.data.prompts import encode_examples, pad_token_lists
from treejax.errors import ConfigError
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import VERIFIER

EXEMPLAR_STREAM = 0xE7E  # fold_in stream of the exemplar re-roll


@dataclasses.dataclass(frozen=True)
class ExemplarConfig(Stage):
    """XRPO's exemplar injection (module docstring): ``shots`` exemplars per failed prompt, a bank of the last
    ``bank_size`` solved problems, every row padded to ``prompt_width`` tokens (0: twice the run's prompt width),
    ``dim`` buckets of the retrieval embedding."""

    shots: int = 1
    bank_size: int = 64
    prompt_width: int = 0
    dim: int = 1024

    role: ClassVar[str] = "planner"  # it re-rolls a step's failed prompts with exemplars
    requires: ClassVar[tuple] = (VERIFIER,)

    def build(self, inner, ctx):
        return ExemplarRollouts(ctx.task_rollouts(), self)

    def __post_init__(self):
        if self.shots < 1 or self.bank_size < self.shots or self.prompt_width < 0 or self.dim < 8:
            raise ConfigError(f"ExemplarConfig: shots >= 1, bank_size >= shots, prompt_width >= 0 and dim >= 8 "
                              f"required, got {self}")


def with_exemplars(example, exemplars: list[dict]):
    """``example`` with ``exemplars`` (``{"user": ..., "assistant": ...}``) as chat turns before its question (after
    its system message, if any)."""
    msgs = list(example.prompt_messages)
    head = msgs[:1] if msgs and msgs[0]["role"] == "system" else []
    turns = [m for e in exemplars for m in ({"role": "user", "content": e["user"]},
                                            {"role": "assistant", "content": e["assistant"]})]
    return dataclasses.replace(example, prompt_messages=head + turns + msgs[len(head):])


def retrieve(query: str, bank: list[dict], shots: int, dim: int, exclude_key: str) -> list[dict]:
    """The ``shots`` bank entries most similar to ``query`` (ties: the newest), never the one keyed ``exclude_key``."""
    from treejax.rl.selection import ngram_embeddings

    pool = [e for e in bank if e["key"] != exclude_key]
    if not pool:
        return []
    emb = ngram_embeddings([query] + [e["question"] for e in pool], dim)
    sim = emb[1:] @ emb[0]
    order = np.lexsort((-np.arange(len(pool)), -sim))  # most similar first, then the newest
    return [pool[i] for i in order[:shots]]


class ExemplarRollouts:
    """The loop's source with XRPO's exemplar injection (module docstring). ``base``: :class:`TaskRollouts`."""

    def __init__(self, base, config: ExemplarConfig):
        self.base, self.config = base, config
        self.pipeline = base.pipeline
        self.estimator_inputs = base.estimator_inputs
        self.width = config.prompt_width or 2 * base.prompt_width
        if self.width < base.prompt_width:
            raise ConfigError(f"ExemplarConfig.prompt_width = {config.prompt_width} is narrower than the run's prompts "
                              f"({base.prompt_width} tokens)")
        self.bank: list[dict] = []  # oldest first: {"key", "question", "user", "assistant"}

    def _user_turn(self, example) -> str:
        """The example's question as the rollout asked it (its last user message, the run's instruction added)."""
        text = [m for m in example.prompt_messages if m["role"] == "user"][-1]["content"]
        instruction = self.base.cfg.instruction
        return f"{text}\n\n{instruction}" if instruction else text

    def _pad(self, out):
        prompts = np.asarray(out.prompts)
        wide = np.full((prompts.shape[0], self.width), self.base.pad_id, np.int32)
        wide[:, :prompts.shape[1]] = prompts
        return dataclasses.replace(out, prompts=wide)

    def sample(self, params, key, step):
        from treejax.rl import allocation as alloc
        from treejax.rl.allocation.base import prompt_stats
        from treejax.rl.rollouts import assemble_rows, row_block

        b, cfg = self.base, self.config
        examples, prompts, lens = b.draw()
        first = self._pad(b.roll_and_score(params, examples, prompts, lens, jax.random.fold_in(key, 0), step))
        P = len(examples)
        acc = prompt_stats(first, step).accuracy_P
        keys = [alloc.prompt_key(e) for e in examples]
        failed, too_long, new_ex, new_toks = [], 0, [], []
        for p in np.nonzero(acc <= 0)[0]:
            shots = retrieve(alloc.example_text(examples[p]), self.bank, cfg.shots, cfg.dim, keys[p])
            if not shots:
                continue
            ex = with_exemplars(examples[p], shots)
            toks = encode_examples(b.tokenizer, [ex], b.cfg.system_prompt, b.cfg.instruction)[0]
            if len(toks) > self.width:
                too_long += 1
                continue
            failed.append(int(p))
            new_ex.append(ex)
            new_toks.append(toks)
        counters, rescued = first.counters, 0
        second = None
        if failed:
            pad = P - len(failed)  # a fixed-size call: the unused rows are copies of the first re-rolled prompt
            toks, tlens = pad_token_lists(new_toks + [new_toks[0]] * pad, self.width, b.pad_id)
            second = b.roll_and_score(params, new_ex + [new_ex[0]] * pad, toks, tlens,
                                      jax.random.fold_in(key, EXEMPLAR_STREAM), step)
            counters = counters + second.counters
            rescued = int(np.sum(prompt_stats(second, step).accuracy_P[:len(failed)] > 0))
        # a failed row is replaced by its re-roll, in place
        blocks = [row_block(second, np.array([failed.index(p)])) if p in failed else row_block(first, np.array([p]))
                  for p in range(P)] if failed else [row_block(first, np.arange(P))]
        ro = assemble_rows(blocks, counters)
        self._remember(first, examples, keys)
        ro.counters = dataclasses.replace(ro.counters, rollout_calls=1 + bool(failed))
        ro.extra_metrics = {"exemplars/injected": len(failed), "exemplars/rescued": rescued,
                            "exemplars/too_long": too_long, "exemplars/bank_size": len(self.bank)}
        return ro

    def _remember(self, out: tuple, examples, keys) -> None:
        """The bank takes the first correct leaf of each plain-prompt row that has one."""
        from treejax.parallel import multihost
        from treejax.rl import scoring
        from treejax.rl.allocation import example_text

        forest, leaf_inputs = out.forest, out.leaf_inputs
        correct = np.asarray(leaf_inputs["reward_scores"]) >= 1.0
        rows = np.nonzero(correct.any(axis=1))[0]
        if not len(rows):
            return
        tokens, lengths = multihost.host_tree((forest.tokens, forest.leaf_length))
        for p in rows:
            w = int(np.argmax(correct[p]))
            text = scoring.decode_texts(self.base.tokenizer, np.asarray(tokens)[p, w:w + 1],
                                        np.asarray(lengths)[p, w:w + 1])[0]
            self.bank = [e for e in self.bank if e["key"] != keys[p]]
            self.bank.append({"key": keys[p], "question": example_text(examples[p]),
                              "user": self._user_turn(examples[p]), "assistant": text})
        self.bank = self.bank[-self.config.bank_size:]

    def checkpoint_state(self) -> dict:
        return {**self.base.checkpoint_state(), "exemplar_bank": [dict(e) for e in self.bank]}

    def restore_state(self, data_state: dict) -> None:
        self.base.restore_state(data_state)
        self.bank = [dict(e) for e in data_state.get("exemplar_bank", [])]


__all__ = ["ExemplarConfig", "ExemplarRollouts", "retrieve", "with_exemplars"]
