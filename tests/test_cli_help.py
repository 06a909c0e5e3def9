"""The CLI helps (issue 24): the launcher's usage, the step line with an ETA, notebook-friendly registration."""

import dataclasses

import pytest

from treejax.rl.report import step_line


def test_launcher_usage_shows_trainer_args(capsys):
    from treejax import launch

    with pytest.raises(SystemExit) as exit_:
        launch.main(["--platform", "cpu"])  # -n missing: argparse prints the usage
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m treejax.launch -n N [options] -- TRAINER_ARGS ...\n")


def test_step_line_has_the_results_and_an_eta():
    host = {"reward/mean": -0.5, "reward/accuracy": 0.25, "rollout/decoded_tokens": 834}
    assert step_line(1, 3, host, 150.2) == ("step 1/3 done in 150.2 s: reward -0.500, accuracy 25.0%, 834 decoded "
                                            "tokens | ETA 05:00")
    assert step_line(3, 3, host, 10.0).endswith("| last step")
    assert step_line(2, 100, host, 3.0).endswith("| ETA 04:54")


def test_register_estimator_and_rule_take_overwrite():
    """Running a notebook's registration cell twice: an error without ``overwrite``, a replacement with it."""
    import treejax.rl.advantages as adv
    from treejax.sampling import branching as B

    @dataclasses.dataclass(frozen=True)
    class Opts:
        pass

    def first(forest, rewards_PxW, options):
        return None

    def second(forest, rewards_PxW, options):
        return None

    adv.register_estimator("notebook_estimator_i24", Opts)(first)
    try:
        with pytest.raises(ValueError, match="already registered.*overwrite=True"):
            adv.register_estimator("notebook_estimator_i24", Opts)(second)
        adv.register_estimator("notebook_estimator_i24", Opts, overwrite=True)(second)
        assert adv.get_estimator("notebook_estimator_i24") is second
    finally:
        adv.registry._REGISTRY.pop("notebook_estimator_i24", None)

    def rule():
        @dataclasses.dataclass(frozen=True)
        class Mine(B.FixedAverage):
            pass
        return Mine

    one, two = rule(), rule()
    B.register("notebook_rule_i24")(one)
    try:
        with pytest.raises(ValueError, match="already registered.*overwrite=True"):
            B.register("notebook_rule_i24")(two)
        B.register("notebook_rule_i24", overwrite=True)(two)
        assert B.rule_classes()["notebook_rule_i24"] is two
    finally:
        B.base._REGISTRY.pop("notebook_rule_i24", None)
