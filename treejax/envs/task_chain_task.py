"""Chains of related problems of any single-turn task as the treejax task ``"task_chain"`` (the episodes are run by
the environment ``"task_chain"``, :mod:`treejax.envs.task_chain`).

``get_task("task_chain", inner="chain_sum_2x2", inner_options={...}, chain_length=3, size=256, eval_size=32)``:
the inner task is built with ``inner_options`` (its ``size`` / ``eval_size`` default to ``chain_length`` times the
chain's, when the inner task takes them), and each split's chains are cut from the inner task's same split, so
train and eval chains never share a problem when the inner task's splits do not.

**Families and chains** (deterministic from ``seed``). A problem's family is its metadata value under ``family``:
``"auto"`` takes ``"template"`` (the generated tasks: ``retrieval_multihop``, ``shell_files``) or else
``"rg_dataset"`` (a reasoning-gym dataset, one family), any other string names a metadata key, ``None`` puts every
problem in one family. Per split, each family's problems are permuted by ``np.random.default_rng([seed, split])``
and cut into consecutive chains of ``chain_length`` (a remainder shorter than a chain is dropped); the families'
chains are then interleaved in turn (families in sorted order) and the first ``size`` (``eval_size``) kept. Too few
problems is a :class:`~treejax.errors.DataError` with the counts and the fix.

**The record** of a chain: ``question`` is problem 1's question after :data:`~treejax.envs.task_chain.HEADER`
(so the prompt is the header, problem 1 and the inner task's instruction), ``answer`` problem 1's answer, and
``metadata["links"]`` the ``chain_length`` inner records in order (``metadata["family"]`` their family). As a
single-turn task (the plain greedy evaluation) a response is scored as an answer to problem 1.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from typing import Optional

import numpy as np

from treejax.data.splits import check_split
from treejax.data.task_base import Example, Task, register_task
from treejax.envs.task_chain import FEEDBACK, HEADER, NEXT_FORMAT
from treejax.errors import DataError

#: ``system_prompt`` / ``instruction`` default: the inner task's own.
INNER = "inner"


def _accepts(factory, name: str) -> bool:
    params = inspect.signature(factory).parameters.values()
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def family_of(metadata: dict, family: Optional[str]) -> str:
    """A problem's family (module docstring); a :class:`DataError` when ``family`` names a key it lacks."""
    if family is None:
        return ""
    if family == "auto":
        return str(metadata.get("template", metadata.get("rg_dataset", "")))
    if family not in metadata:
        raise DataError(f"task_chain: family {family!r} is not a metadata key of the inner task's problems (they "
                        f"have {sorted(metadata)}); fix: RunConfig.task_options['family'] = 'auto'")
    return str(metadata[family])


def cut_chains(families: list[str], chain_length: int, rng: np.random.Generator) -> list[list[int]]:
    """Chains of problem indices (module docstring): per family (sorted), a permutation cut into consecutive
    chains of ``chain_length``; the families' chains interleaved in turn."""
    by: dict[str, list[int]] = {}
    for i, f in enumerate(families):
        by.setdefault(f, []).append(i)
    per = []
    for f in sorted(by):
        idx = np.asarray(by[f])[rng.permutation(len(by[f]))]
        starts = range(0, len(idx) - chain_length + 1, chain_length)
        per.append([list(map(int, idx[j:j + chain_length])) for j in starts])
    out = []
    for r in range(max(map(len, per), default=0)):
        out += [chains[r] for chains in per if r < len(chains)]
    return out


