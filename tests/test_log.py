"""The treejax logger keeps its own handler: library imports that configure the root logger cannot mute it."""

import logging

import pytest

from treejax.log import configure_logging


@pytest.fixture
def treejax_logger():
    """Restores the treejax logger (handlers, level, propagation) and the root logger's level after the test."""
    logger, root = logging.getLogger("treejax"), logging.getLogger()
    handlers, level, propagate, root_level = list(logger.handlers), logger.level, logger.propagate, root.level
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate
    root.setLevel(root_level)


def test_step_lines_survive_library_logging_setup(treejax_logger, capsys):
    import absl.logging  # noqa: F401
    import orbax.checkpoint  # noqa: F401

    # importing orbax.checkpoint gives the root logger a handler, so basicConfig(level=INFO) is a no-op and the
    # root stays at WARNING (set here too, in case another test changed it): INFO records of treejax.* died there
    logging.getLogger().setLevel(logging.WARNING)
    logging.basicConfig(level=logging.INFO)
    assert logging.getLogger().level == logging.WARNING
    configure_logging(quiet=False)
    configure_logging(quiet=False)  # idempotent: one handler, one line per record
    logging.getLogger("treejax.rl.loop").info("step 3 reward 0.5")
    err = capsys.readouterr().err
    assert err.count("step 3 reward 0.5") == 1 and err.endswith(" step 3 reward 0.5\n")


def test_quiet_keeps_warnings_only(treejax_logger, capsys):
    configure_logging(quiet=True)
    logging.getLogger("treejax.rl.loop").info("step line")
    logging.getLogger("treejax.rl.loop").warning("non-finite loss")
    err = capsys.readouterr().err
    assert "step line" not in err and "non-finite loss" in err


def test_run_from_python_shows_progress(treejax_logger, capsys):
    """``loop.run`` from Python: an unconfigured treejax logger gets INFO and a handler when none exists on the
    way to the root; a configured one (a handler or a level of its own) is left alone."""
    from treejax.log import show_progress

    logger, root = logging.getLogger("treejax"), logging.getLogger()
    logger.handlers[:] = []
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    root_handlers = list(root.handlers)
    root.handlers[:] = []  # a plain `python script.py`: nobody configured logging
    try:
        show_progress()
        logging.getLogger("treejax.rl.loop").info("step 1/3 | reward/mean -1")
        assert "step 1/3 | reward/mean -1" in capsys.readouterr().err
    finally:
        root.handlers[:] = root_handlers
    logger.handlers[:] = []
    logger.setLevel(logging.WARNING)  # the caller chose: stays
    show_progress()
    assert logger.level == logging.WARNING and not logger.handlers
