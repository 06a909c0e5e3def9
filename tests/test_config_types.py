"""check_types: config values against their fields' annotations, with errors naming Class.field."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Optional

import pytest

from treejax.config_types import check_types, conforms, type_name
from treejax.errors import ConfigError
from treejax.rl.loop import RunConfig
from treejax.rl.optimizer import OptimizerConfig
from treejax.sampling.strategies import Greedy
from treejax.sampling.tree import TreeConfig


@pytest.mark.parametrize("value, tp, ok", [
    (3, int, True), (True, int, False), (3.0, int, False), ("3", int, False),
    (3, float, True), (3.5, float, True), (False, float, False), ("1e-5", float, False),
    (True, bool, True), (1, bool, False),
    ("a", str, True), (None, str, False),
    (None, Optional[int], True), (None, int | None, True), (2, int | None, True), (2.5, int | None, False),
    ("full", bool | str, True), (1, bool | str, False),
    ((1, 2), tuple[int, int], True), ((1,), tuple[int, int], False), ((1, 2.5), tuple[int, int], False),
    ([1, 2], tuple[int, int], False), ((), tuple[int, ...], True), ((1, 2, 3), tuple[int, ...], True),
    ((1, "2"), tuple[int, ...], False), ((1.0, 0.5, 10), tuple[float, float, int], True),
    ({"a": 1}, dict, True), ([], dict, False), ({"a": 1}, dict[str, int], True), ({"a": "1"}, dict[str, int], False),
    ([1, 2], list[int], True), ([1, "2"], list[int], False),
    ("token-mean", Literal["token-mean", "seq-mean"], True), ("mean", Literal["token-mean"], False),
    (1, Literal[True], False),
    (object(), Any, True), (len, Callable, True), (3, Callable[[int], int], True), (None, Callable | None, True),
    (Greedy(), Greedy, True), (Greedy, Greedy, False),
])
def test_conforms(value, tp, ok):
    assert conforms(value, tp) is ok


@pytest.mark.parametrize("tp, name", [(int | None, "int | None"), (tuple[int, ...], "tuple[int, ...]"),
                                      (Literal["a", "b"], "'a' | 'b'"), (dict[str, Any], "dict[str, Any]"),
                                      (Optional[tuple[float, float, int]], "tuple[float, float, int] | None")])
def test_type_name(tp, name):
    assert type_name(tp) == name


def test_defaults_of_every_config_pass():
    check_types(RunConfig())


@pytest.mark.parametrize("make, message", [
    (lambda: dataclasses.replace(RunConfig(), num_steps=2.5), "RunConfig.num_steps must be int, got 2.5 (float)"),
    (lambda: RunConfig(optimizer=OptimizerConfig(b1="0.9")), "OptimizerConfig.b1 must be float, got '0.9' (str)"),
    (lambda: RunConfig(rollout=TreeConfig(stop_ids=[2])),
     "TreeConfig.stop_ids must be tuple[int, ...] | None, got [2] (list)"),
    (lambda: RunConfig(rollout=TreeConfig(strategy=Greedy)), "TreeConfig.strategy must be Strategy, got <class"),
    (lambda: RunConfig(export_hf=1), "RunConfig.export_hf must be bool, got 1 (int)"),
])
def test_nested_mismatch_names_the_class_and_field(make, message):
    with pytest.raises(ConfigError) as err:
        check_types(make())
    assert str(err.value).startswith(message)


def test_string_annotations_are_resolved():
    @dataclasses.dataclass
    class Local:
        n: "int | None" = None

    check_types(Local(3))
    with pytest.raises(ConfigError, match="Local.n must be int | None, got '3'"):
        check_types(Local("3"))


@pytest.mark.parametrize("make, message", [
    (lambda: RunConfig(num_steps="two"), "RunConfig.num_steps must be int, got 'two' (str)"),
    (lambda: RunConfig(num_steps=2.5), "RunConfig.num_steps must be int, got 2.5 (float)"),
    (lambda: OptimizerConfig(learning_rate="1e-5"), "OptimizerConfig.learning_rate must be float, got '1e-5' (str)"),
    (lambda: RunConfig(rollout=TreeConfig(stop_ids=[2])),
     "TreeConfig.stop_ids must be tuple[int, ...] | None, got [2] (list)"),
])
def test_configs_built_from_python_are_checked_at_once(make, message):
    """Not only through gin: building the config in Python names the field (no comparison error from
    ``__post_init__``, no failure after the model has loaded)."""
    with pytest.raises(ConfigError) as err:
        make()
    assert str(err.value) == message
