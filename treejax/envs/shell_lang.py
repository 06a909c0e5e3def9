"""A small shell language for the shell world (:mod:`treejax.envs.shell`): a parser into typed AST nodes and an
interpreter over an in-memory, read-only file system.

Grammar (what :func:`parse` accepts; anything else is a :class:`ShellSyntaxError` with a one-line message)::

    script   := pipeline ( "&&" pipeline )*
    pipeline := command ( "|" command )*
    command  := WORD WORD*                       (the first word is the command's name)
    WORD     := bare characters | 'single quoted' | "double quoted"   (adjacent parts join: a'b c'"d" is one word)

A backslash escapes the next character outside single quotes. ``;``, ``||``, ``&``, ``>``, ``<``, ``(``, ``)``,
backticks and ``$`` are refused with a message naming them (no sequencing, redirection, subshells or expansion);
words are literal (no glob expansion: patterns go to ``find -name`` and ``grep``).

The AST (frozen dataclasses): :class:`Script` (``pipelines``, joined by ``&&``) of :class:`Pipeline`
(``commands``, joined by ``|``) of :class:`Command` (``name``, ``args``: :class:`Word` nodes with ``text`` and
``quoted``). :func:`signature` is a script's command-name chain (``"find|wc"``, ``"cd && ls"``): the action
sub-chain the A³ estimator groups turns by (:mod:`treejax.rl.advantages.a3`).

Commands (:func:`execute`; paths absolute or relative to the working directory, ``.`` and ``..`` understood):

* ``ls [-F] [path ...]``: the entries of a directory, sorted, directories marked with a trailing ``/`` (always,
  as ``ls -F``); a file argument prints its path;
* ``cd [path]``: change the working directory (no argument: ``/``); like bash, a ``cd`` inside a pipeline of
  several commands runs in a subshell and changes nothing;
* ``pwd``; ``cat [path ...]``: the files' text (no path: its input);
* ``grep [-i -v -c -l -n -r] PATTERN [path ...]``: the lines containing ``PATTERN`` as a fixed string (as
  ``grep -F``: no regular expressions); ``-r`` searches directories recursively (no path: ``.``); several files
  or ``-r`` prefix each line with its file's path; exit status 1 when no line matched;
* ``find [path ...] [-name GLOB] [-type f|d] [-maxdepth N]``: the paths under each start path (itself included),
  depth first in sorted order, filtered by ``fnmatch`` on the base name and by type;
* ``wc [-l -w -c] [path ...]``: newline, word and character counts (no path: of its input, the numbers alone;
  several files: a ``total`` line).

Execution: a pipeline's commands run left to right, each one's output the next one's input; its status is the
last command's; ``a && b`` runs ``b`` only when ``a`` exited 0. Errors (a missing file, an unknown option) are
written as ``cmd: message`` lines with a nonzero status, never raised. Nothing here touches the real disk or
starts a process: the file system is a Python mapping (:class:`FileSystem`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import posixpath
import types
from typing import Callable, Mapping


class ShellSyntaxError(ValueError):
    """A script that does not parse (its message is one line, shown to the agent)."""


@dataclasses.dataclass(frozen=True)
class Word:
    text: str
    quoted: bool = False


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    args: tuple[Word, ...] = ()

    @property
    def argv(self) -> tuple[str, ...]:
        return tuple(w.text for w in self.args)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    commands: tuple[Command, ...]


@dataclasses.dataclass(frozen=True)
class Script:
    pipelines: tuple[Pipeline, ...]


#: The commands :func:`execute` knows (module docstring).
COMMANDS = ("ls", "cd", "pwd", "cat", "grep", "find", "wc")
_REFUSED = {";": "';' (sequencing: use &&)", "&": "'&' (background jobs)", ">": "'>' (redirection)",
            "<": "'<' (redirection)", "(": "'(' (subshells)", ")": "')' (subshells)", "`": "'`' (substitution)",
            "$": "'$' (expansion)"}
_SPECIAL = set(_REFUSED) | {"|", "'", '"', "\\"}


def _read_quoted(text: str, i: int) -> tuple[str, int]:
    """The body of the quoted part starting at ``text[i]`` (a quote) and the index after its closing quote."""
    q, out, j = text[i], [], i + 1
    while j < len(text) and text[j] != q:
        if q == '"' and text[j] == "\\" and j + 1 < len(text) and text[j + 1] in '"\\':
            j += 1
        out.append(text[j])
        j += 1
    if j >= len(text):
        raise ShellSyntaxError(f"unterminated {'single' if q == chr(39) else 'double'} quote at column {i + 1}")
    return "".join(out), j + 1


def tokenize(text: str) -> list:
    """The script's tokens: ``"|"``, ``"&&"`` or :class:`Word` (module docstring)."""
    tokens, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif text.startswith("&&", i):
            tokens.append("&&")
            i += 2
        elif text.startswith("||", i):
            raise ShellSyntaxError(f"'||' at column {i + 1} is not supported (only | and &&)")
        elif c == "|":
            tokens.append("|")
            i += 1
        elif c in _REFUSED:
            raise ShellSyntaxError(f"{_REFUSED[c]} at column {i + 1} is not supported")
        else:
            parts, quoted = [], False
            while i < n and not text[i].isspace() and (text[i] not in _SPECIAL or text[i] in "'\"\\"):
                if text[i] in "'\"":
                    body, i = _read_quoted(text, i)
                    parts.append(body)
                    quoted = True
                elif text[i] == "\\":
                    if i + 1 >= n:
                        raise ShellSyntaxError("a trailing backslash escapes nothing")
                    parts.append(text[i + 1])
                    i += 2
                else:
                    parts.append(text[i])
                    i += 1
            tokens.append(Word("".join(parts), quoted))
    return tokens


