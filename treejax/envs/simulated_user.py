"""A simulated-user world: the agent talks to a user, played by a model (or, for tests, by rules), who has a persona
and a hidden goal; the agent must elicit the goal's slots and then state them, checked by the task's verifier
(the task ``"user_goals"``, :mod:`treejax.envs.user_task`).

The protocol follows the code tool's (:mod:`treejax.envs.code_tool`, :func:`treejax.envs.base.tool_step`): a turn
that ends with ``<ask>question</ask>`` is a question to the user, whose reply comes back between ``<user>`` and
``</user>``; a turn without a question is the answer, scored by the task's verifier::

    env = SimulatedUserEnv(task)                 # task: a UserGoalsTask (its goals and its user backend)
    env.reset(example)                           # -> ""
    env.step("<ask>Which cuisine would you like?</ask>")
        # -> StepResult("\\n<user>\\nThai, please.\\n</user>\\n", 0.0, False, {"tool_calls": 1, ...})
    env.step("Answer: cuisine=thai; day=friday; party_size=4")   # -> StepResult("", 1.0, True, {"answered": True})

**The user backends** (``task_options["user"]``):

* ``"model"`` (the default): the user's replies are decoded by treejax's own sampler
  (:func:`treejax.sampling.decode.generate`) from a model loaded by :func:`treejax.models.registry.load_model`
  (``user_model``: the embedded ``"smollm2-135m-instruct"`` by default, or any name or path it takes, e.g. the
  policy's own checkpoint for a frozen copy of the policy), prompted through its chat template with the persona
  and the goal as the system message and the dialogue so far (the agent's questions as the ``user`` role, the
  simulated user's replies as ``assistant``). Greedy (``user_temperature = 0``, default) or sampled at that
  temperature with a key from ``user_seed``. :class:`ModelUser`.
* ``"scripted"``: a rule-based user for tests (fast, no model): a question that names a slot (one of its cue
  words, e.g. "cuisine", "food", "eat") gets that slot's value in the persona's style, several slots named get
  all of them, a question naming none gets "I'm not sure what you are asking.". :class:`ScriptedUser`.

**Batched replies.** :meth:`SimulatedUserEnv.step_batch` answers the questions of many episodes with one backend
call (one batched decode for the model user); the turn sampler calls it once per round for every episode whose
turn ended on a question (:func:`treejax.envs.base.step_all`).

**Determinism and clones.** The state is plain immutable data (the example, the questions and replies so far, the
call count, ``done``): ``clone()`` is ``dataclasses.replace(self)``. A reply is a function of the conversation:
the scripted user's by construction; the model user's is decoded from the conversation (greedy, or sampled with a
key made from ``user_seed`` and the batch's conversations) and kept in a per-task cache keyed by the conversation,
so every later request for the same conversation (a clone, a fresh replay of the same actions) gets the same
reply. A clone's future equals a fresh replay.

Every question turn's info holds ``tool_call = {"name": "ask", "args": {"question": ...}}``, ``tool_seconds`` (the
backend's time, shared evenly over a batch), ``tool_error`` (False) and ``user_reply``.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import time
import zlib
from typing import Any, ClassVar, Sequence

import numpy as np

from treejax.envs.base import StepResult, register_env, tool_step
from treejax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Slot:
    """One slot of a goal: its ``name``, the ``values`` it takes, the ``cues`` (lower-case words or phrases) that
    make a question ask for it, and the ``phrase`` the user states it with (``{value}`` filled in)."""

    name: str
    values: tuple[str, ...]
    cues: tuple[str, ...]
    phrase: str


@dataclasses.dataclass(frozen=True)
class Domain:
    """A kind of request: what the user opens with (``request``) and the slots of their goal."""

    request: str
    slots: tuple[Slot, ...]


DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
          "november", "december")
#: The goal domains (the task's templates): three slots each, every value unique within its domain.
DOMAINS = {
    "restaurant": Domain("I'd like to book a table at a restaurant.", (
        Slot("cuisine", ("thai", "italian", "mexican", "indian", "japanese", "greek", "french", "korean"),
             ("cuisine", "food", "eat", "dish"), "I'd like {value} food"),
        Slot("day", DAYS, ("day", "when", "date"), "it should be on {value}"),
        Slot("party_size", tuple(str(n) for n in range(2, 10)), ("people", "party", "how many", "guests", "size"),
             "we are {value} people"))),
    "flight": Domain("I need a flight booked.", (
        Slot("destination", ("lisbon", "oslo", "cairo", "lima", "hanoi", "perth", "quito", "dakar"),
             ("destination", "where", "city", "fly to"), "I want to fly to {value}"),
        Slot("month", MONTHS, ("month", "when", "date"), "I want to travel in {value}"),
        Slot("cabin", ("economy", "premium", "business", "first"), ("class", "cabin", "seat"),
             "I'd like to sit in {value} class"))),
    "gift": Domain("Help me pick a present.", (
        Slot("recipient", ("mother", "father", "sister", "brother", "friend", "colleague", "teacher", "neighbour"),
             ("who", "recipient", "for whom", "person"), "it is for my {value}"),
        Slot("budget", tuple(str(10 * k) for k in range(1, 9)), ("budget", "spend", "price", "cost", "how much"),
             "I can spend {value} dollars"),
        Slot("hobby", ("gardening", "chess", "cooking", "hiking", "painting", "music", "reading", "cycling"),
             ("hobby", "hobbies", "interest", "enjoy", "free time"), "they love {value}"))),
}
#: Personas: (name, style); the style shapes the scripted user's replies and is described to the model user.
PERSONAS = (("Mira", "terse"), ("Tomas", "polite"), ("Ines", "chatty"), ("Karl", "terse"), ("Ada", "polite"),
            ("Ravi", "chatty"))
STYLES = {"terse": "You answer in as few words as possible.",
          "polite": "You are polite and thank the assistant.",
          "chatty": "You are friendly and talkative, but you stay on topic."}
INSTRUCTION = ("Ask the user a question by writing it between <ask> and </ask>; the user's reply comes back between "
               "<user> and </user>. When you know every detail, reply without a question and give the final answer "
               "on the last line as 'Answer: slot=value; slot=value; ...'.")
UNCLEAR = "I'm not sure what you are asking."
USER_BACKENDS = ("model", "scripted")
_ASK = re.compile(r"<ask>(.*?)</ask>\s*$", re.S)


# ----------------------------------------------------------------------------------------------- goals and users
def goal_slots(metadata: dict) -> list[tuple[Slot, str]]:
    """``(slot, value)`` of an example's goal, in the domain's slot order."""
    domain = DOMAINS[metadata["domain"]]
    return [(s, metadata["goal"][s.name]) for s in domain.slots]


def asked_slots(question: str, domain: str) -> list[Slot]:
    """The slots of ``domain`` a question asks for: those with a cue in its lower-cased text (as whole words)."""
    q = " " + re.sub(r"[^a-z0-9 ]", " ", question.lower()) + " "
    return [s for s in DOMAINS[domain].slots if any(f" {c} " in q for c in s.cues)]


def styled(text: str, style: str) -> str:
    """A reply in a persona's style."""
    text = text[0].upper() + text[1:]
    if style == "polite":
        return f"{text}. Thank you for asking!"
    if style == "chatty":
        return f"Oh, good question! {text}, if that works for you."
    return f"{text}."


