"""The gin surface of treejax's programs: which classes gin knows, and the check every gin file and binding goes
through before gin reads it (``treejax-train``, ``treejax-sft``, ``treejax-eval`` and notebooks all parse here).

Registration (:func:`register_configurables`) comes from the registries (:class:`treejax.registry.Registry`):
every sampling strategy, branching rule, shaper and allocator class, and every estimator's options class, is
gin-registered by iterating its registry, so a class registered in a notebook or an imported module is a gin
name too. Only the configuration classes that belong to no registry are listed here (:func:`_core_configs`,
:func:`_source_configs`). gin knows every class by its class name (``TreeConfig.branching = @FixedAverage()``).

The check (:func:`check_config`): every file (with its includes) and every ``--gin_param`` goes through gin's
own parser and each ``Configurable.param`` binding is checked: a name that is no configurable or no parameter is
an error that suggests the closest valid name, and a literal value must match the field's annotation
(:mod:`treejax.config_types`). :func:`parse` then lets gin build the root config, checks it again (nested
configs included), refuses bindings nothing used, the mesh against the devices and the task name. Everything it
raises is a :class:`~treejax.errors.UserError` of one line.

:func:`add_gin_arguments` / :func:`gin_files_of`: the gin options every gin-configured CLI takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import logging
import os
import re
import tokenize
from typing import Any

import gin
from gin import config_parser

from treejax.choices import closest_first
from treejax.config_types import check_field, check_types, field_types
from treejax.errors import ConfigError, UserFileError

__all__ = ["add_gin_arguments", "check_config", "check_devices", "configurable_classes", "gin_files_of", "parse",
           "register_configurables"]


# ----------------------------------------------------------------------------------------------- registration
def _core_configs() -> dict[str, type]:
    """The configuration classes of the programs, in no registry (the order suggestions list them in)."""
    from treejax.envs.semi_online import SemiOnlineConfig
    from treejax.models.lora import LoRAConfig
    from treejax.parallel.mesh import MeshConfig
    from treejax.precision import Precision
    from treejax.rl.config import AsyncConfig, RunConfig
    from treejax.rl.evaluation import EvalConfig
    from treejax.rl.losses import LossConfig
    from treejax.rl.optimizer import OptimizerConfig
    from treejax.rl.packing import PackingConfig
    from treejax.sampling.tree import TreeConfig
    from treejax.scorers.config import ScorerConfig
    from treejax.scorers.refiner import RefinerConfig
    from treejax.scorers.trainable import TrainableScorerConfig
    from treejax.sft_config import OTRConfig, SFTConfig

    return {"RunConfig": RunConfig, "SFTConfig": SFTConfig, "OTRConfig": OTRConfig,
            "TreeConfig": TreeConfig, "LossConfig": LossConfig, "OptimizerConfig": OptimizerConfig,
            "MeshConfig": MeshConfig, "Precision": Precision, "PackingConfig": PackingConfig,
            "AsyncConfig": AsyncConfig, "EvalConfig": EvalConfig, "ScorerConfig": ScorerConfig,
            "TrainableScorerConfig": TrainableScorerConfig, "LoRAConfig": LoRAConfig,
            "SemiOnlineConfig": SemiOnlineConfig, "RefinerConfig": RefinerConfig}


def _source_configs() -> dict[str, type]:
    """Every rollout stage (:data:`treejax.rl.sources.base.STAGES`; the catalog imports the shipped ones)."""
    from treejax.rl.sources import catalog  # noqa: F401  (registers every shipped rollout stage)
    from treejax.rl.sources.base import STAGES

    return STAGES.classes()


def configurable_classes() -> dict[str, type]:
    """``{gin name: class}`` of every configurable: the core configs, then each registry's classes by class name
    (strategies, branching rules, shapers), the rollout sources' configs, the allocators and every estimator's
    options class. The order is the one gin's error messages list names in."""
    from treejax.rl.advantages import ESTIMATORS
    from treejax.rl.allocation import ALLOCATORS
    from treejax.rl.shaping import SHAPERS
    from treejax.sampling.branching import RULES
    from treejax.sampling.strategies import STRATEGIES

    classes = _core_configs()
    groups = [STRATEGIES.classes().values(),  # TreeConfig.strategy = @TopP()
              RULES.classes().values(),  # TreeConfig.branching = @FixedAverage(), @ECHO(), ...
              SHAPERS.classes().values(),  # RunConfig.shapers = [@EchoShaping(), ...]
              _source_configs().values(),  # RunConfig.rollouts = [@DOTSConfig(), @ReplayConfig()], ...
              ALLOCATORS.classes().values(),  # AllocationConfig.allocator = @DARS(), @RolloutGDRO(), ...
              [ESTIMATORS.get(name).options_cls for name in ESTIMATORS.names()]]  # RunConfig.estimator_options
    for group in groups:
        for cls in group:
            classes.setdefault(cls.__name__, cls)
    return classes


