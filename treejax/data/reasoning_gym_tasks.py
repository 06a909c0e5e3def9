"""reasoning-gym procedural datasets as seeded, verifiable tasks scored by reasoning-gym's own scorers.

``get_task("reasoning_gym", dataset="chain_sum", size=1000, seed=0, min_terms=2, max_terms=2)`` or, equivalently,
``get_task("chain_sum", size=1000, seed=0, min_terms=2, max_terms=2)``: keyword arguments that are not task
options go to the dataset's reasoning-gym config class (unknown ones are an error listing the valid fields).

**Generation and splits.** One reasoning-gym dataset object is built with ``rg_seed = reasoning_gym_seed(seed)``
(0 for seed 0; task seeds are spread ~5e8 apart, so different seeds give disjoint problem streams) and
``scan_size`` items (item ``i`` is generated from ``Random(rg_seed + i)``). Items are scanned in index order and
assigned to a split by the content hash of their question (``treejax.data.splits.split_of(question,
eval_fraction)``): train takes the first ``size`` train-bucket items, eval the first ``eval_size`` eval-bucket
items, each without repeated questions (``dedupe=True``). Train and eval therefore never share a question, for any
seeds. If the dataset's config has too few distinct problems to fill a split, construction fails with the counts
found.

**Scoring.** The response's answer is extracted (``extraction="tags"``: the last ``<answer>..</answer>``, exactly
reasoning-gym's ``extract_answer``; other modes from ``treejax.data.verifiers.EXTRACTION_MODES``), the original
entry is regenerated from its index and reasoning-gym's ``score_answer(answer, entry)`` gives a raw score
``r in [0, 1]``. reasoning-gym gives partial credit to some wrong answers (e.g. the base class returns
``len(oracle) / len(answer)`` when the oracle is a substring, 0.01 elsewhere), so the task's score is
``1 if r >= correct_threshold - 1e-9 else (r if partial_credit else 0)`` with ``correct_threshold=1.0`` by default.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from typing import Any, Optional

from treejax.choices import closest_first
from treejax.data import verifiers
from treejax.data.splits import check_split, question_uid, split_of
from treejax.data.task_base import Example, Task, register_task
from treejax.errors import DataError

__all__ = ["DEFAULT_SYSTEM_PROMPT", "EASY_PRESETS", "ReasoningGymTask", "reasoning_gym_seed"]

# reasoning-gym's SYSTEM_PROMPTS["default"], copied so that prompts don't change if the package changes it.
DEFAULT_SYSTEM_PROMPT = (
    "Given a problem, your task is to answer the question by thinking step-by-step in a clear and specific manner.\n"
    "Once you have thought about the reasoning process, provide the answer in the following format:\n"
    "<answer>answer here</answer>\n"
    "Do not explain your reasoning inside the answer tags, provide only the final answer. When an example is "
    "provided, you should strictly follow the format of the output/answer in that example."
)

# Easy configurations, candidates for a 10-60% success rate of a ~135M instruct model (to be measured).
EASY_PRESETS: dict[str, dict[str, Any]] = {
    # "State the final answer to the following arithmetic problem: 4 - 1 =" (single digits, + or -).
    "chain_sum_2x1": dict(dataset="chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    # Two 2-digit terms, + or -.
    "chain_sum_2x2": dict(dataset="chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=2),
    # Three single-digit terms.
    "chain_sum_3x1": dict(dataset="chain_sum", min_terms=3, max_terms=3, min_digits=1, max_digits=1),
    # "Calculate 5 + 3." — basic_arithmetic without *, /, parentheses or negation.
    "basic_arithmetic_easy": dict(
        dataset="basic_arithmetic", min_terms=2, max_terms=2, min_digits=1, max_digits=1,
        operators=("+", "-"), allow_parentheses=False, allow_negation=False,
    ),
    # Single-digit products "Solve the following multiplication: 7 * 8."
    "products_1x1": dict(dataset="products", min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    # "how many legs ... 2 cats, 1 spider": 1-2 animals, 1-3 of each.
    "leg_counting_easy": dict(dataset="leg_counting", min_animals=1, max_animals=2, min_instances=1, max_instances=3),
}


#: Multiplier of :func:`reasoning_gym_seed` (odd, ~0.618 * 2**32: consecutive task seeds land ~5e8 apart).
_SEED_STRIDE = 0x9E3779B1


def reasoning_gym_seed(seed: int) -> int:
    """reasoning-gym's generator seed for task seed ``seed``: ``seed * 0x9E3779B1 mod 2**31`` (0 maps to 0, so
    every config with ``seed = 0`` keeps its problems).

    reasoning-gym builds item ``i`` from ``Random(rg_seed + i)``, so two task seeds share items only where their
    windows ``[rg_seed, rg_seed + scan_size)`` overlap: never for scan sizes below ~5e8 between consecutive
    seeds, and with probability ``~2 scan_size / 2**31`` for arbitrary ones. The problems can still coincide
    where the dataset's question space is small (``chain_sum_2x1`` has ~160 distinct questions).
    """
    return (int(seed) * _SEED_STRIDE) % (1 << 31)


class ReasoningGymTask(Task):
    """A reasoning-gym dataset as a ``Task`` (see module docstring).

    Args:
      dataset: reasoning-gym dataset name (``reasoning_gym.factory.DATASETS``).
      size / eval_size: number of train / eval problems.
      seed: the task seed; reasoning-gym's generator seed is :func:`reasoning_gym_seed` of it (0 -> 0), so
        different seeds give disjoint problem streams (reasoning-gym builds item ``i`` from
        ``Random(rg_seed + i)``: passing the seed through made ``seed=7`` seed 0's problems shifted by 7 items).
      rg_seed: reasoning-gym's own seed, used as given instead of the derived one (``rg_seed=7`` reproduces what
        ``seed=7`` gave before the derivation).
      eval_fraction: fraction of the question space hashed into eval.
      scan_size: number of generator indices scanned (default: enough for both splits with a 2x margin).
      dedupe: no question repeated within a split.
      system_prompt / instruction: prompt parts (default: reasoning-gym's default system prompt; no instruction).
      extraction: answer extraction mode (``"tags"`` = reasoning-gym convention).
      correct_threshold / partial_credit: mapping of reasoning-gym's raw score (see module docstring).
      name: task name (default ``"reasoning_gym/<dataset>"``).
      **dataset_config: fields of the dataset's reasoning-gym config class.
    """

    eval_options = "give task_options eval_size=N (> 0) for N held-out problems"

    def __init__(
        self,
        dataset: str,
        *,
        size: int = 1000,
        eval_size: int = 100,
        seed: int = 0,
        rg_seed: Optional[int] = None,
        eval_fraction: float = 0.2,
        scan_size: Optional[int] = None,
        dedupe: bool = True,
        system_prompt: Optional[str] = DEFAULT_SYSTEM_PROMPT,
        instruction: Optional[str] = None,
        extraction: str = "tags",
        correct_threshold: float = 1.0,
        partial_credit: bool = False,
        name: Optional[str] = None,
        **dataset_config: Any,
    ):
        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        if dataset not in DATASETS:
            close = difflib.get_close_matches(dataset, DATASETS, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise DataError(f"unknown reasoning-gym dataset {dataset!r}{hint} ({len(DATASETS)} valid names: "
                            "sorted(reasoning_gym.factory.DATASETS))")
        if size < 0 or eval_size < 0:
            raise DataError(f"size and eval_size must be >= 0, got {size}, {eval_size}")
        if not 0.0 < eval_fraction < 1.0 and not (eval_size == 0 and eval_fraction == 0.0):
            raise DataError(f"eval_fraction must lie in (0, 1) (or be 0 with eval_size=0), got {eval_fraction!r}")
        if extraction not in verifiers.EXTRACTION_MODES:
            raise DataError(f"unknown extraction {extraction!r}; valid (closest first): "
                            f"{closest_first(extraction, sorted(verifiers.EXTRACTION_MODES))}")
        if not 0.0 < correct_threshold <= 1.0:
            raise DataError(f"correct_threshold must lie in (0, 1], got {correct_threshold!r}")
        config_cls = DATASETS[dataset][1]
        valid_fields = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
        unknown = sorted(set(dataset_config) - valid_fields)
        if unknown:
            raise DataError(
                f"unknown config field(s) {unknown} for reasoning-gym dataset {dataset!r}; "
                f"valid fields: {sorted(valid_fields)} (task options: size, eval_size, seed, eval_fraction, "
                "rg_seed, scan_size, dedupe, system_prompt, instruction, extraction, correct_threshold, "
                "partial_credit, name)"
            )
        if scan_size is None:
            need_train = size / max(1.0 - eval_fraction, 1e-9)
            need_eval = eval_size / eval_fraction if eval_size else 0.0
            scan_size = int(math.ceil(2.0 * max(need_train, need_eval))) + 16
        self.dataset_name = dataset
        self.dataset_config = dict(dataset_config)
        self.size, self.eval_size, self.seed = size, eval_size, seed
        self.eval_fraction, self.scan_size, self.dedupe = eval_fraction, scan_size, dedupe
        self.system_prompt, self.instruction, self.extraction = system_prompt, instruction, extraction
        self.correct_threshold, self.partial_credit = correct_threshold, partial_credit
        self.name = name or f"reasoning_gym/{dataset}"
        self.rg_seed = reasoning_gym_seed(seed) if rg_seed is None else rg_seed
        self._dataset = reasoning_gym.create_dataset(dataset, seed=self.rg_seed, size=scan_size, **dataset_config)
        self._records: Optional[dict[str, list[dict[str, str]]]] = None

    def _generate(self) -> dict[str, list[dict[str, str]]]:
        wanted = {"train": self.size, "eval": self.eval_size}
        out: dict[str, list[dict[str, str]]] = {"train": [], "eval": []}
        seen: dict[str, set[str]] = {"train": set(), "eval": set()}
        for idx in range(self.scan_size):
            if all(len(out[s]) >= wanted[s] for s in out):
                break
            entry = self._dataset[idx]
            question = entry["question"]
            split = split_of(question, self.eval_fraction)
            if len(out[split]) >= wanted[split] or (self.dedupe and question in seen[split]):
                continue
            seen[split].add(question)
            metadata = {"rg_dataset": self.dataset_name, "rg_index": idx, "rg_seed": self.rg_seed}
            out[split].append(
                {"uid": question_uid(question), "question": question, "answer": str(entry["answer"]),
                 "metadata": json.dumps(metadata)}
            )
        for split, recs in out.items():
            if len(recs) < wanted[split]:
                raise DataError(
                    f"{self.name}: found only {len(recs)} {'distinct ' if self.dedupe else ''}{split} problems in "
                    f"{self.scan_size} generated items, {wanted[split]} requested; the config "
                    f"{self.dataset_config} may have too few distinct problems: lower size/eval_size, raise "
                    "scan_size, or pass dedupe=False"
                )
        return out

    def records(self, split: str) -> list[dict[str, str]]:
        check_split(split)
        if self._records is None:
            self._records = self._generate()
        return self._records[split]

    def entry(self, example: Example) -> dict:
        """The original reasoning-gym entry of an example, regenerated from its index."""
        idx = example.metadata.get("rg_index")
        if idx is None or example.metadata.get("rg_dataset") != self.dataset_name:
            raise ValueError(f"example {example.metadata.get('uid')} does not come from {self.name}")
        entry = self._dataset[int(idx)]
        if entry["question"] != example.metadata["question"]:
            raise ValueError(
                f"{self.name}: item {idx} regenerated a different question; the example was made with another "
                f"seed/config (example rg_seed {example.metadata.get('rg_seed')}, task rg_seed {self.rg_seed})"
            )
        return entry

    def raw_score(self, response_text: str, example: Example) -> float:
        """reasoning-gym's own score of the extracted answer (may be partial credit)."""
        answer = verifiers.extract_answer(response_text, self.extraction)
        return float(self._dataset.score_answer(answer, self.entry(example)))

    def score(self, response_text: str, example: Example) -> float:
        raw = self.raw_score(response_text, example)
        if raw >= self.correct_threshold - 1e-9:
            return 1.0
        return min(max(raw, 0.0), 1.0) if self.partial_credit else 0.0


def _register() -> None:
    from reasoning_gym.factory import DATASETS

    register_task("reasoning_gym", ReasoningGymTask)
    for ds_name in DATASETS:
        register_task(ds_name, lambda _d=ds_name, **cfg: ReasoningGymTask(_d, **cfg))
    for preset, preset_cfg in EASY_PRESETS.items():

        def factory(_p=preset, _cfg=preset_cfg, **cfg):
            merged = {**_cfg, **cfg}
            merged.setdefault("name", f"reasoning_gym/{_p}")
            return ReasoningGymTask(**merged)

        register_task(preset, factory)


_register()
