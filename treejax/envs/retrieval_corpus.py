"""A procedurally generated world of linked facts and its multi-hop questions, for the retrieval environment
(:mod:`treejax.envs.retrieval`).

The world (:func:`generate_world`, deterministic from a seed): made-up countries, cities (each in a country; one
per country is its capital), people (born in a city, in a year, with an occupation) and companies (founded by a
person, in a year, headquartered in a city, in an industry). Every entity has one document, titled by its name;
a fact is written only in the document of the entity it is about, and a link points one way (a company's document
names its founder and its headquarters city, never the founder's birthplace; a person's document names the city,
never its country). Every name word is unique in the world, so the name finds its own document.

Questions (one of each template per company), with the lookups that answer them:

* ``founder_birthplace`` (2 lookups): "In which city was the founder of Velor Systems born?" -- search the
  company (the founder's name), then the founder (the city);
* ``hq_country`` (2 lookups): "In which country are the headquarters of Velor Systems?" -- the company (the city),
  then the city (the country);
* ``founder_country`` (3 lookups): "In which country was the founder of Velor Systems born?" -- the company, the
  founder, the city;
* ``founding_age`` (2 lookups and a calculation): "How old was the founder of Velor Systems when it was
  founded?" -- the company (founder, year), the founder (birth year), then ``year - birth year``.

Each question ships its reference tool calls (``metadata["reference_calls"]``: ``[{"name": "search", "args":
{"query": <entity name>}}, ..., {"name": "calculate", "args": {"expression": "1987 - 1950"}}]``), the ground truth
for MatchTIR's matching rewards (:mod:`treejax.rl.tool_match`). The answer is never in the question or in the
first document: without search a policy can only guess (:func:`guess_baseline` measures the best fixed guess).

:class:`RetrievalTask` (registered as ``"retrieval_multihop"``) is the questions as a treejax task: train and eval
questions are about disjoint companies of one world (the corpus holds them all); the verifier compares the last
``Answer:`` line (else the last line) with the truth after normalisation (case, punctuation, articles, spaces).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
from typing import Optional

import numpy as np

from treejax.data.splits import check_split
from treejax.data.task_base import Example, Task, check_generated_task_options, register_task
from treejax.errors import DataError

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr", "vel")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "n", "r", "s", "l", "th", "x", "nd")
INDUSTRIES = ("software", "shipping", "mining", "textile", "food", "energy", "robotics", "publishing")
OCCUPATIONS = ("engineer", "painter", "chemist", "teacher", "pilot", "architect", "farmer", "composer")
COMPANY_SUFFIXES = ("Systems", "Works", "Group", "Industries", "Labs", "Holdings")
#: Question templates: name -> (question format, lookups before the answer).
TEMPLATES = {
    "founder_birthplace": ("In which city was the founder of {company} born?", 2),
    "hq_country": ("In which country are the headquarters of {company}?", 2),
    "founder_country": ("In which country was the founder of {company} born?", 3),
    "founding_age": ("How old was the founder of {company} when {company} was founded (in whole years)?", 2),
}
INSTRUCTION = ("You can search an encyclopedia: write a query between <search> and </search> and the best matching "
               "documents come back between <output> and </output>; you can compute with <calculate>expression"
               "</calculate>. When you know the answer, reply without a tool call and give the final answer on the "
               "last line as 'Answer: <answer>'.")


@dataclasses.dataclass(frozen=True)
class Document:
    """One encyclopedia entry: its ``title`` (the entity's name), ``text`` and the entity's ``kind``."""

    title: str
    text: str
    kind: str


@dataclasses.dataclass(frozen=True)
class World:
    """The generated world: its ``documents`` (one per entity, in a fixed order) and the entities' facts
    (``people``: name -> (birth city, birth year, occupation); ``companies``: name -> (founder, year, hq city,
    industry); ``cities``: name -> (country, population); ``countries``: name -> capital)."""

    documents: tuple[Document, ...]
    people: dict
    companies: dict
    cities: dict
    countries: dict


def _words(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` distinct capitalised made-up words of 2-3 syllables."""
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        k = int(rng.integers(2, 4))
        w = "".join(_ONSETS[rng.integers(len(_ONSETS))] + _VOWELS[rng.integers(len(_VOWELS))] +
                    (_CODAS[rng.integers(len(_CODAS))] if i == k - 1 else "") for i in range(k))
        if w not in seen and len(w) >= 4:
            seen.add(w)
            out.append(w.capitalize())
    return out


def _entity_counts(num_companies: int) -> tuple[int, int, int]:
    """``(countries, cities, people)`` of a world with ``num_companies`` companies."""
    cities = max(12, num_companies // 3)
    return max(5, cities // 4), cities, num_companies + max(4, num_companies // 2)


def generate_world(num_companies: int, seed: int = 0) -> World:
    """The world of ``num_companies`` companies (module docstring), deterministic from ``seed``."""
    if num_companies < 1:
        raise DataError(f"generate_world: num_companies must be >= 1, got {num_companies}")
    rng = np.random.default_rng(seed)
    n_countries, n_cities, n_people = _entity_counts(num_companies)
    words = iter(_words(rng, n_countries + n_cities + 2 * n_people + num_companies))
    countries = [next(words) for _ in range(n_countries)]
    city_names = [next(words) for _ in range(n_cities)]
    cities = {c: (countries[i % n_countries], int(rng.integers(20, 900)) * 1000) for i, c in enumerate(city_names)}
    capitals = {k: city_names[i] for i, k in enumerate(countries)}  # city i < n_countries lies in country i
    people = {f"{next(words)} {next(words)}": (city_names[int(rng.integers(n_cities))], int(rng.integers(1900, 1980)),
                                               OCCUPATIONS[int(rng.integers(len(OCCUPATIONS)))])
              for _ in range(n_people)}
    names = list(people)
    founders = [names[i] for i in rng.permutation(n_people)[:num_companies]]
    companies = {}
    for f in founders:
        born = people[f][1]
        companies[f"{next(words)} {COMPANY_SUFFIXES[int(rng.integers(len(COMPANY_SUFFIXES)))]}"] = (
            f, born + int(rng.integers(20, 50)), city_names[int(rng.integers(n_cities))],
            INDUSTRIES[int(rng.integers(len(INDUSTRIES)))])
    docs = [Document(k, f"{k} is a country. Its capital is {capitals[k]}.", "country") for k in countries]
    docs += [Document(c, f"{c} is a city in {k}, with a population of {pop:,}.", "city") for c, (k, pop) in cities.items()]
    docs += [Document(p, f"{p} is a {job}, born in {year} in the city of {city}.", "person")
             for p, (city, year, job) in people.items()]
    docs += [Document(c, f"{c} is a {ind} company founded in {year} by {f}. Its headquarters are in {hq}.", "company")
             for c, (f, year, hq, ind) in companies.items()]
    return World(tuple(docs), people, companies, cities, capitals)


def _search(query: str) -> dict:
    return {"name": "search", "args": {"query": query}}


def company_questions(world: World, company: str) -> list[dict]:
    """The questions about ``company``: dicts with ``question``, ``answer``, ``template``, ``hops`` (the lookups)
    and ``reference_calls`` (module docstring)."""
    founder, year, hq, _ = world.companies[company]
    birth_city, born, _ = world.people[founder]
    out = []
    for name, (fmt, hops) in TEMPLATES.items():
        if name == "founder_birthplace":
            answer, calls = birth_city, [_search(company), _search(founder)]
        elif name == "hq_country":
            answer, calls = world.cities[hq][0], [_search(company), _search(hq)]
        elif name == "founder_country":
            answer, calls = world.cities[birth_city][0], [_search(company), _search(founder), _search(birth_city)]
        else:
            answer = str(year - born)
            calls = [_search(company), _search(founder),
                     {"name": "calculate", "args": {"expression": f"{year} - {born}"}}]
        out.append({"question": fmt.format(company=company), "answer": answer, "template": name, "hops": hops,
                    "company": company, "reference_calls": calls})
    return out


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles (a, an, the), single spaces (SQuAD's normalisation)."""
    text = re.sub(r"[^\w\s]", " ", text.lower())
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def final_answer(response: str) -> str:
    """The text after the last ``Answer:`` of ``response`` (to the end of that line), else its last non-empty line."""
    hits = re.findall(r"answer\s*:\s*(.*)", response, flags=re.I)
    if hits:
        return hits[-1].strip()
    lines = [ln for ln in response.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def guess_baseline(questions: list[dict]) -> float:
    """The accuracy of the best policy that never searches and gives one fixed answer per template (the most
    frequent answer of that template: the best a question-blind guess can do)."""
    by_template: dict[str, list[str]] = {}
    for q in questions:
        by_template.setdefault(q["template"], []).append(q["answer"])
    hit = sum(max(ans.count(a) for a in set(ans)) for ans in by_template.values())
    return hit / max(len(questions), 1)


class RetrievalTask(Task):
    """The multi-hop questions as a task (module docstring). ``size`` / ``eval_size``: questions per split (about
    disjoint companies; one question of each of ``templates`` per company, in a seeded order); ``seed``: the
    world's seed; ``extraction``: ``"answer_line"`` (the only mode: :func:`final_answer`). The corpus of the
    retrieval environment is :attr:`world`'s documents; :attr:`index` is its BM25 index, built once per task."""

    eval_options = "give task_options eval_size=N (> 0) for N held-out questions"

    def __init__(self, *, size: int = 512, eval_size: int = 64, seed: int = 0, templates: Optional[tuple] = None,
                 system_prompt: Optional[str] = None, instruction: Optional[str] = INSTRUCTION,
                 extraction: str = "answer_line", top_k: int = 3, name: str = "retrieval_multihop"):
        templates = check_generated_task_options("retrieval_multihop", templates, TEMPLATES, size, eval_size,
                                                 extraction)
        if top_k < 1:
            raise DataError(f"retrieval_multihop: top_k must be >= 1, got {top_k}")
        self.size, self.eval_size, self.seed, self.templates, self.top_k = size, eval_size, seed, templates, top_k
        self.system_prompt, self.instruction, self.name = system_prompt, instruction, name
        per = len(templates)
        self.train_companies, self.eval_companies = math.ceil(size / per), math.ceil(eval_size / per)
        self.world = generate_world(self.train_companies + self.eval_companies, seed)

    @functools.cached_property
    def index(self):
        """The world's BM25 index (:class:`treejax.envs.retrieval.BM25Index`), built on first use."""
        from treejax.envs.retrieval import BM25Index

        return BM25Index(self.world.documents)

    @functools.lru_cache(maxsize=2)
    def records(self, split: str) -> list[dict[str, str]]:
        companies = list(self.world.companies)
        n = self.train_companies
        chosen = companies[:n] if check_split(split) == "train" else companies[n:]
        qs = [q for c in chosen for q in company_questions(self.world, c) if q["template"] in self.templates]
        order = np.random.default_rng([self.seed, 0 if split == "train" else 1]).permutation(len(qs))
        qs = [qs[i] for i in order][: self.size if split == "train" else self.eval_size]
        out = []
        for q in qs:
            meta = {k: q[k] for k in ("template", "hops", "company", "reference_calls")}
            uid = hashlib.sha256(f"retrieval-v1\0{self.seed}\0{q['question']}".encode()).hexdigest()[:16]
            out.append({"uid": uid, "question": q["question"], "answer": q["answer"], "metadata": json.dumps(meta)})
        return out

    def score(self, response_text: str, example: Example) -> float:
        """1.0 when the final answer (:func:`final_answer`) equals the truth after :func:`normalize_answer`."""
        return float(normalize_answer(final_answer(response_text)) == normalize_answer(example.ground_truth))


register_task("retrieval_multihop", RetrievalTask)

__all__ = ["COMPANY_SUFFIXES", "Document", "INSTRUCTION", "RetrievalTask", "TEMPLATES", "World", "company_questions",
           "final_answer", "generate_world", "guess_baseline", "normalize_answer"]