_GIN_NAMES: set[str] = set()  # the names this module has registered with gin


def register_configurables() -> dict[str, type]:
    """Registers every configurable class with gin (each name once: a class registered since the last call is
    added); returns :func:`configurable_classes`."""
    classes = configurable_classes()
    for name, cls in classes.items():
        if name not in _GIN_NAMES:
            gin.external_configurable(cls, name=name)
            _GIN_NAMES.add(name)
    return classes


# ----------------------------------------------------------------------------------------------- the gin check
@dataclasses.dataclass(frozen=True)
class _Reference:
    """``@name`` or ``@name()`` in a parsed gin value (recorded by name: the check leaves gin's state alone)."""

    name: str
    evaluate: bool


@dataclasses.dataclass(frozen=True)
class _Macro:
    """``%name`` in a parsed gin value."""

    name: str


class _RecordingDelegate(config_parser.ParserDelegate):
    """Makes gin's parser return references and macros as :class:`_Reference` / :class:`_Macro`."""

    def configurable_reference(self, scoped_configurable_name, evaluate):
        return _Reference(scoped_configurable_name, evaluate)

    def macro(self, macro_name):
        return _Macro(macro_name)


@dataclasses.dataclass(frozen=True)
class _Located:
    """A gin statement and where it comes from (``file:line`` or ``--gin_param``)."""

    statement: Any
    where: str


def _one_line(text: object) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _at(path: str | None, line: int | None) -> str:
    return "--gin_param" if path is None else f"{path}:{line}"


#: ``Class.param = word``: a bare word or path (``/data/x``, ``./runs/a``, ``~/m``, ``Qwen2.5-1.5B/``) where gin
#: expects a Python literal (an unquoted string).
_UNQUOTED = re.compile(r"^\s*([\w./]+\.\w+)\s*=\s*([A-Za-z_./~][^\s'\"\[\]{}(),=@%]*)\s*$")


def _parse_statements(text: str, path: str | None) -> list[_Located]:
    """The statements of gin ``text`` (from file ``path``, or a ``--gin_param`` if None), by gin's own parser.

    A syntax error is a :class:`ConfigError` of one line naming the file and line.
    """
    try:
        return [_Located(st, _at(path, st.location.line_num))
                for st in config_parser.ConfigParser(text, _RecordingDelegate())]
    except SyntaxError as e:
        bare = _UNQUOTED.match(e.text or "")
        if bare and bare.group(2) not in ("True", "False", "None"):
            raise ConfigError(f"{_at(path, e.lineno)}: quote string values: {bare.group(1)}='{bare.group(2)}' "
                              f"(in a shell: --gin_param=\"{bare.group(1)}='{bare.group(2)}'\")") from None
        code = f" in {e.text.strip()!r}" if e.text and e.text.strip() else ""
        raise ConfigError(f"{_at(path, e.lineno)}: gin syntax error{code}: {_one_line(e.msg)}") from None
    except tokenize.TokenError as e:
        raise ConfigError(f"{_at(path, e.args[1][0])}: gin syntax error: {_one_line(e.args[0])}") from None


def _find_include(name: str, search_dirs: list[str], where: str) -> str:
    """The file of an ``include``, looked up as gin does: as given (absolute, or relative to the working
    directory), then in each search directory."""
    for prefix in [""] if os.path.isabs(name) else ["", *search_dirs]:
        path = os.path.join(prefix, name)
        if os.path.isfile(path):
            return path
    raise UserFileError(f"{where}: included gin file {name!r} not found (searched: the working directory, "
                        f"{', '.join(search_dirs)})")


