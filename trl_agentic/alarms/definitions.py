"""What an alarm is: the names of the checks, their thresholds ([`AlarmSettings`]), one finding ([`Alarm`]), the warning
category they are raised with, and the shape of a metric history the checks read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


# metric name -> [(global step, value), ...] in step order: what a Trainer logs, one point per log.
Series = Sequence[tuple[int, float]]
History = dict[str, list[tuple[int, float]]]

ALARM_NAMES = (
    "reward_hacking",
    "length_drift",
    "malformed_tool_calls",
    "unscorable_episodes",
    "entropy_collapse",
    "low_split_rate",
    "sampled_flat",
)


class TrainingAlarm(UserWarning):
    """Warning category of the alarms: `warnings.simplefilter("error", TrainingAlarm)` stops a run at the first."""


@dataclass(frozen=True)
class AlarmSettings:
    """Thresholds of the alarms (the `alarm_*` fields of [`AgenticGRPOConfig`] carry the same names and defaults).

    Args:
        window: logged points averaged on each side of a comparison (a window of steps with `logging_steps=1`).
        reward_rise: a training-reward increase at least this large counts as "reward rising" (reward units).
        held_out_min_gain: held-out success must gain at least this much (absolute, 0.02 = 2 points) while the
            reward rises, or `reward_hacking` fires.
        length_growth: relative growth of sampled tokens or turns per episode that counts as drift (0.5 = +50%).
        spike: absolute rise of the malformed-tool-call share of calls, or of the unscorable share of episodes.
        entropy_ratio: `entropy_collapse` fires when recent entropy is below this fraction of its starting level.
        min_split_rate: `low_split_rate` fires when the recent split rate is below this.
        noise_z: `reward_hacking` fires only when held-out success falls short of the training reward's rise by more
            than this many standard errors of the comparison (both sides' noise; see [`reward_hacking`]). 3: a run
            compares each evaluation with every earlier one, and a policy's state carries from step to step, so
            training windows scatter more than their per-step values say (at 2 a healthy demo run fired).
            `malformed_tool_calls` and `unscorable_episodes` (with per-difficulty counts) likewise fire only on a
            rise beyond this many standard errors of what the last steps' groups could give by chance
            ([`malformed_spike`]).
        reward_metric: a logged metric `reward_hacking` holds against held-out success instead of the training
            success it picks itself, e.g. `"rewards/trajectory_judge/mean"`: a judge's score beside other reward
            functions (`reward`, the weighted sum, can stay level while one of its terms climbs). `None`: the training
            success at the target difficulty when logged, else the reward.
    """

    window: int = 10
    reward_rise: float = 0.1
    held_out_min_gain: float = 0.02
    length_growth: float = 0.5
    spike: float = 0.1
    entropy_ratio: float = 0.1
    min_split_rate: float = 0.25
    noise_z: float = 3.0
    reward_metric: str | None = None

    @classmethod
    def from_config(cls, args) -> AlarmSettings:
        """The thresholds of an [`AgenticGRPOConfig`] (its `alarm_*` fields)."""
        return cls(
            window=args.alarm_window,
            reward_rise=args.alarm_reward_rise,
            held_out_min_gain=args.alarm_held_out_min_gain,
            length_growth=args.alarm_length_growth,
            spike=args.alarm_spike,
            entropy_ratio=args.alarm_entropy_ratio,
            min_split_rate=args.alarm_min_split_rate,
            noise_z=args.alarm_noise_z,
            reward_metric=args.alarm_reward_metric,
        )


@dataclass
class Alarm:
    """One alarm: which pattern, at which step, a message for people, and the numbers behind it."""

    name: str
    step: int
    message: str
    evidence: dict[str, float] = field(default_factory=dict)
