"""The retrieval world (treejax.envs.retrieval, treejax.envs.retrieval_corpus): the reset/step/clone contract, the
bm25s index against a brute-force BM25 on a small corpus, the generated multi-hop questions needing their lookups
(a scripted oracle with search answers every one, with one lookup fewer than a question's hops it answers none of
them, and without search it does no better than a question-blind guess), the calculator, the parser, the errors."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from treejax.data import get_task
from treejax.envs import env_names, get_env
from treejax.envs.retrieval import BM25Index, RetrievalEnv, calculate, parse_call
from treejax.envs.retrieval_corpus import (COMPANY_SUFFIXES, Document, RetrievalTask, TEMPLATES, company_questions,
                                           final_answer, generate_world, guess_baseline, normalize_answer)
from treejax.errors import ConfigError, DataError
from treejax.testing.envs import run_shipped_multiturn


@pytest.fixture(scope="module")
def task():
    return get_task("retrieval_multihop", size=64, eval_size=16, seed=3)


def _result(r):
    """A StepResult without its host timing (``tool_seconds``), for comparisons."""
    return (r.observation, r.reward, r.done, {k: v for k, v in r.info.items() if k != "tool_seconds"})


# ------------------------------------------------------------------------------------------------ the world
def test_world_is_deterministic_from_its_seed_and_links_facts_one_way():
    a, b, c = generate_world(12, seed=1), generate_world(12, seed=1), generate_world(12, seed=2)
    assert a == b and a.documents != c.documents
    titles = [d.title for d in a.documents]
    assert len(set(titles)) == len(titles)
    words = [w for t in titles for w in t.split() if w not in COMPANY_SUFFIXES]
    assert len(set(words)) == len(words)  # every name word is unique in the world
    by_title = {d.title: d.text for d in a.documents}
    for company, (founder, _, hq, _) in a.companies.items():
        birth_city = a.people[founder][0]
        assert founder in by_title[company] and birth_city not in by_title[company].replace(hq, "")
        assert a.cities[birth_city][0] not in by_title[founder]  # the person's page names the city, not its country
        for q in company_questions(a, company):
            assert q["answer"] not in q["question"]
            assert sum(c["name"] == "search" for c in q["reference_calls"]) == q["hops"]


def test_task_splits_are_disjoint_companies_and_records_are_stable(task):
    train, held = task.records("train"), task.records("eval")
    assert len(train) == 64 and len(held) == 16
    companies = lambda recs: {json.loads(r["metadata"])["company"] for r in recs}  # noqa: E731
    assert not companies(train) & companies(held)
    assert train == get_task("retrieval_multihop", size=64, eval_size=16, seed=3).records("train")
    ex = next(task.examples("train"))
    assert ex.metadata["reference_calls"][0] == {"name": "search", "args": {"query": ex.metadata["company"]}}
    assert task.score(f"I looked it up.\nAnswer: {ex.ground_truth.upper()}.", ex) == 1.0
    assert task.score("Answer: somewhere else", ex) == 0.0


def test_task_option_errors_name_the_fix():
    with pytest.raises(DataError, match="extraction must be 'answer_line'.*fix"):
        get_task("retrieval_multihop", extraction="last_number")
    with pytest.raises(DataError, match="templates must be"):
        RetrievalTask(templates=("capital_of",))
    with pytest.raises(DataError, match="size \\+ eval_size > 0"):
        RetrievalTask(size=0, eval_size=0)


# ------------------------------------------------------------------------------------------------- the index
def _brute_force_bm25(docs: list[str], query: str, k1=1.5, b=0.75) -> tuple[np.ndarray, list[list[str]]]:
    """BM25, Lucene variant (bm25s's default: method='lucene', k1 1.5, b 0.75), from scratch: scikit-learn-style
    tokens (lower case, ``\\b\\w\\w+\\b``), bm25s's English stop words removed, each distinct query word once."""
    from bm25s.stopwords import STOPWORDS_EN

    tok = lambda s: [t for t in re.findall(r"(?u)\b\w\w+\b", s.lower()) if t not in STOPWORDS_EN]  # noqa: E731
    doc_toks = [tok(d) for d in docs]
    N, avgdl = len(docs), sum(map(len, doc_toks)) / len(docs)
    scores = np.zeros(N)
    for t in dict.fromkeys(tok(query)):
        df = sum(t in d for d in doc_toks)
        if df == 0:
            continue
        idf = math.log(1 + (N - df + 0.5) / (df + 0.5))
        for i, d in enumerate(doc_toks):
            tf = d.count(t)
            scores[i] += idf * tf / (tf + k1 * (1 - b + b * len(d) / avgdl))
    return scores, doc_toks


def test_bm25s_index_equals_brute_force_bm25():
    docs = [Document("Velor Systems", "Velor Systems makes robots; robots and more robots in Tolsa.", "company"),
            Document("Ana Brik", "Ana Brik is a painter born in Tolsa, the city of bridges.", "person"),
            Document("Tolsa", "Tolsa is a city in Marovia with many bridges and one robot museum.", "city"),
            Document("Marovia", "Marovia is a country. Its capital is Tolsa.", "country"),
            Document("Kem Dura", "Kem Dura founded nothing and lives far from every city.", "person"),
            Document("Quill Works", "Quill Works prints books about painters and bridges.", "company")]
    index = BM25Index(docs)
    texts = [f"{d.title}. {d.text}" for d in docs]
    for query in ("robots in Tolsa", "Ana Brik painter", "bridges bridges city", "Marovia capital", "the of and",
                  "museum Quill", "unknownword"):
        expected, doc_toks = _brute_force_bm25(texts, query)
        assert index.doc_tokens == doc_toks
        np.testing.assert_allclose(index.scores(query), expected, rtol=1e-5, atol=1e-6)
        ranked = [i for i, _ in index.search(query, len(docs))]
        assert ranked == [int(i) for i in np.lexsort((np.arange(len(docs)), -expected)) if expected[i] > 0]


def test_every_entity_name_finds_its_own_document_first(task):
    index = task.index
    for i, d in enumerate(index.documents):
        assert index.search(d.title, 3)[0][0] == i, d.title


# ------------------------------------------------------------------------------------------ the environment
def test_reset_step_and_clone_contract(task):
    ex = next(task.examples("train"))
    company, founder = ex.metadata["company"], task.world.companies[ex.metadata["company"]][0]
    actions = [f"Find the company.\n<search>{company}</search>", "<calculate>(3 + 4) * 2</calculate>",
               f"<search>{founder}</search>", f"Answer: {ex.ground_truth}"]
    env = RetrievalEnv(task, max_calls=3)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("Answer: x")
    assert env.reset(ex) == ""
    first = env.step(actions[0])
    assert not first.done and first.reward == 0.0 and f"[1] {company}: " in first.observation
    assert first.observation.startswith("\n<output>\n") and first.observation.endswith("\n</output>\n")
    assert first.info["tool_call"] == {"name": "search", "args": {"query": company}} and not first.info["tool_error"]
    fork = env.clone()
    fresh = RetrievalEnv(task, max_calls=3)
    fresh.reset(ex)
    fresh.step(actions[0])
    rest_env = [_result(env.step(a)) for a in actions[1:]]
    rest_fork = [_result(fork.step(a)) for a in actions[1:]]
    rest_fresh = [_result(fresh.step(a)) for a in actions[1:]]
    assert rest_env == rest_fork == rest_fresh
    assert rest_env[0][0] == "\n<output>\n14\n</output>\n"
    assert rest_env[-1][1:3] == (1.0, True) and rest_env[-1][3]["answered"]
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("Answer: x")


def test_a_clone_is_independent_and_the_call_limit_ends_the_episode(task):
    ex = next(task.examples("train"))
    env = RetrievalEnv(task, max_calls=1)
    env.reset(ex)
    fork = env.clone()
    assert not env.step("<search>Tolsa</search>").done
    assert fork.calls == 0  # the original's step did not reach the fork
    last = env.step("<search>again</search>")
    assert last.done and last.info["call_limit"] and "no tool calls left" in last.observation
    assert not fork.step(f"Answer: {ex.ground_truth}").info.get("call_limit") and fork.done


def test_errors_come_back_as_observations(task):
    env = RetrievalEnv(task)
    env.reset(next(task.examples("train")))
    miss = env.step("<search>zzzz qqqq</search>")
    assert miss.info["tool_error"] and "[error] no document matches" in miss.observation and not miss.done
    bad = env.step("<calculate>__import__('os')</calculate>")
    assert bad.info["tool_error"] and "[error] cannot calculate" in bad.observation


def test_calculator_and_parser():
    assert [calculate(e) for e in ("1987 - 1950", "7 / 2", "2 ** 10", "-(3 + 4) * 2", "8 / 4")] == [
        "37", "3.5", "1024", "-14", "2"]
    for bad in ("1 / 0", "2 ** 1000", "x + 1", "print(1)", "1 +"):
        assert calculate(bad).startswith("[error]"), bad
    assert parse_call("think\n<search> Velor  Systems </search>\n") == {"name": "search",
                                                                     "args": {"query": "Velor  Systems"}}
    assert parse_call("<search>a</search> then <search>b</search>") == {"name": "search", "args": {"query": "b"}}
    assert parse_call("<calculate>1+1</calculate>") == {"name": "calculate", "args": {"expression": "1+1"}}
    assert parse_call("Answer: <search>x") is None and parse_call("Answer: Tolsa") is None
    assert final_answer("a\nAnswer: Tolsa\nthanks") == "Tolsa" and final_answer("just Tolsa") == "just Tolsa"
    assert normalize_answer("The  Tolsa!") == "tolsa"


def test_registered_and_built_from_the_multiturn_config(task):
    from treejax.rl.multiturn import MultiTurnConfig

    assert "retrieval" in env_names() and get_env("retrieval") is RetrievalEnv
    env = RetrievalEnv.from_config(MultiTurnConfig(environment="retrieval", max_turns=4), task, None)
    assert env.max_calls == 3 and env.top_k == task.top_k and env.task.index is task.index  # built once per task
    with pytest.raises(ConfigError, match="fix: RunConfig.task = 'retrieval_multihop'"):
        RetrievalEnv.from_config(MultiTurnConfig(environment="retrieval"), object(), None)


# ----------------------------------------------------------------------------- the questions need their lookups
_COMPANY = re.compile(r"(?:founder|headquarters) of (.+?) (?:born|when|\?)|headquarters of (.+?)\?")


def _oracle(env: RetrievalEnv, example, lookups: int, guesses: dict | None = None) -> float:
    """A scripted policy that reads the question and the documents it found (never the metadata or the truth):
    it looks entities up along the question's chain while it has ``lookups`` left, computes ages itself, and
    answers; ``lookups = 0`` with ``guesses`` (template -> answer) is the same policy without search."""
    env.reset(example)
    q = example.metadata["question"]
    template = next(t for t, (fmt, _) in TEMPLATES.items() if re.fullmatch(
        re.escape(fmt).replace(re.escape("{company}"), ".+?"), q))
    company = next(g for g in _COMPANY.search(q).groups() if g)
    left = [lookups]

    def page(name):
        if name is None or left[0] == 0:
            return None
        left[0] -= 1
        obs = env.step(f"<search>{name}</search>").observation
        found = dict(re.findall(r"^\[\d+\] (.+?): (.*)$", obs, flags=re.M))
        return found.get(name)

    text = page(company)
    founded = re.search(r"founded in (\d+) by (.+?)\. Its headquarters are in (.+?)\.", text or "")
    answer = None
    if founded and template == "hq_country":
        city = re.search(r"is a city in (.+?), with", page(founded.group(3)) or "")
        answer = city and city.group(1)
    elif founded:
        person = re.search(r"born in (\d+) in the city of (.+?)\.", page(founded.group(2)) or "")
        if person and template == "founder_birthplace":
            answer = person.group(2)
        elif person and template == "founding_age":
            answer = str(int(founded.group(1)) - int(person.group(1)))
        elif person:
            city = re.search(r"is a city in (.+?), with", page(person.group(2)) or "")
            answer = city and city.group(1)
    if answer is None and guesses is not None:
        answer = guesses[template]
    return env.step(f"Answer: {answer or 'unknown'}").reward


def test_the_multi_hop_questions_need_their_lookups(task):
    examples = list(task.examples("eval")) + list(task.examples("train"))[:32]
    env = RetrievalEnv(task, max_calls=3)
    assert all(_oracle(env, ex, lookups=3) == 1.0 for ex in examples)
    assert all(_oracle(env, ex, lookups=ex.metadata["hops"]) == 1.0 for ex in examples)
    assert all(_oracle(env, ex, lookups=ex.metadata["hops"] - 1) == 0.0 for ex in examples)
    assert {ex.metadata["hops"] for ex in examples} == {2, 3}
    # without search: the best fixed answer per template (chosen knowing these questions' answers)
    qs = [{"template": ex.metadata["template"], "answer": ex.ground_truth} for ex in examples]
    guesses = {t: max({q["answer"] for q in qs if q["template"] == t},
                      key=lambda a: (sum(q["answer"] == a for q in qs if q["template"] == t), a))
               for t in {q["template"] for q in qs}}
    blind = float(np.mean([_oracle(env, ex, lookups=0, guesses=guesses) for ex in examples]))
    assert blind == pytest.approx(guess_baseline(qs)) and blind < 0.35



@pytest.mark.slow  # one RL step of the whole loop on a tiny random model: ~100 s on the shared 2-core machine
def test_the_shipped_matchtir_config_runs_one_step(tiny_checkpoint, tmp_path):
    """configs/multiturn_retrieval_matchtir.gin end to end (task, world, index, environment, matching, estimator,
    update, evaluation with the environment) for one step on a tiny random model with SmolLM2's tokenizer."""
    last = run_shipped_multiturn("multiturn_retrieval_matchtir.gin", tiny_checkpoint, tmp_path / "run")
    assert "multiturn/tool_match_mean" in last