def _file_statements(path: str, search_dirs: list[str], including: tuple[str, ...] = ()) -> list[_Located]:
    """The statements of gin file ``path`` in the order gin applies them, includes expanded in place.

    The folder of every file read is appended to ``search_dirs`` (once), so an include is found next to the
    file that includes it; :func:`parse` gives gin the same search path.
    """
    if os.path.abspath(path) in including:
        raise ConfigError(f"gin include cycle: {' -> '.join(including + (os.path.abspath(path),))}")
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in search_dirs:
        search_dirs.append(folder)
    with open(path) as f:
        text = f.read()
    out = []
    for located in _parse_statements(text, path):
        st = located.statement
        if isinstance(st, config_parser.IncludeStatement):
            inc = _find_include(st.filename, search_dirs, located.where)
            out += _file_statements(inc, search_dirs, including + (os.path.abspath(path),))
        else:
            out.append(located)
    return out


def _did_you_mean(close: list[str]) -> str:
    return f"; did you mean {' or '.join(close[:3])}?" if close else ""


def _close_bindings(selector: str, arg: str, classes: dict[str, type]) -> list[str]:
    """Valid ``Class.param`` names closest to an unknown one: close parameters of the same class (or ``arg`` of
    a class with a close name), then classes that have a parameter ``arg``; else the closest overall."""
    if selector in classes:
        close = [f"{selector}.{a}" for a in difflib.get_close_matches(arg, list(field_types(classes[selector])),
                                                                        n=3, cutoff=0.6)]
    else:
        close = [f"{c}.{arg}" for c in difflib.get_close_matches(selector, list(classes), n=3, cutoff=0.6)
                 if arg in field_types(classes[c])]
    close += [f"{c}.{arg}" for c, cls in classes.items() if arg in field_types(cls) and f"{c}.{arg}" not in close]
    valid = [f"{c}.{a}" for c, cls in classes.items() for a in field_types(cls)]
    return close or difflib.get_close_matches(f"{selector}.{arg}", valid, n=3, cutoff=0.5)


def _gin_knows(selector: str) -> bool:
    """Whether gin has a configurable named ``selector`` (one registered by a module other than this one)."""
    try:
        gin.get_configurable(selector)
    except ValueError:
        return False
    return True


def _references(value) -> list:
    """The references and macros inside a parsed gin value (containers searched)."""
    if isinstance(value, (_Reference, _Macro)):
        return [value]
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in _references(v)]
    return []


def _import(st: config_parser.ImportStatement, where: str) -> bool:
    """Imports the module of a gin ``import`` as gin will (so its configurables register); returns True for
    ``from __gin__ import dynamic_registration``, after which gin alone resolves names it does not know."""
    if st.module.startswith("__gin__."):
        return True
    try:
        importlib.import_module(st.module)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import {st.module!r}: {_one_line(e)}") from e
    return False


def _fitting_classes(cls: type, arg: str, classes: dict[str, type]) -> list[str]:
    """The registered configurables whose instances field ``cls.arg`` takes (its annotation names a base class,
    e.g. ``BranchingRule | None``, or a list of them, ``list[Stage]``): the valid ``@Name()`` values of that field
    (or of its list's items), or [] for other fields."""
    import typing

    tp = field_types(cls)[arg]
    members = []  # the union's members, a list's / tuple's element types in place of the list (RunConfig.rollouts)
    for t in typing.get_args(tp) or (tp,):
        members += typing.get_args(t) if typing.get_origin(t) in (list, tuple) else [t]
    bases = [t for t in members if isinstance(t, type) and typing.get_origin(t) is None
             and t not in (type(None), typing.Any, str, int, float, bool, dict, list, tuple)]
    return [name for name, c in classes.items() if isinstance(c, type) and any(issubclass(c, b) for b in bases)]