class TaskChain(Task):
    """Chains of ``chain_length`` problems of one family of the task ``inner`` (module docstring). Episode options
    (read by :class:`~treejax.envs.task_chain.TaskChainEnv`): ``feedback`` (``"answer"``, ``"verdict"``,
    ``"none"``), ``skills`` (a skill library from ``<skill>`` tags) with ``max_skill_chars``, ``next_format`` (the
    observation bringing the next problem: ``{index}``, ``{length}``, ``{question}``), ``stop_strings`` (end a turn:
    ``("</answer>",)`` for reasoning-gym's tags), ``inner_environment`` (each problem an episode of that
    environment, e.g. ``"shell"`` for ``shell_files``; ``None``: one answer turn per problem). ``inner``: a task
    name (build the chain with ``get_task("task_chain", ...)``, which loads the built-in tasks) or a :class:`Task`
    instance (Python use)."""

    eval_options = "give task_options eval_size=N (> 0) for N held-out chains"
    world = "task_chain"  # the environment 'task_chain' runs this task's chains

    def __init__(self, *, inner="chain_sum_2x2", inner_options: Optional[dict] = None, chain_length: int = 3,
                 size: int = 256, eval_size: int = 32, seed: int = 0, family: Optional[str] = "auto",
                 feedback: str = "answer", skills: bool = False, max_skill_chars: int = 200,
                 inner_environment: Optional[str] = None, stop_strings: tuple = (), header: str = HEADER,
                 next_format: str = NEXT_FORMAT, system_prompt: Optional[str] = INNER,
                 instruction: Optional[str] = INNER, name: str = "task_chain"):
        if chain_length < 2:
            raise DataError(f"task_chain: chain_length must be >= 2, got {chain_length} (a chain of one problem is "
                            f"the inner task itself); fix: RunConfig.task_options['chain_length'] = 2")
        if size < 0 or eval_size < 0 or size + eval_size == 0:
            raise DataError(f"task_chain: size, eval_size >= 0 and size + eval_size > 0 required, got {size}, "
                            f"{eval_size}")
        if feedback not in FEEDBACK:
            raise DataError(f"task_chain: feedback must be one of {FEEDBACK}, got {feedback!r}; fix: "
                            "RunConfig.task_options['feedback'] = 'answer'")
        if max_skill_chars < 1:
            raise DataError(f"task_chain: max_skill_chars must be >= 1, got {max_skill_chars}")
        try:
            next_format.format(index=2, length=3, question="q")
            header.format(length=3)
        except (KeyError, IndexError, ValueError) as e:
            raise DataError(f"task_chain: header takes {{length}} and next_format {{index}}, {{length}}, {{question}}"
                            f" only, got {header!r}, {next_format!r} ({type(e).__name__}: {e})") from None
        if inner_environment is not None:
            from treejax.envs.base import env_names

            if inner_environment not in env_names() or inner_environment == "task_chain":
                raise DataError(f"task_chain: inner_environment must be one of "
                                f"{tuple(n for n in env_names() if n != 'task_chain')} or None, got "
                                f"{inner_environment!r}")
        self.inner = inner if isinstance(inner, Task) else self._build_inner(inner, dict(inner_options or {}),
                                                                             chain_length, size, eval_size)
        if getattr(self.inner, "world", None) == "task_chain":
            raise DataError("task_chain: the inner task is itself a chain; fix: a single-turn inner task "
                            "(RunConfig.task_options['inner'])")
        self.chain_length, self.size, self.eval_size = chain_length, size, eval_size
        self.seed, self.family = seed, family
        self.feedback, self.skills, self.max_skill_chars = feedback, bool(skills), max_skill_chars
        self.inner_environment, self.stop_strings = inner_environment, tuple(stop_strings)
        self.header, self.next_format, self.name = header, next_format, name
        self.system_prompt = self.inner.system_prompt if system_prompt == INNER else system_prompt
        self.instruction = self.inner.instruction if instruction == INNER else instruction

    @staticmethod
    def _build_inner(name: str, options: dict, chain_length: int, size: int, eval_size: int) -> Task:
        from treejax.data.task_base import TASKS, build_task

        if name == "task_chain":
            raise DataError("task_chain: the inner task is itself a chain; fix: a single-turn inner task "
                            "(RunConfig.task_options['inner'])")
        factory = TASKS.get(name)  # registered: get_task('task_chain', ...) loaded the built-in tasks first
        for key, n in (("size", size), ("eval_size", eval_size)):
            if _accepts(factory, key):
                options.setdefault(key, n * chain_length)
        return build_task(name, **options)

    def __repr__(self) -> str:
        return f"TaskChain(inner={self.inner.name!r}, chain_length={self.chain_length})"

    @functools.lru_cache(maxsize=2)
    def records(self, split: str) -> list[dict[str, str]]:
        split = check_split(split)
        want = self.size if split == "train" else self.eval_size
        if want == 0:
            return []
        inner = self.inner.records(split)
        families = [family_of(json.loads(r["metadata"]), self.family) for r in inner]
        chains = cut_chains(families, self.chain_length, np.random.default_rng([self.seed, split == "train"]))
        if len(chains) < want:
            raise DataError(f"task_chain: the inner task {self.inner.name!r} has {len(inner)} {split} problems in "
                            f"{len(set(families))} families, which make {len(chains)} chains of {self.chain_length}, "
                            f"and {want} are asked; fix: a larger inner size (RunConfig.task_options['inner_options']"
                            f") or a smaller {'size' if split == 'train' else 'eval_size'}")
        out = []
        for c in chains[:want]:
            links = [inner[i] for i in c]
            uid = hashlib.sha256(("chain-v1\0" + "\0".join(r["uid"] for r in links)).encode()).hexdigest()[:16]
            meta = {"links": links, "family": families[c[0]], "chain_length": self.chain_length}
            out.append({"uid": uid, "question": self.header.format(length=self.chain_length) + links[0]["question"],
                        "answer": links[0]["answer"], "metadata": json.dumps(meta)})
        return out

    def link_examples(self, example: Example) -> tuple[Example, ...]:
        """The chain's problems as the inner task's examples, in order."""
        return tuple(self.inner.make_example(r) for r in example.metadata["links"])

    def score(self, response_text: str, example: Example) -> float:
        """The inner verifier's score of the response as an answer to problem 1 (the single-turn view)."""
        return float(self.inner.score(response_text, self.link_examples(example)[0]))


register_task("task_chain", TaskChain)

__all__ = ["INNER", "TaskChain", "cut_chains", "family_of"]