def parse(text: str) -> Script:
    """The AST of a script (module docstring's grammar); a :class:`ShellSyntaxError` otherwise."""
    tokens = tokenize(text)
    if not tokens:
        raise ShellSyntaxError("empty command")
    pipelines, commands, words = [], [], []
    for k, tok in enumerate(tokens + ["<end>"]):
        if isinstance(tok, Word):
            words.append(tok)
            continue
        if not words:
            where = "at the start" if k == 0 else f"after {tokens[k - 1]!r}" if tok != "<end>" else "at the end"
            raise ShellSyntaxError(f"a command is missing {where}" if tok == "<end>" else
                                   f"{tok!r} {where} has no command before it")
        if words[0].text not in COMMANDS:
            raise ShellSyntaxError(f"unknown command {words[0].text!r} (known: {', '.join(COMMANDS)})")
        commands.append(Command(words[0].text, tuple(words[1:])))
        words = []
        if tok != "|":
            pipelines.append(Pipeline(tuple(commands)))
            commands = []
    return Script(tuple(pipelines))


def signature(script: Script) -> str:
    """The script's command-name chain: names joined by ``|`` within a pipeline, pipelines by `` && ``."""
    return " && ".join("|".join(c.name for c in p.commands) for p in script.pipelines)


# ------------------------------------------------------------------------------------------- the file system
class FileSystem:
    """An immutable in-memory tree: ``files`` maps absolute paths (``/a/b.txt``) to their text; the directories
    are every file's ancestors plus ``dirs`` (empty ones), ``/`` always."""

    def __init__(self, files: Mapping[str, str], dirs=()):
        self.files = types.MappingProxyType({posixpath.normpath(p): t for p, t in files.items()})
        all_dirs = {"/"} | {posixpath.normpath(d) for d in dirs}
        for p in self.files:
            d = posixpath.dirname(p)
            while d not in all_dirs:
                all_dirs.add(d)
                d = posixpath.dirname(d)
        self.dirs = frozenset(all_dirs)
        children: dict[str, list[str]] = {d: [] for d in self.dirs}
        for p in list(self.dirs - {"/"}) + list(self.files):
            children[posixpath.dirname(p)].append(posixpath.basename(p))
        self.children = types.MappingProxyType({d: tuple(sorted(c)) for d, c in children.items()})
        if any(not p.startswith("/") for p in self.files) or set(self.files) & self.dirs:
            raise ValueError("FileSystem: file paths must be absolute and distinct from directories")

    def __eq__(self, other):
        return isinstance(other, FileSystem) and dict(self.files) == dict(other.files) and self.dirs == other.dirs

    __hash__ = None

    def walk(self, top: str):
        """``(absolute path, depth below top)`` of ``top`` and everything under it, depth first, sorted."""
        yield top, 0
        if top in self.dirs:
            for name in self.children[top]:
                for path, depth in self.walk(posixpath.join(top, name)):
                    yield path, depth + 1


@dataclasses.dataclass
class _Ctx:
    fs: FileSystem
    cwd: str

    def resolve(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.cwd, path)).replace("//", "/")


@dataclasses.dataclass(frozen=True)
class Result:
    """One command's or script's ``out`` (standard output), ``err`` (error lines) and exit ``status``."""

    out: str = ""
    err: str = ""
    status: int = 0