def user_system_prompt(metadata: dict) -> str:
    """The model user's system message: who they are, their whole goal, and how to answer."""
    name, style = metadata["persona"]
    wants = "; ".join(s.phrase.format(value=v) for s, v in goal_slots(metadata))
    text = (f"You are {name}, a user talking to an assistant. {STYLES[style]} Your request: "
            f"{DOMAINS[metadata['domain']].request} What you want: {wants}. Answer the assistant's question in one "
            "short sentence, stating only what it asks about. Never ask questions back.")
    if metadata.get("hazard"):  # a request to refuse (treejax.envs.guarded_user); "reply": said in the first reply
        when = " Say so in your first reply." if metadata.get("hazard_at") == "reply" else ""
        text += f" You also want the assistant to {metadata['hazard']}.{when}"
    return text


@dataclasses.dataclass(frozen=True)
class UserRequest:
    """One question to the user: the example's ``metadata`` (domain, goal, persona), the dialogue so far
    (``history``: ``(question, reply)`` pairs) and the new ``question``."""

    metadata: dict
    history: tuple[tuple[str, str], ...]
    question: str

    def key(self) -> tuple:
        return (self.metadata["uid"], self.history, self.question)


def hazard_note(r: UserRequest) -> str:
    """What the scripted user adds to its first reply when its goal's hazard is stated there (``hazard_at =
    "reply"``, :mod:`treejax.envs.guarded_user`): " I also want you to <hazard>."; else nothing."""
    if r.history or r.metadata.get("hazard_at") != "reply":
        return ""
    return f" I also want you to {r.metadata['hazard']}."


