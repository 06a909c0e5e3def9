"""A retrieval world: a search tool over a local corpus (a BM25 index from the ``bm25s`` library) and a calculator,
for the multi-hop questions of :mod:`treejax.envs.retrieval_corpus`.

The protocol follows the code tool (:mod:`treejax.envs.code_tool`): a turn that ends with a call is a tool call,
its result comes back between ``<output>`` and ``</output>``, and a turn without a call is the answer, scored by
the task's verifier:

    env = RetrievalEnv(task)                  # task: a RetrievalTask (its corpus and index)
    env.reset(example)                        # -> ""
    env.step("First the company.\\n<search>Velor Systems</search>")
        # -> StepResult("\\n<output>\\n[1] Velor Systems: Velor Systems is a ... founded in 1987 by Ana Brik. ...
        #    \\n[2] ...\\n</output>\\n", 0.0, False, {"tool_calls": 1, "tool_call": {"name": "search", ...}, ...})
    env.step("<calculate>1987 - 1950</calculate>")   # -> "\\n<output>\\n37\\n</output>\\n"
    env.step("Answer: Tolsa")                # -> StepResult("", 1.0, True, {"answered": True, ...})

Tools (``stop_strings``: a turn ends on ``</search>`` or ``</calculate>``):

* ``<search>query</search>``: the ``top_k`` documents of the corpus with the highest BM25 scores for the query
  (:class:`BM25Index`), as ``[rank] title: text`` lines; a query with no known word is an error observation;
* ``<calculate>expression</calculate>``: an arithmetic expression (numbers, ``+ - * / // % **``, parentheses;
  parsed with :mod:`ast`, nothing evaluated by ``eval``), its value or an error.

Every call's info holds ``tool_call = {"name", "args"}`` (the parsed call, which MatchTIR's matching reads,
:mod:`treejax.rl.tool_match`), ``tool_seconds`` and ``tool_error``. At most ``max_calls`` calls: a call past the
limit ends the episode with the verifier's score of that turn. The state is plain immutable data (the example, the
call count, ``done``); the index is shared, read-only: ``clone()`` copies the state, and a clone's future equals
a fresh replay of the same actions.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re
import time
from typing import Any, ClassVar

import numpy as np

from treejax.envs.base import StepResult, register_env, tool_step
from treejax.errors import ConfigError

#: The tools: name -> the name of its one argument.
TOOLS = {"search": "query", "calculate": "expression"}
_CALL = re.compile(r"<(search|calculate)>(.*?)</\1>\s*$", re.S)


class BM25Index:
    """A BM25 index of ``documents`` (objects with ``title`` and ``text``) through ``bm25s``: the indexed text of a
    document is ``"<title>. <text>"``, tokenised by ``bm25s.tokenize`` (lower case, words of 2+ characters, English
    stop words removed), scored with bm25s's default variant (``method="lucene"``, ``k1 = 1.5``, ``b = 0.75``):

        score(q, d) = sum_{t in q} log(1 + (N - df_t + 0.5) / (df_t + 0.5)) * tf_{t,d} / (tf_{t,d} + k1 (1 - b + b |d| / avgdl))

    Each distinct query word counts once (a repeated word does not weigh more). ``search`` ranks by score, ties
    by document order; documents with score 0 are never returned."""

    def __init__(self, documents, k1: float = 1.5, b: float = 0.75):
        import bm25s

        self.documents, self.k1, self.b = tuple(documents), k1, b
        if not self.documents:
            raise ValueError("BM25Index: no documents")
        self._bm25s = bm25s
        self.doc_tokens = self.tokenize([f"{d.title}. {d.text}" for d in self.documents])
        self.retriever = bm25s.BM25(k1=k1, b=b, method="lucene")
        self.retriever.index(self.doc_tokens, show_progress=False)

    def tokenize(self, texts: list[str]) -> list[list[str]]:
        """bm25s's tokens of each text (the same for documents and queries)."""
        out = self._bm25s.tokenize(list(texts), stopwords="en", return_ids=False, show_progress=False)
        return [list(t) for t in out]

    def query_tokens(self, query: str) -> list[str]:
        """The query's distinct known words, in order."""
        seen = dict.fromkeys(t for t in self.tokenize([query])[0] if t in self.retriever.vocab_dict)
        return list(seen)

    def scores(self, query: str) -> np.ndarray:
        """float32[len(documents)]: every document's BM25 score for ``query`` (0 for a query without known words)."""
        toks = self.query_tokens(query)
        if not toks:
            return np.zeros(len(self.documents), np.float32)
        return np.asarray(self.retriever.get_scores(toks), np.float32)

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """``(document index, score)`` of the ``k`` best documents with a positive score (module docstring)."""
        s = self.scores(query)
        order = np.lexsort((np.arange(len(s)), -s))[:k]
        return [(int(i), float(s[i])) for i in order if s[i] > 0]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def calculate(expression: str) -> str:
    """The value of an arithmetic ``expression`` as text (whole floats without ``.0``), or ``"[error] ..."``."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"unsupported {type(node).__name__}")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return f"[error] cannot calculate {expression.strip()!r}: {e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def parse_call(action: str) -> dict | None:
    """The tool call that ends ``action`` (``{"name": ..., "args": {argument: text}}``, the text stripped), or
    ``None`` when the turn ends without one (an answer)."""
    m = _CALL.search(action.rstrip())
    if m is None:
        return None
    name = m.group(1)
    body = m.group(2)
    body = body[body.rfind(f"<{name}>") + len(name) + 2:] if f"<{name}>" in body else body  # the last opening tag
    return {"name": name, "args": {TOOLS[name]: body.strip()}}


@register_env("retrieval")
@dataclasses.dataclass
class RetrievalEnv:
    """The retrieval world (module docstring). ``task``: a task with ``index`` (a :class:`BM25Index`) and
    ``score(text, example)``, a :class:`~treejax.envs.retrieval_corpus.RetrievalTask`; ``max_calls``: tool calls
    per episode; ``top_k``: documents per search."""

    task: Any
    max_calls: int = 3
    top_k: int = 3
    stop_strings: tuple[str, ...] = ("</search>", "</calculate>")
    example: Any = None
    calls: int = 0
    done: bool = False

    #: The tasks whose world this environment searches (MultiTurnConfig's check refuses others).
    tasks: ClassVar[tuple[str, ...]] = ("retrieval_multihop",)
    #: Its examples ship reference tool calls (``metadata["reference_calls"]``) for MatchTIR's matching rewards.
    reference_calls: ClassVar[bool] = True
    #: It can replay an expert trajectory (``parse_action`` / ``render_call``): UI-S1's semi-online rollout,
    #: :class:`treejax.envs.semi_online.SemiOnlineEnv`.
    expert_steps: ClassVar[bool] = True
    parse_action = staticmethod(parse_call)

    @staticmethod
    def render_call(call: dict) -> str:
        """The action text of a parsed call (``{"name": "search", "args": {"query": "X"}}`` -> ``<search>X</search>``),
        which :func:`parse_call` reads back as the same call."""
        return f"<{call['name']}>{call['args'][TOOLS[call['name']]]}</{call['name']}>"

    def __post_init__(self):
        if self.max_calls < 0 or self.top_k < 1:
            raise ValueError(f"RetrievalEnv: max_calls >= 0 and top_k >= 1 required, got {self.max_calls}, {self.top_k}")
        if not isinstance(getattr(self.task, "index", None), BM25Index):
            raise ConfigError(f"environment 'retrieval' searches its task's corpus, and task {self.task!r} has none; "
                              "fix: RunConfig.task = 'retrieval_multihop'")

    @classmethod
    def from_config(cls, config, task, sandbox) -> "RetrievalEnv":
        """One episode's world for multi-turn rollouts: the run's ``task`` (its index, built once per task),
        ``config.max_turns - 1`` calls (the last turn is for the answer), the task's ``top_k``."""
        return cls(task, max_calls=config.max_turns - 1, top_k=getattr(task, "top_k", 3))

    def reset(self, example) -> str:
        self.example, self.calls, self.done = example, 0, False
        return ""

    def run_tool(self, call: dict) -> tuple[str, bool]:
        """``(observation body, error)`` of one parsed call."""
        arg = call["args"][TOOLS[call["name"]]]
        if call["name"] == "calculate":
            out = calculate(arg)
            return out, out.startswith("[error]")
        hits = self.task.index.search(arg, self.top_k)
        if not hits:
            return f"[error] no document matches {arg!r}", True
        docs = self.task.index.documents
        return "\n".join(f"[{r}] {docs[i].title}: {docs[i].text}" for r, (i, _) in enumerate(hits, 1)), False

    def step(self, action: str) -> StepResult:
        return tool_step(self, action, parse_call, self._run)

    def _run(self, call: dict) -> tuple[str, dict]:
        t = time.perf_counter()
        body, error = self.run_tool(call)
        return body, {"tool_call": call, "tool_seconds": time.perf_counter() - t, "tool_error": error}

    def clone(self) -> "RetrievalEnv":
        return dataclasses.replace(self)  # plain immutable state; the task and its index are shared, read-only


__all__ = ["BM25Index", "RetrievalEnv", "TOOLS", "calculate", "parse_call"]
