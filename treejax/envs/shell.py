"""A shell-like world: a generated, in-memory file system explored with a small shell language whose actions parse
to an AST (:mod:`treejax.envs.shell_lang`), and its questions (the task ``"shell_files"``,
:mod:`treejax.envs.shell_task`).

The protocol follows the code tool (:mod:`treejax.envs.code_tool`): a turn that ends with
``<shell>command</shell>`` runs the command, its output comes back between ``<output>`` and ``</output>``, and a
turn without a command is the answer, scored by the task's verifier:

    env = ShellEnv(task)
    env.reset(example)                                  # -> ""
    env.step("<shell>grep -rl KX-4821 /</shell>")       # -> "\\n<output>\\n/srv/tolva/notes.txt\\n</output>\\n"
    env.step("<shell>wc -l /srv/tolva/notes.txt</shell>")   # -> "\\n<output>\\n17 /srv/tolva/notes.txt\\n</output>\\n"
    env.step("Answer: 17")                              # -> StepResult("", 1.0, True, {"answered": True, ...})

**Sandboxing.** A command is parsed into typed nodes and run by a Python interpreter over the example's
:class:`~treejax.envs.shell_lang.FileSystem`, an immutable mapping generated from the example's seed: nothing
reads or writes the real disk, starts a process or touches the network, and no command can change the file system
(the commands are read-only), so an episode's state is its working directory and call count. A bad command
(syntax, an unknown command or option, a missing file) is an observation with a one-line error, never an
exception; the output is cut at ``max_output_chars``.

Every command turn's info holds ``tool_call = {"name": "shell", "args": {"command": text}}`` (MatchTIR's matching
reads it against the examples' ``reference_calls``) and ``action_signature``, the command-name chain of its AST
(``"find|wc"``; ``"<syntax error>"`` when it does not parse), which the multi-turn source turns into A³'s
``action_signature_PxWxD`` (:mod:`treejax.rl.advantages.a3`).

**The file systems** (:func:`generate_fs`, deterministic from a seed): top-level folders (``srv``, ``home``,
``data``, ``var``, ``docs``), folders of made-up words two levels below them, and ``num_files`` files (``.txt``,
``.log``, ``.md``, ``.csv``) of 3-30 lines of made-up words; log lines carry a level (``INFO``, ``WARN``,
``ERROR``). A ``count_files`` question asks about the top folder and extension of one of its files, a
``count_lines`` question about a level present in its log, so neither answer is 0 by construction.

**The questions** (:data:`TEMPLATES`, each about its own file system), with their reference actions:

* ``match_lines``: "Which file contains the code KX-4821? Give its number of lines." -- ``grep -rl KX-4821 /``,
  then ``wc -l <path>``;
* ``match_path``: "Which file contains the code KX-4821? Give its absolute path." -- ``grep -rl KX-4821 /``;
* ``count_files``: "How many files with names ending in .log are under /var (at any depth)?" -- ``find /var -type
  f -name '*.log' | wc -l``;
* ``count_lines``: "How many lines of /var/tolva/app.log contain ERROR?" -- ``grep -c ERROR /var/tolva/app.log``.

The code is planted in exactly one file (made-up words are lower case, codes upper case), so ``grep`` finds one
path. The verifier compares the last ``Answer:`` line, stripped of quotes, backticks and a final period, with the
truth exactly (a path is case-sensitive).
"""

from __future__ import annotations

import dataclasses
import functools
import posixpath
import re
import time
from typing import Any, ClassVar, Optional

import numpy as np

from treejax.envs.base import StepResult, register_env, tool_step
from treejax.envs.shell_lang import FileSystem, ShellSyntaxError, execute, parse, signature
from treejax.errors import ConfigError, DataError

TOP_DIRS = ("srv", "home", "data", "var", "docs")
EXTENSIONS = (".txt", ".log", ".md", ".csv")
LEVELS = ("INFO", "INFO", "WARN", "ERROR")
#: Question templates: name -> question format.
TEMPLATES = {
    "match_lines": "Which file contains the code {code}? Give its number of lines.",
    "match_path": "Which file contains the code {code}? Give its absolute path.",
    "count_files": "How many files with names ending in {ext} are under {folder} (at any depth)?",
    "count_lines": "How many lines of {path} contain {level}?",
}
INSTRUCTION = ("You are at a shell over a read-only file system. Run a command by writing it between <shell> and "
               "</shell> (ls, cd, pwd, cat, grep, find, wc, pipes | and &&); its output comes back between <output> "
               "and </output>. When you know the answer, reply without a command and give the final answer on the "
               "last line as 'Answer: <answer>'.")
#: Marks an action that does not parse (its ``action_signature``).
SYNTAX_ERROR = "<syntax error>"
_CALL = re.compile(r"<shell>(.*?)</shell>\s*$", re.S)
_SYLLABLES = ("ka", "lo", "mi", "ner", "tol", "va", "ru", "sen", "dra", "pel", "qui", "zor", "bet", "fin", "gu", "ho")