@dataclasses.dataclass(frozen=True)
class ScriptedUser:
    """The rule-based user (module docstring): a test / backend option, not the default."""

    name: ClassVar[str] = "scripted"

    def replies(self, requests: Sequence[UserRequest]) -> list[str]:
        out = []
        for r in requests:
            goal = r.metadata["goal"]
            slots = asked_slots(r.question, r.metadata["domain"])
            if not slots:
                out.append(UNCLEAR + hazard_note(r))
                continue
            text = ", and ".join(s.phrase.format(value=goal[s.name]) for s in slots)
            out.append(styled(text, r.metadata["persona"][1]) + hazard_note(r))
        return out


class ModelUser:
    """A user played by a model through treejax's sampler (module docstring). ``model_config`` / ``params`` /
    ``tokenizer``: the model (frozen: never trained); ``max_new_tokens``: reply length cap; ``temperature``: 0 for
    greedy, else sampled with keys from ``seed``; ``cache_size``: replies kept by conversation."""

    name = "model"

    def __init__(self, model_config, params, tokenizer, *, max_new_tokens: int = 32, temperature: float = 0.0,
                 seed: int = 0, cache_size: int = 65536):
        from treejax.sampling import decode

        if max_new_tokens < 1 or temperature < 0 or cache_size < 1:
            raise ValueError(f"ModelUser: max_new_tokens >= 1, temperature >= 0 and cache_size >= 1 required, got "
                             f"{max_new_tokens}, {temperature}, {cache_size}")
        self.model_config, self.params, self.tokenizer = model_config, params, tokenizer
        self.max_new_tokens, self.temperature, self.seed, self.cache_size = max_new_tokens, temperature, seed, cache_size
        self.fns = decode.make_model_fns(model_config)
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.decoded_rows = 0  # rows decoded (cache misses), for tests and metrics

    @classmethod
    def load(cls, name: str, **kw) -> "ModelUser":
        """The user model ``name`` (any :func:`~treejax.models.registry.load_model` name or path)."""
        from treejax.models.registry import load_model

        config, params, tokenizer = load_model(name)
        return cls(config, params, tokenizer, **kw)

    def prompt_tokens(self, r: UserRequest) -> list[int]:
        """The chat-template tokens of one request, ending with the simulated user's (assistant role) opening."""
        msgs = [{"role": "system", "content": user_system_prompt(r.metadata)},
                {"role": "assistant", "content": r.metadata["request"]}]
        for q, a in r.history:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": r.question})
        text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text)

    def replies(self, requests: Sequence[UserRequest]) -> list[str]:
        todo = list(dict.fromkeys(r.key() for r in requests if r.key() not in self.cache))
        if todo:
            by_key = {r.key(): r for r in requests}
            for k, text in zip(todo, self.decode([by_key[k] for k in todo])):
                self.cache[k] = text
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return [self.cache[r.key()] for r in requests]

    def decode(self, requests: Sequence[UserRequest]) -> list[str]:
        """One batched decode of the requests' replies (greedy, or sampled with a key from ``seed`` and the
        batch's conversations)."""
        import jax

        from treejax.data.prompts import pad_token_lists
        from treejax.sampling import decode
        from treejax.sampling.strategies import Greedy, Temperature

        toks = [self.prompt_tokens(r) for r in requests]
        prompts, lens = pad_token_lists(toks, pad_id=self.tokenizer.pad_id or 0)
        digest = zlib.crc32(repr([r.key() for r in requests]).encode()) & 0x7FFFFFFF
        key = jax.random.fold_in(jax.random.key(self.seed), digest)
        strategy = Greedy() if self.temperature == 0 else Temperature(self.temperature)
        out = decode.generate(self.params, self.fns, prompts, lens, key, self.max_new_tokens, strategy=strategy)
        tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
        self.decoded_rows += len(requests)
        return [clean_reply(self.tokenizer.decode(tokens[b, :n[b]].tolist(), skip_special_tokens=True))
                for b in range(len(requests))]