def _flags(cmd: str, argv: tuple[str, ...], allowed: str) -> tuple[set, list[str]]:
    """``(flags, operands)``: leading ``-xyz`` words split into letters (``--`` ends them); an unknown letter
    raises ``ValueError`` with the command's message."""
    flags, i = set(), 0
    while i < len(argv) and argv[i].startswith("-") and len(argv[i]) > 1:
        if argv[i] == "--":
            i += 1
            break
        for ch in argv[i][1:]:
            if ch not in allowed:
                raise ValueError(f"{cmd}: invalid option -- '{ch}'")
            flags.add(ch)
        i += 1
    return flags, list(argv[i:])


def _ls(ctx: _Ctx, argv, stdin) -> Result:
    _, paths = _flags("ls", argv, "F1")
    paths = paths or ["."]
    full = {p: ctx.resolve(p) for p in paths}
    err = [f"ls: cannot access '{p}': No such file or directory" for p in paths
           if full[p] not in ctx.fs.files and full[p] not in ctx.fs.dirs]
    out = [p for p in paths if full[p] in ctx.fs.files]  # files first, then each directory (as ls does)
    for p in (p for p in paths if full[p] in ctx.fs.dirs):
        if len(paths) > 1:
            out += ([""] if out else []) + [f"{p}:"]
        out += [n + "/" if posixpath.join(full[p], n) in ctx.fs.dirs else n for n in ctx.fs.children[full[p]]]
    return Result("".join(line + "\n" for line in out), "\n".join(err), 2 if err else 0)


def _cd(ctx: _Ctx, argv, stdin) -> Result:
    if len(argv) > 1:
        return Result("", "cd: too many arguments", 1)
    full = ctx.resolve(argv[0]) if argv else "/"
    if full not in ctx.fs.dirs:
        what = "Not a directory" if full in ctx.fs.files else "No such file or directory"
        return Result("", f"cd: {argv[0]}: {what}", 1)
    ctx.cwd = full
    return Result()


def _pwd(ctx: _Ctx, argv, stdin) -> Result:
    return Result(ctx.cwd + "\n")


def _read(ctx: _Ctx, cmd: str, path: str) -> tuple[str | None, str]:
    """``(text, "")`` of a file, or ``(None, error line)``."""
    full = ctx.resolve(path)
    if full in ctx.fs.files:
        return ctx.fs.files[full], ""
    return None, f"{cmd}: {path}: {'Is a directory' if full in ctx.fs.dirs else 'No such file or directory'}"


def _cat(ctx: _Ctx, argv, stdin) -> Result:
    _, paths = _flags("cat", argv, "")
    if not paths:
        return Result(stdin)
    out, err = [], []
    for p in paths:
        text, e = _read(ctx, "cat", p)
        out.append(text or "")
        err += [e] if e else []
    return Result("".join(out), "\n".join(err), 1 if err else 0)


def _grep_sources(ctx: _Ctx, flags: set, paths: list[str], stdin: str):
    """``(display name or None, text)`` of every input of grep, and the error lines."""
    if not paths:
        if "r" not in flags:
            return [(None, stdin)], []
        paths = ["."]
    sources, err = [], []
    for p in paths:
        full = ctx.resolve(p)
        if full in ctx.fs.dirs and "r" in flags:
            for sub, _ in ctx.fs.walk(full):
                if sub in ctx.fs.files:
                    rel = posixpath.relpath(sub, full)
                    sources.append((p.rstrip("/") + "/" + rel if p != "/" else sub, ctx.fs.files[sub]))
            continue
        text, e = _read(ctx, "grep", p)
        if text is None:
            err.append(e)
        else:
            sources.append((p, text))
    return sources, err


def _grep(ctx: _Ctx, argv, stdin) -> Result:
    flags, rest = _flags("grep", argv, "ivclnrRF")
    flags |= {"r"} if "R" in flags else set()
    if not rest:
        return Result("", "grep: no pattern (usage: grep [-ivclnr] PATTERN [path ...])", 2)
    pattern, paths = rest[0], rest[1:]
    sources, err = _grep_sources(ctx, flags, paths, stdin)
    prefix = len(sources) > 1 or "r" in flags
    needle = pattern.lower() if "i" in flags else pattern
    out, matched = [], False
    for name, text in sources:
        hits = [(i, line) for i, line in enumerate(text.splitlines(), 1)
                if ((needle in line.lower()) if "i" in flags else (needle in line)) != ("v" in flags)]
        matched = matched or bool(hits)
        lead = f"{name}:" if prefix and name is not None else ""
        if "l" in flags:
            out += [name if name is not None else "(standard input)"] if hits else []
        elif "c" in flags:
            out.append(f"{lead}{len(hits)}")
        else:
            out += [f"{lead}{f'{i}:' if 'n' in flags else ''}{line}" for i, line in hits]
    return Result("".join(line + "\n" for line in out), "\n".join(err), 2 if err and not matched else int(not matched))