def _word(rng: np.random.Generator) -> str:
    return "".join(_SYLLABLES[int(rng.integers(len(_SYLLABLES)))] for _ in range(int(rng.integers(2, 4))))


def _text(rng: np.random.Generator, ext: str, lines: int) -> str:
    """``lines`` lines of made-up words; a log's lines start with a level."""
    out = []
    for _ in range(lines):
        words = " ".join(_word(rng) for _ in range(int(rng.integers(2, 7))))
        out.append(f"{LEVELS[int(rng.integers(len(LEVELS)))]} {words}" if ext == ".log" else words)
    return "".join(line + "\n" for line in out)


def generate_fs(seed: int, num_files: int = 24) -> FileSystem:
    """A file system of ``num_files`` files (module docstring), deterministic from ``seed``."""
    if num_files < 4:
        raise DataError(f"shell world: num_files must be >= 4, got {num_files}")
    rng = np.random.default_rng(seed)
    folders = [f"/{t}" for t in TOP_DIRS]
    for _ in range(max(4, num_files // 3)):
        parent = folders[int(rng.integers(len(folders)))]
        if parent.count("/") < 3:
            folders.append(posixpath.join(parent, _word(rng)))
    files: dict[str, str] = {}
    while len(files) < num_files:
        ext = EXTENSIONS[int(rng.integers(len(EXTENSIONS)))]
        path = posixpath.join(folders[int(rng.integers(len(folders)))], _word(rng) + ext)
        if path not in files and path not in folders:
            files[path] = _text(rng, ext, int(rng.integers(3, 31)))
    return FileSystem(files, dirs=folders)


def _code(rng: np.random.Generator) -> str:
    return "".join(chr(65 + int(rng.integers(26))) for _ in range(2)) + f"-{int(rng.integers(1000, 10000))}"


def make_question(template: str, seed: int, num_files: int = 24) -> dict:
    """One question on the file system of ``seed``: ``question``, ``answer``, ``reference_actions`` and the file
    system's ``fs_seed`` / ``num_files``. A ``match_*`` question plants its code in one file (its final file
    system is :func:`question_fs`)."""
    rng = np.random.default_rng([seed, 1])
    fs = generate_fs(seed, num_files)
    paths = sorted(fs.files)
    if template in ("match_lines", "match_path"):
        code, path = _code(rng), paths[int(rng.integers(len(paths)))]
        lines = fs.files[path].count("\n")
        ref = [f"grep -rl {code} /"] + ([f"wc -l {path}"] if template == "match_lines" else [])
        answer, fmt = (str(lines) if template == "match_lines" else path), {"code": code}
        extra = {"plant": {"path": path, "line": int(rng.integers(lines)), "code": code}}
    elif template == "count_files":
        pick = paths[int(rng.integers(len(paths)))]  # a file's top folder and extension: at least one match
        folder, ext = "/" + pick.split("/")[1], posixpath.splitext(pick)[1]
        answer = str(sum(p.startswith(folder + "/") and p.endswith(ext) for p in paths))
        ref, fmt, extra = [f"find {folder} -type f -name '*{ext}' | wc -l"], {"ext": ext, "folder": folder}, {}
    elif template == "count_lines":
        logs = [p for p in paths if p.endswith(".log")] or paths
        path = logs[int(rng.integers(len(logs)))]
        present = [lv for lv in ("ERROR", "WARN") if lv in fs.files[path]] or ["ERROR"]
        level = present[int(rng.integers(len(present)))]
        answer = str(sum(level in line for line in fs.files[path].splitlines()))
        ref, fmt, extra = [f"grep -c {level} {path}"], {"path": path, "level": level}, {}
    else:
        raise DataError(f"shell_files: unknown template {template!r} (known: {tuple(TEMPLATES)})")
    return {"question": TEMPLATES[template].format(**fmt), "answer": answer, "template": template,
            "fs_seed": int(seed), "num_files": int(num_files), "reference_actions": ref, **extra}


@functools.lru_cache(maxsize=256)
def _question_fs(fs_seed: int, num_files: int, plant: Optional[tuple]) -> FileSystem:
    fs = generate_fs(fs_seed, num_files)
    if plant is None:
        return fs
    path, line, code = plant
    lines = fs.files[path].splitlines()
    lines[line] = f"{lines[line]} {code}"
    return FileSystem({**fs.files, path: "".join(s + "\n" for s in lines)}, dirs=fs.dirs)


def question_fs(metadata: dict) -> FileSystem:
    """The file system of a question (its ``fs_seed`` / ``num_files``, with its planted code), built once."""
    plant = metadata.get("plant")
    return _question_fs(int(metadata["fs_seed"]), int(metadata["num_files"]),
                        None if plant is None else (plant["path"], int(plant["line"]), plant["code"]))


def final_answer(response: str) -> str:
    """The text after the last ``Answer:`` (to the end of its line), else the last non-empty line; stripped of
    spaces, quotes, backticks and a final period."""
    hits = re.findall(r"answer\s*:\s*(.*)", response, flags=re.I)
    lines = [ln for ln in response.strip().splitlines() if ln.strip()]
    text = hits[-1] if hits else (lines[-1] if lines else "")
    return text.strip().rstrip(".").strip().strip("`'\"").strip()




def parse_command(action: str) -> Optional[str]:
    """The command text of the ``<shell>...</shell>`` that ends ``action`` (the last opening tag), else ``None``."""
    m = _CALL.search(action.rstrip())
    if m is None:
        return None
    body = m.group(1)
    return body[body.rfind("<shell>") + len("<shell>"):].strip() if "<shell>" in body else body.strip()


@register_env("shell")
@dataclasses.dataclass
class ShellEnv:
    """The shell world (module docstring). ``task``: a :class:`~treejax.envs.shell_task.ShellTask` (its
    verifier); ``max_calls``: commands per episode; ``max_output_chars``: longer outputs are cut (a line says so)."""

    task: Any
    max_calls: int = 3
    max_output_chars: int = 1500
    stop_strings: tuple[str, ...] = ("</shell>",)
    example: Any = None
    cwd: str = "/"
    calls: int = 0
    done: bool = False

    #: The tasks whose world this environment runs (MultiTurnConfig's check refuses others).
    tasks: ClassVar[tuple[str, ...]] = ("shell_files",)
    #: Its examples ship reference calls (``shell`` commands) for MatchTIR's matching rewards.
    reference_calls: ClassVar[bool] = True
    #: Its command turns carry ``info["action_signature"]``, the AST's command-name chain (A³).
    ast_actions: ClassVar[bool] = True
    #: It can replay an expert trajectory (``parse_action`` / ``render_call``): expert-episode SFT
    #: (:mod:`treejax.sft_episodes`) and UI-S1's semi-online rollout (:class:`treejax.envs.semi_online.SemiOnlineEnv`).
    expert_steps: ClassVar[bool] = True

    @staticmethod
    def parse_action(action: str) -> Optional[dict]:
        """The call that ends ``action`` in the reference calls' shape, ``{"name": "shell", "args": {"command":
        text}}``, else ``None`` (the answer turn)."""
        command = parse_command(action)
        return None if command is None else {"name": "shell", "args": {"command": command}}

    @staticmethod
    def render_call(call: dict) -> str:
        """The action text of a call (``<shell>ls /</shell>``), which :meth:`parse_action` reads back as the same
        call."""
        if call.get("name") != "shell":
            raise ValueError(f"the shell world has one tool, 'shell'; got a call to {call.get('name')!r}")
        return f"<shell>{call['args']['command']}</shell>"

    def __post_init__(self):
        if self.max_calls < 0 or self.max_output_chars < 1:
            raise ValueError(f"ShellEnv: max_calls >= 0 and max_output_chars >= 1 required, got {self.max_calls}, "
                             f"{self.max_output_chars}")
        if getattr(self.task, "world", None) != "shell":
            raise ConfigError(f"environment 'shell' runs on its task's file systems, and task {self.task!r} has "
                              "none; fix: RunConfig.task = 'shell_files'")

    @classmethod
    def from_config(cls, config, task, sandbox) -> "ShellEnv":
        """One episode's world: ``config.max_turns - 1`` commands (the last turn is for the answer), the task's
        ``max_output_chars``."""
        return cls(task, max_calls=config.max_turns - 1, max_output_chars=getattr(task, "max_output_chars", 1500))

    def reset(self, example) -> str:
        self.example, self.cwd, self.calls, self.done = example, "/", 0, False
        question_fs(example.metadata)  # built (and cached) now, not inside the first step
        return ""

    def run(self, command: str) -> tuple[str, bool, str]:
        """``(observation body, error, action signature)`` of one command; moves the working directory."""
        try:
            script = parse(command)
        except ShellSyntaxError as e:
            return f"[error] syntax: {e}", True, SYNTAX_ERROR
        result, self.cwd = execute(script, question_fs(self.example.metadata), self.cwd)
        body = result.out + (result.err + "\n" if result.err else "")
        if len(body) > self.max_output_chars:
            body = body[:self.max_output_chars] + f"\n[output cut at {self.max_output_chars} characters]\n"
        body += f"[exit status {result.status}]\n" if result.status else ""
        return body.rstrip("\n"), result.status != 0, signature(script)

    def step(self, action: str) -> StepResult:
        return tool_step(self, action, parse_command, self._run, calls_word="commands")

    def _run(self, command: str) -> tuple[str, dict]:
        t = time.perf_counter()
        body, error, sig = self.run(command)
        return body, {"tool_seconds": time.perf_counter() - t, "tool_error": error,
                      "tool_call": {"name": "shell", "args": {"command": command}}, "action_signature": sig}

    def clone(self) -> "ShellEnv":
        return dataclasses.replace(self)  # plain immutable state; the file system is shared, read-only


__all__ = ["EXTENSIONS", "INSTRUCTION", "SYNTAX_ERROR", "ShellEnv", "TEMPLATES", "TOP_DIRS",
           "final_answer", "generate_fs", "make_question", "parse_command", "question_fs"]