def _check_binding(st: config_parser.BindingStatement, where: str, classes: dict[str, type],
                   macros: dict[str, Any], defer_unknown: bool) -> None:
    """``Configurable.param = value``: the name must exist; a literal value (or a macro's) must match the field."""
    key = f"{st.selector}.{st.arg_name}"
    cls = classes.get(st.selector)
    if cls is None and (defer_unknown or _gin_knows(st.selector)):
        return
    if cls is None or st.arg_name not in field_types(cls):
        raise ConfigError(f"{where}: unknown gin binding {key!r}"
                          f"{_did_you_mean(_close_bindings(st.selector, st.arg_name, classes))}")
    value = macros.get(st.value.name, st.value) if isinstance(st.value, _Macro) else st.value
    refs = _references(value)
    for ref in refs:
        name = ref.name.rsplit("/", 1)[-1]
        if isinstance(ref, _Reference) and name not in classes and not (defer_unknown or _gin_knows(name)):
            fitting = _fitting_classes(cls, st.arg_name, classes)
            if fitting:  # e.g. TreeConfig.branching: every registered rule, closest first
                close = difflib.get_close_matches(name, fitting, n=3, cutoff=0.5)
                ordered = closest_first(name, fitting)
                raise ConfigError(f"{where}: unknown configurable @{ref.name} in {key}{_did_you_mean(close) or ';'} "
                                  f"valid: {', '.join(f'@{c}()' for c in ordered)} (closest first); fix: {key} = "
                                  f"@{ordered[0]}()")
            close = difflib.get_close_matches(name, list(classes), n=3, cutoff=0.5)
            raise ConfigError(f"{where}: unknown configurable @{ref.name} in {key}{_did_you_mean(close)}")
    if not refs:
        try:
            check_field(cls, st.arg_name, value)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None


def check_config(gin_files: list[str], gin_params: list[str], classes: dict[str, type]) -> list[str]:
    """Checks gin files (includes followed) and ``--gin_param`` bindings before gin reads them; returns the
    folders, in order, that gin must search for includes (those of the given files, then those of the included
    files, so an include is also found next to the file that includes it).

    Each source is parsed by ``gin.config_parser.ConfigParser``; every ``[scope/]Configurable.param`` binding
    must name a field of a registered dataclass (else the closest names are suggested), and its value, when a
    literal or a macro bound to one, must match the field's annotation. ``import`` statements are imported
    (bindings of configurables they register are left to gin). Raises :class:`~treejax.errors.UserError`.
    """
    search_dirs = list(dict.fromkeys(os.path.dirname(os.path.abspath(p)) for p in gin_files))
    statements = [s for p in gin_files for s in _file_statements(p, search_dirs)]
    statements += [s for p in gin_params for s in _parse_statements(p, None)]
    bindings = [s for s in statements if isinstance(s.statement, config_parser.BindingStatement)]
    macros = {"/".join(filter(None, (s.statement.scope, s.statement.selector))): s.statement.value
              for s in bindings if not s.statement.arg_name}
    defer_unknown = False
    for located in statements:
        st = located.statement
        if isinstance(st, config_parser.ImportStatement):
            defer_unknown = _import(st, located.where) or defer_unknown
        elif isinstance(st, config_parser.BindingStatement) and st.arg_name:
            _check_binding(st, located.where, classes, macros, defer_unknown)
    return search_dirs