def _find_args(argv) -> tuple[list[str], dict]:
    """``(start paths, predicates)`` of find's arguments; ``ValueError`` with find's message otherwise."""
    k = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    starts, preds, rest = list(argv[:k]) or ["."], {}, list(argv[k:])
    while rest:
        op = rest.pop(0)
        if op not in ("-name", "-type", "-maxdepth"):
            raise ValueError(f"find: unknown predicate '{op}' (known: -name, -type, -maxdepth)")
        if not rest:
            raise ValueError(f"find: missing argument to '{op}'")
        val = rest.pop(0)
        if op == "-type" and val not in ("f", "d"):
            raise ValueError(f"find: -type takes f or d, got '{val}'")
        if op == "-maxdepth" and not val.isdigit():
            raise ValueError(f"find: -maxdepth takes a number, got '{val}'")
        preds[op] = int(val) if op == "-maxdepth" else val
    return starts, preds


def _find(ctx: _Ctx, argv, stdin) -> Result:
    starts, preds = _find_args(argv)
    out, err = [], []
    for p in starts:
        full = ctx.resolve(p)
        if full not in ctx.fs.dirs and full not in ctx.fs.files:
            err.append(f"find: '{p}': No such file or directory")
            continue
        for sub, depth in ctx.fs.walk(full):
            if depth > preds.get("-maxdepth", depth):
                continue
            kind = "d" if sub in ctx.fs.dirs else "f"
            if preds.get("-type", kind) != kind or not fnmatch.fnmatchcase(posixpath.basename(sub) or "/",
                                                                             preds.get("-name", "*")):
                continue
            rel = posixpath.relpath(sub, full)
            out.append(p if rel == "." else (p.rstrip("/") + "/" + rel if p != "/" else sub))
    return Result("".join(line + "\n" for line in out), "\n".join(err), 1 if err else 0)


def _wc(ctx: _Ctx, argv, stdin) -> Result:
    flags, paths = _flags("wc", argv, "lwc")
    keys = [k for k in "lwc" if k in flags] or list("lwc")
    count = lambda t: [{"l": t.count("\n"), "w": len(t.split()), "c": len(t)}[k] for k in keys]  # noqa: E731
    if not paths:
        return Result(" ".join(map(str, count(stdin))) + "\n")
    out, err, total = [], [], [0] * len(keys)
    for p in paths:
        text, e = _read(ctx, "wc", p)
        if text is None:
            err.append(e)
            continue
        c = count(text)
        total = [a + b for a, b in zip(total, c)]
        out.append(" ".join(map(str, c)) + f" {p}")
    if len(paths) > 1:
        out.append(" ".join(map(str, total)) + " total")
    return Result("".join(line + "\n" for line in out), "\n".join(err), 1 if err else 0)


_RUN: dict[str, Callable] = {"ls": _ls, "cd": _cd, "pwd": _pwd, "cat": _cat, "grep": _grep, "find": _find,
                             "wc": _wc}


def run_pipeline(pipeline: Pipeline, fs: FileSystem, cwd: str) -> tuple[Result, str]:
    """``(result, working directory after it)``: errors of every command, the last one's output and status."""
    data, errs, status = "", [], 0
    for cmd in pipeline.commands:
        ctx = _Ctx(fs, cwd)
        try:
            r = _RUN[cmd.name](ctx, cmd.argv, data)
        except ValueError as e:
            r = Result("", str(e), 2)
        data, status = r.out, r.status
        errs += [r.err] if r.err else []
        if len(pipeline.commands) == 1:
            cwd = ctx.cwd  # a lone cd changes the shell's directory; inside a pipeline it runs in a subshell
    return Result(data, "\n".join(errs), status), cwd


def execute(script: Script, fs: FileSystem, cwd: str = "/") -> tuple[Result, str]:
    """Run a parsed script (module docstring): ``(result, working directory after it)``; the output and error
    lines of every pipeline that ran, the last one's status."""
    out, errs, status = [], [], 0
    for pipeline in script.pipelines:
        r, cwd = run_pipeline(pipeline, fs, cwd)
        out.append(r.out)
        errs += [r.err] if r.err else []
        status = r.status
        if status != 0:
            break
    return Result("".join(out), "\n".join(errs), status), cwd


__all__ = ["COMMANDS", "Command", "FileSystem", "Pipeline", "Result", "Script", "ShellSyntaxError", "Word",
           "execute", "parse", "run_pipeline", "signature", "tokenize"]
