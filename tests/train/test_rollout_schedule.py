"""``--rollout-schedule`` is one typed choice: every name parses and prints back, the old flags
are aliases that build the same configuration, and a schedule that contradicts its aliases is
refused at parse time naming the flag to drop or add."""

from __future__ import annotations

import pytest

from megatron_rl.train.config import parse_args
from megatron_rl.train.rollouts.schedule import SCHEDULES, RolloutSchedule

SPANNING = ["--behavior-logprobs", "rollout"]


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_name_parses_and_prints_back(name):
    assert RolloutSchedule.parse(name).name == name


def test_partial_without_overlap_is_not_a_schedule():
    with pytest.raises(ValueError, match="overlaps training"):
        RolloutSchedule(partial=True)


@pytest.mark.parametrize(
    ("schedule", "aliases"),
    [
        (["--rollout-schedule", "sync"], []),
        (["--rollout-schedule", "async"], ["--async-rollout"]),
        (["--rollout-schedule", "partial", *SPANNING], ["--async-rollout", "--partial-rollout"]),
        (["--rollout-schedule", "carry-over", "--carry-over-groups", "2", *SPANNING], []),
        (
            ["--rollout-schedule", "async+carry-over", "--carry-over-groups", "2", *SPANNING],
            ["--async-rollout"],
        ),
        (
            ["--rollout-schedule", "partial+carry-over", "--carry-over-groups", "2", *SPANNING],
            ["--async-rollout", "--partial-rollout"],
        ),
    ],
)
def test_the_old_flags_build_the_same_configuration_as_the_schedule(schedule, aliases):
    rest = schedule[2:]  # --carry-over-groups and the behaviour policy stay
    by_name = parse_args(schedule)
    by_alias = parse_args(aliases + rest)
    assert by_name == by_alias
    assert by_name.rollout.schedule == RolloutSchedule.parse(schedule[1])
    assert by_name.rollout.schedule.name == schedule[1]


def test_the_default_schedule_is_sync():
    config = parse_args([])
    assert config.rollout.schedule.name == "sync"
    assert not config.rollout.async_rollout and not config.rollout.partial_rollout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rollout-schedule", "sync", "--async-rollout"], "drop --async-rollout"),
        (["--rollout-schedule", "async", "--partial-rollout"], "drop --partial-rollout"),
        (["--rollout-schedule", "carry-over", *SPANNING], "needs --carry-over-groups M > 0"),
        (
            ["--rollout-schedule", "async", "--carry-over-groups", "2", *SPANNING],
            "use --rollout-schedule async\\+carry-over",
        ),
        # the alias rules from before the schedule, unchanged
        (["--partial-rollout", *SPANNING], "--partial-rollout needs --async-rollout"),
        (["--rollout-schedule", "partial"], "--partial-rollout: a sample spanning weight"),
        (["--rollout-schedule", "sync", "--max-staleness", "2"], "synchronous rollouts"),
    ],
)
def test_a_schedule_contradicting_its_flags_is_refused_naming_the_fix(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_args(argv)


def test_an_unknown_schedule_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--rollout-schedule", "eager"])
    assert "invalid choice: 'eager'" in capsys.readouterr().err