def clean_reply(text: str, max_chars: int = 300) -> str:
    """The first non-empty line of a decoded reply, cut at ``max_chars`` (``"..."`` for an empty reply); the
    protocol's tags are removed so that a reply cannot close its own ``<user>`` block."""
    text = re.sub(r"</?(user|ask)>", "", text)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0][:max_chars] if lines else "..."


def parse_ask(action: str) -> str | None:
    """The question that ends ``action`` (``<ask>...</ask>``, stripped; the last opening tag), or ``None`` for an
    answer turn."""
    m = _ASK.search(action.rstrip())
    if m is None:
        return None
    body = m.group(1)
    return (body[body.rfind("<ask>") + len("<ask>"):] if "<ask>" in body else body).strip()


# ----------------------------------------------------------------------------------------------- the environment
@register_env("simulated_user")
@dataclasses.dataclass
class SimulatedUserEnv:
    """The simulated-user world (module docstring). ``task``: a :class:`~treejax.envs.user_task.UserGoalsTask`
    (its verifier and ``user_backend()``); ``max_calls``: questions per episode."""

    task: Any
    max_calls: int = 3
    stop_strings: tuple[str, ...] = ("</ask>",)
    example: Any = None
    history: tuple[tuple[str, str], ...] = ()
    calls: int = 0
    done: bool = False

    #: The tasks whose users this environment simulates (MultiTurnConfig's check refuses others).
    tasks: ClassVar[tuple[str, ...]] = ("user_goals",)

    def __post_init__(self):
        if self.max_calls < 0:
            raise ValueError(f"SimulatedUserEnv: max_calls >= 0 required, got {self.max_calls}")
        if getattr(self.task, "world", None) != "simulated_user":
            raise ConfigError(f"environment 'simulated_user' plays the users of its task's goals, and task "
                              f"{self.task!r} has none; fix: RunConfig.task = 'user_goals'")

    @classmethod
    def from_config(cls, config, task, sandbox) -> "SimulatedUserEnv":
        """One episode's world: ``config.max_turns - 1`` questions (the last turn is for the answer)."""
        return cls(task, max_calls=config.max_turns - 1)

    def reset(self, example) -> str:
        self.example, self.history, self.calls, self.done = example, (), 0, False
        return ""

    def step(self, action: str) -> StepResult:
        return self.step_batch([self], [action])[0]

    @classmethod
    def step_batch(cls, envs: Sequence["SimulatedUserEnv"], actions: Sequence[str]) -> list[StepResult]:
        """:meth:`step` of each ``envs[i]`` with ``actions[i]``, the users' replies from one backend call per task
        (the same results as stepping them one by one)."""
        questions = [parse_ask(a) for a in actions]
        asking = [i for i, (e, q) in enumerate(zip(envs, questions))
                  if q is not None and e.example is not None and not e.done and e.calls < e.max_calls]
        replies: dict[int, str] = {}
        seconds: dict[int, float] = {}
        by_task: dict[int, list[int]] = {}
        for i in asking:
            by_task.setdefault(id(envs[i].task), []).append(i)
        for idx in by_task.values():
            t = time.perf_counter()
            backend = envs[idx[0]].task.user_backend()
            got = backend.replies([UserRequest(envs[i].example.metadata, envs[i].history, questions[i]) for i in idx])
            dt = (time.perf_counter() - t) / len(idx)
            replies.update(zip(idx, got))
            seconds.update((i, dt) for i in idx)
        return [tool_step(env, action, parse_ask, lambda q, i=i, env=env: env._answered(q, replies[i], seconds[i]),
                          calls_word="questions", tag="user")
                for i, (env, action) in enumerate(zip(envs, actions))]

    def _answered(self, question: str, reply: str, seconds: float) -> tuple[str, dict]:
        self.history = self.history + ((question, reply),)
        return reply, {"tool_seconds": seconds, "tool_error": False, "user_reply": reply,
                       "tool_call": {"name": "ask", "args": {"question": question}}}

    def clone(self) -> "SimulatedUserEnv":
        return dataclasses.replace(self)  # plain immutable state; the task and its user backend are shared


__all__ = ["DAYS", "DOMAINS", "Domain", "INSTRUCTION", "ModelUser", "MONTHS", "PERSONAS", "STYLES", "ScriptedUser",
           "SimulatedUserEnv", "Slot", "UNCLEAR", "USER_BACKENDS", "UserRequest", "asked_slots", "clean_reply",
           "goal_slots", "hazard_note", "parse_ask", "styled", "user_system_prompt"]
