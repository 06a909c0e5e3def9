"""Errors by kind: the UserError classes keep their builtin bases; ``record_failure`` writes failure.json."""

import json
import time

import pytest

from treejax.errors import ConfigError, DataError, ModelFileError, UserError, UserFileError, record_failure


@pytest.mark.parametrize("cls, builtin", [(ConfigError, ValueError), (DataError, ValueError),
                                          (UserFileError, FileNotFoundError), (ModelFileError, FileNotFoundError)])
def test_user_errors_are_their_builtins(cls, builtin):
    with pytest.raises(builtin):  # code catching the builtin keeps working
        raise cls("x")
    assert issubclass(cls, UserError)


def _update_step():
    raise FloatingPointError("loss is nan")


def test_record_failure_writes_step_type_message_traceback_time(tmp_path):
    try:
        _update_step()
    except FloatingPointError as e:
        path = record_failure(str(tmp_path / "run"), 7, e)
    with open(path) as f:
        record = json.load(f)
    assert path == str(tmp_path / "run" / "failure.json")
    assert record["step"] == 7 and record["type"] == "FloatingPointError" and record["message"] == "loss is nan"
    assert record["user_error"] is False
    assert "in _update_step" in record["traceback"] and record["traceback"].endswith("FloatingPointError: loss "
                                                                                     "is nan\n")
    assert abs(time.mktime(time.strptime(record["time"], "%Y-%m-%dT%H:%M:%S%z")) - time.time()) < 60


def test_record_failure_of_a_user_error_before_the_first_step(tmp_path):
    record_failure(str(tmp_path), None, ModelFileError("model '/x' not found"))
    with open(tmp_path / "failure.json") as f:
        record = json.load(f)
    assert record["step"] is None and record["user_error"] is True
    assert record["type"] == "treejax.errors.ModelFileError" and record["message"] == "model '/x' not found"
