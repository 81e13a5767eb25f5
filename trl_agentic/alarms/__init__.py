"""Alarms: training signals checked against each other and against a held-out measure (issue #11).

GRPO amplifies whatever the checker rewards and learns only from groups whose episodes disagree. Training reward alone
cannot tell learning from gaming, so a run is watched for seven patterns, each a pure function over metric histories
(`{metric: [(global_step, value), ...]}`, as logged):

- `reward_hacking`: training reward rose by `reward_rise` since a held-out evaluation while held-out success gained
  less than `held_out_min_gain` (it fell or stayed flat), beyond the noise of both measurements: the policy may be
  gaming the checker. With a target difficulty (adaptive sampling), the training success at the target on tasks drawn
  for the first time (`sampling/target_success_unseen`) stands for the reward: the mean reward moves with the mix of
  difficulties drawn, and a revisited task may have been learned by heart, which held-out tasks cannot be.
- `length_drift`: sampled tokens or turns per episode grew by `length_growth` (relative) while the reward did not
  rise by `reward_rise`.
- `malformed_tool_calls` / `unscorable_episodes`: the share of model calls with a malformed tool call, or of episodes
  that could not be scored (or failed), rose by `spike` over its earlier level. With a difficulty column, both are
  compared at the same mix of difficulties (an adaptive sampler moving to tasks where the policy writes broken calls,
  or times out, more often is not the policy breaking; [`malformed_spike`], [`unscorable_spike`]).
- `entropy_collapse`: mean token entropy fell below `entropy_ratio` x its level at the start of training.
- `low_split_rate`: the split rate (groups whose rewards differ, `1 - frac_reward_zero_std`) stayed below
  `min_split_rate`: most groups give GRPO nothing to learn from.
- `sampled_flat`: with tree rollouts, some tasks' branches never replayed a call of their parent
  (`tree/sampled_flat_tasks` > 0 at the last logged step): their agent's requests change from run to run, each branch
  is sampled whole (`docs/tree_rollouts.md`).

[`AlarmsCallback`] wires them into a `Trainer`: every log gets `alarms/<name>` (1.0 while the alarm holds, else 0.0),
a new alarm is emitted as a [`TrainingAlarm`] warning, and `output_dir/alarms.json` lists every alarm of the run. With
`held_out_eval_steps > 0` it also evaluates the live policy on the trainer's `eval_dataset` (a split never trained on)
with [`trl_agentic.evaluation.Evaluator`] and logs `held_out/success` (successes over all episodes).

One module per concern: `definitions` (the names, [`AlarmSettings`], [`Alarm`], [`TrainingAlarm`]), `detectors` (the
pure functions below), `checks` ([`check_alarms`]: a logged history through every detector), `histories` (a history
from a finished run's `log_history` or episode log), `callback` ([`AlarmsCallback`]) and `attach` ([`attach_alarms`]
and the trainer's held-out evaluation it attaches). Import from `trl_agentic.alarms`.

Example (offline, on the log history of a finished run):

```python
>>> from trl_agentic.alarms import check_alarms, history_from_log_history
>>> history = history_from_log_history(trainer.state.log_history)
>>> [alarm.name for alarm in check_alarms(history)]
['low_split_rate']
```
"""

from .attach import TrainerHeldOutEvaluator, attach_alarms
from .callback import AlarmsCallback, HeldOutEvaluator
from .checks import check_alarms, derived_series
from .definitions import ALARM_NAMES, Alarm, AlarmSettings, History, Series, TrainingAlarm
from .detectors import (
    entropy_collapse,
    length_drift,
    low_split_rate,
    malformed_spike,
    reward_hacking,
    sampled_flat,
    spike,
    unscorable_spike,
)
from .histories import episode_reward, history_from_episode_records, history_from_log_history


__all__ = [
    "ALARM_NAMES",
    "Alarm",
    "AlarmSettings",
    "AlarmsCallback",
    "HeldOutEvaluator",
    "History",
    "Series",
    "TrainerHeldOutEvaluator",
    "TrainingAlarm",
    "attach_alarms",
    "check_alarms",
    "derived_series",
    "entropy_collapse",
    "episode_reward",
    "history_from_episode_records",
    "history_from_log_history",
    "length_drift",
    "low_split_rate",
    "sampled_flat",
    "malformed_spike",
    "reward_hacking",
    "spike",
    "unscorable_spike",
]