# ----------------------------------------------------------------------------------------------- parsing
class _GinSearchNoise(logging.Filter):
    """gin logs an ERROR for every include it first looks up relative to the working directory."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("Path not found:") or msg.startswith("system_path_file_exists"))


def _gin_message(e: Exception) -> str:
    """The message of an exception raised through gin, without the call context gin appends."""
    return _one_line(str(e).split("\n  In call to configurable")[0])


def parse(gin_files: list[str], gin_params: list[str], check_mesh: bool = True, root: str = "RunConfig"):
    """Checks and parses gin files and bindings; returns the built, type-checked ``RunConfig`` (``root``: the
    configurable to build, e.g. ``"SFTConfig"`` for ``treejax-sft``).

    Everything wrong in them (syntax, names, types, ``__post_init__`` checks, bindings nothing uses, the task
    name and, with ``check_mesh``, the mesh against this process's devices) raises a
    :class:`~treejax.errors.UserError` here, before any model is loaded.
    """
    classes = register_configurables()
    top = classes[root]
    logger = logging.getLogger()
    if not any(isinstance(f, _GinSearchNoise) for f in logger.filters):
        logger.addFilter(_GinSearchNoise())
    for path in gin_files:
        if not os.path.isfile(path):
            raise UserFileError(f"gin file not found: {path}")
    for folder in check_config(gin_files, gin_params, classes):
        gin.add_config_file_search_path(folder)
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(gin_files, gin_params, finalize_config=False)
    except (ValueError, SyntaxError, OSError) as e:  # what gin itself rejects beyond check_config
        raise ConfigError(f"gin: {_one_line(e)}") from e
    try:
        cfg = gin.get_configurable(top)()
    except ValueError as e:  # a config's __post_init__ rejected a value
        raise ConfigError(_gin_message(e)) from e
    check_types(cfg)
    _check_unused_bindings(classes)
    if check_mesh:  # not for a program that does not build the run's mesh (treejax-eval reading a run's config)
        check_devices(cfg)
    from treejax.data.tasks import check_task_name  # imports reasoning-gym (~1 s): after the cheaper checks

    check_task_name(cfg.task)
    return cfg


def _takes_a_list(tp) -> bool:
    """Whether annotation ``tp`` takes a list or tuple (``tuple[Stage, ...] | list[Stage]``)."""
    import typing

    return any(typing.get_origin(t) in (list, tuple) for t in (typing.get_args(tp) or (tp,)))


def _check_unused_bindings(classes: dict[str, type]) -> None:
    """A binding of a configurable that the built config never called would be silently ignored (e.g.
    ``MeshConfig.data = 2`` without ``RunConfig.mesh = @MeshConfig()``): a :class:`ConfigError` naming the field
    that takes it."""
    used = {selector for _, selector in gin.config._OPERATIVE_CONFIG}
    for scope, selector in gin.config._CONFIG:
        if selector in used or selector.startswith("gin."):
            continue
        name = selector.rsplit(".", 1)[-1]
        params = ", ".join(f"{name}.{k}" for k in gin.config._CONFIG[(scope, selector)])
        takers = [(f"{owner}.{f}", _takes_a_list(field_types(cls)[f])) for owner, cls in classes.items()
                  for f in field_types(cls) if name in _fitting_classes(cls, f, classes)]
        takers.sort(key=lambda t: not t[1])  # a list of stages (RunConfig.rollouts) before a single-stage field
        fix = (f"remove it, or reference @{name}() from a binding" if not takers else
               f"add @{name}() to {takers[0][0]} (e.g. {takers[0][0]} = [..., @{name}()])" if takers[0][1] else
               f"bind {takers[0][0]} = @{name}()")
        raise ConfigError(f"{params} {'is' if ',' not in params else 'are'} bound but nothing uses @{name}(), so "
                          f"{'it' if ',' not in params else 'they'} would be ignored; fix: {fix}")


def check_devices(cfg) -> None:
    """The mesh of ``cfg`` against the devices this run has (all processes'), before any model loads: a
    :class:`ConfigError` of one line with the fix (``MeshConfig.data = 2`` on 1 device)."""
    import jax

    from treejax.rl.collect import split_devices

    n = jax.device_count()
    try:
        sampler, learner = split_devices(cfg.async_rollouts, jax.devices(), jax.process_count())
        cfg.mesh.shape(len(learner))
        if getattr(cfg, "sampler_mesh", None) is not None:
            try:
                cfg.sampler_mesh.shape(len(sampler))
            except ConfigError as e:
                raise ConfigError(f"RunConfig.sampler_mesh: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{e} (this run has {n} {jax.devices()[0].platform} device{'s' if n > 1 else ''})") \
            from None


# ----------------------------------------------------------------------------------------------- the CLI options
def add_gin_arguments(parser: argparse.ArgumentParser, example: str = "RunConfig.estimator='grpo'") -> None:
    """The gin options every gin-configured CLI takes (``treejax-train``, ``treejax-sft``): positional ``FILE.gin``
    files, ``--gin_file`` (repeatable; the same) and ``--gin_param`` bindings. :func:`gin_files_of` reads them."""
    parser.add_argument("gin_files", nargs="*", metavar="FILE.gin", help="gin config file(s), as --gin_file")
    parser.add_argument("--gin_file", action="append", default=None, help="gin config file (repeatable)")
    parser.add_argument("--gin_param", action="append", default=[],
                        help=f"gin binding, e.g. \"{example}\" (repeatable; quote strings)")


def gin_files_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str] | None:
    """The gin files of :func:`add_gin_arguments`' options, ``--gin_file`` first, then the positional ones (None
    when neither is given); a positional argument that is no ``.gin`` file is the parser's error (exit status 2)."""
    for path in args.gin_files:
        if not path.endswith(".gin"):
            parser.error(f"unexpected argument {path!r}: positional arguments are gin files (FILE.gin, as "
                         "--gin_file); bindings go in --gin_param=\"Class.field=value\"")
    if args.gin_files:
        return (args.gin_file or []) + args.gin_files
    return args.gin_file
