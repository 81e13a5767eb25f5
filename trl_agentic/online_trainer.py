"""Online RL from live traffic: `OnlineGRPOTrainer` trains on the rewarded episodes users' traffic left in the store,
with TRL's GRPO loss, and publishes each optimizer step as a candidate version for gradual rollout.

Serving (`trl-agentic serve --store PATH`, `endpoint/users.py`) stores every closed episode of a user key and the
rewards that arrive for it. This trainer claims them step by step (`EpisodeStore.claim_for_training`: each episode
once, ever) instead of running agents, and from there everything is the `AgenticGRPOTrainer`'s: the episode's exact
ids become rows (only sampled tokens trained), TRL's loss, KL and importance-sampling correction, the episode log.

- **Groups.** GRPO needs a baseline. Clients name their episodes' tasks (`users.py`: stored as a task fingerprint), and
  real traffic repeats tasks, so a step first claims **whole groups of `num_generations` episodes of one fingerprint**
  (`EpisodeStore.claim_for_training(group=...)`), waiting up to `group_wait` seconds for them to fill: their advantage
  is TRL's, the reward minus the mean of episodes of the same task. What a step still lacks after that comes from the
  other rewarded episodes, grouped by fingerprint where whole groups exist and in arrival order otherwise; those
  are judged against a **running per-task baseline**: each one's reward is handed to TRL minus the mean of the last
  `baseline_window` trained rewards of its fingerprint (of all episodes when its fingerprint has none, or it has no
  fingerprint), so that TRL's window normalisation compares episodes by how much better they did than their task
  usually does, not by how easy their task is (`online_rewards`). Logged: `online/fingerprint_groups` (share of groups
  of one fingerprint), `online/reward` (the claimed episodes' mean reward, before any baseline).
- **Reward.** An episode's reward is the mean of the rewards claimed with it (`online/rewards_per_episode`); later
  rewards are kept for evaluation (`store.py`).
- **Staleness.** Every token keeps the version that sampled it. The consuming step's policy is corrected for it with
  TRL's importance sampling (as asynchronous rollouts are), and a group with a token older than `max_staleness`
  versions is not trained (counted in `async/dropped_groups`). Under a long rollback streak the incumbent's episodes
  age past the bound: raise it, or restart training from the incumbent.
- **Versions.** After each optimizer step the trainer saves the weights (`output_dir/versions/v<step>`) and hands the
  `VersionManager` a candidate engine over a copy of them; the rollout rule decides (`endpoint/versions.py`). When a
  candidate is rolled back, the trainer takes the incumbent's weights back before its next step, so that the next
  candidate does not build on the update that was refused.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback

from .agentic_grpo_config import AgenticGRPOConfig
from .agentic_grpo_trainer import AgenticGRPOTrainer
from .endpoint.versions import VersionManager
from .generation.transformers_engine import TransformersEngine
from .generation.weights import copy_model
from .store import VERSION_PUBLISHED, EpisodeStore
from .trace import Episode


logger = logging.getLogger(__name__)

_PLACEHOLDER_TASK = [{"role": "user", "content": "(an episode of live traffic)"}]


def stored_reward(prompts, completions, episodes, **kwargs) -> list[float | None]:
    """The reward the store gave each claimed episode (`episode.metadata["online_reward"]`), minus its running baseline
    where it is not in a same-task group (`episode.metadata["online_baseline"]`, `online_rewards`)."""
    rewards = []
    for episode in episodes:
        reward = episode.metadata.get("online_reward")
        baseline = episode.metadata.get("online_baseline")
        rewards.append(reward if reward is None or baseline is None else reward - baseline)
    return rewards


class RunningBaselines:
    """The mean of the last `window` trained rewards of each task fingerprint, and of all episodes.

    Args:
        window: rewards kept per fingerprint (and overall).
    """

    def __init__(self, window: int = 64):
        if window < 1:
            raise ValueError(f"baseline_window must be at least 1, not {window}.")
        self.window = window
        self._by_task: dict[str, deque] = {}
        self._all: deque = deque(maxlen=window)

    def baseline(self, fingerprint: str | None) -> float:
        """The fingerprint's running mean; the running mean of all episodes when it has none (or there is no
        fingerprint); 0 before any reward."""
        history = self._by_task.get(fingerprint) if fingerprint is not None else None
        history = history if history else self._all
        return sum(history) / len(history) if history else 0.0

    def add(self, fingerprint: str | None, reward: float) -> None:
        if fingerprint is not None:
            self._by_task.setdefault(fingerprint, deque(maxlen=self.window)).append(reward)
        self._all.append(reward)


def online_rewards(
    items: list[tuple[Episode, list[float]]], group: int, baselines: RunningBaselines
) -> list[tuple[Episode, float | None, float | None]]:
    """A step's episodes in GRPO's group order, each with its reward (the mean of the rewards claimed with it, `None`
    for none) and its baseline (`None` in a whole group of one fingerprint: TRL's group mean is its baseline; else
    `RunningBaselines.baseline` before this step's rewards are added). The baselines then take this step's rewards.

    TRL then computes each episode's advantage from the reward minus the baseline, `c`, over its group of `group`:
    `(c_i - mean(c)) / (std(c) + 1e-4)` (`scale_rewards="group"`).
    """
    ordered = _grouped(items, group)
    fingerprints = [episode.metadata.get("fingerprint") for episode, _ in ordered]
    out = []
    for start in range(0, len(ordered), group):
        members = ordered[start : start + group]
        names = fingerprints[start : start + group]
        same_task = names[0] is not None and len(set(names)) == 1 and len(members) == group
        for (episode, values), fingerprint in zip(members, names, strict=True):
            reward = sum(values) / len(values) if values else None
            baseline = None if same_task or reward is None else baselines.baseline(fingerprint)
            out.append((episode, reward, baseline))
    for (episode, reward, _), fingerprint in zip(out, fingerprints, strict=True):
        if reward is not None:
            baselines.add(fingerprint, reward)
    return out


async def _no_agent(client, task):  # the trainer runs no agent: users' traffic did
    raise RuntimeError("OnlineGRPOTrainer trains on stored episodes; it runs no agent.")


class OnlineGRPOTrainer(AgenticGRPOTrainer):
    """GRPO on the rewarded episodes of live traffic (see the module's docstring). It runs no agent, so it starts no
    endpoint or engine of its own: users' traffic reached the serving endpoint.

    Args:
        model: the policy (the weights the incumbent version serves).
        store: the `EpisodeStore` serving writes to.
        args: an `AgenticGRPOConfig`; `per_device_train_batch_size` x steps episodes are claimed per step,
            `num_generations` per group, `max_staleness` bounds the version gap of what is trained.
        processing_class: the policy's tokenizer.
        versions: the serving side's `VersionManager`: each step's weights become a candidate there. `None`: serving
            runs in another process sharing only the store; each step's weights are saved and published through the
            store (`EpisodeStore.publish_version`), which that process loads (`endpoint/version_sync.py`), and the
            verdicts it writes back are read from there.
        run_on_server: how to run a coroutine on the serving event loop (e.g. `EndpointServer.call`); `None` runs it
            on a loop of its own (an engine whose `start` needs no loop, as the embedded one).
        wait_timeout: seconds a step waits for enough rewarded episodes (and for a verdict) before `TimeoutError`.
        wait_for_verdict: each step's weights are put on trial and the next step starts only once they were promoted
            or rolled back (`True`: every update is vetted before the next builds on it; training runs at the pace
            of the trials). `False` (the default): training goes on while a candidate is on trial, and a step's
            weights are put on trial only when none is (the steps in between are vetted with the next candidate).
        reward_funcs: extra reward functions run on the claimed episodes, added to the stored reward (default none;
            e.g. `trl_agentic.rewards.cut_off_penalty`, as the demo trains with).
        group_wait: seconds a step waits for whole groups of one task fingerprint before it takes other rewarded
            episodes (with a running baseline) for the rest (0: take what is there; `wait_timeout` or more: train
            same-task groups only, as long as traffic names its tasks).
        baseline_window: trained rewards per fingerprint the running baseline averages (`RunningBaselines`).
    """

    _runs_agents = False

    def __init__(
        self,
        model,
        store: EpisodeStore,
        args: AgenticGRPOConfig,
        processing_class=None,
        versions: VersionManager | None = None,
        run_on_server=None,
        wait_timeout: float = 3600.0,
        wait_for_verdict: bool = False,
        reward_funcs=None,
        group_wait: float = 0.0,
        baseline_window: int = 64,
        **kwargs,
    ):
        if kwargs.get("engine") is not None:
            raise ValueError("OnlineGRPOTrainer runs no agent and serves nothing: pass no `engine` (serving has one).")
        self.store, self.versions, self.run_on_server, self.wait_timeout = store, versions, run_on_server, wait_timeout
        self.wait_for_verdict = wait_for_verdict
        if group_wait < 0:
            raise ValueError(f"group_wait must be >= 0 seconds, not {group_wait}.")
        self.group_wait = group_wait
        self.baselines = RunningBaselines(baseline_window)
        dataset = Dataset.from_list(
            [{"prompt": _PLACEHOLDER_TASK}] * (args.max_steps * 64 if args.max_steps > 0 else 10**5)
        )
        extra = list(reward_funcs or [])
        super().__init__(
            model,
            agent=_no_agent,
            reward_funcs=[stored_reward, *extra],
            args=args,
            train_dataset=dataset,
            processing_class=processing_class,
            **kwargs,
        )
        # Stored episodes were sampled by earlier versions: TRL's importance-sampling correction, as asynchronous
        # rollouts apply it (behaviour policy -> the policy at the consuming step).
        self._behaviour_correction = True
        self._last_loaded_step = -1
        self._handled_decisions = 0  # the versions' decisions already acted on (a rollback restores weights)
        self._rebased: dict[int, int] = {}  # version -> the step training restarted from its weights (a rollback)
        self._last_published: int | None = None  # the latest version this trainer published
        self.restored_at: list[int] = []  # the steps after which training went back to the incumbent's weights
        self._decided_up_to = -1  # published through the store: rollbacks up to this version were acted on
        self._initial_path = Path(args.output_dir) / "versions" / "v0"
        if versions is None:  # serving runs elsewhere; after a rollback to its first version, these are its weights
            self.accelerator.unwrap_model(self.model).save_pretrained(self._initial_path)
        self.add_callback(_PublishVersion(self))

    # Rollout: claim instead of run

    def _rollout_episodes(self, prompts: list, trainer=None) -> dict[str, list]:
        if self.wait_for_verdict and self.model.training:
            deadline = time.monotonic() + self.wait_timeout
            while (on_trial := self._on_trial()) is not None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Version {on_trial} got no verdict in {self.wait_timeout:g}s.")
                time.sleep(0.1)
        self._restore_incumbent_if_rolled_back()
        self._ready_episodes = self._claim(len(prompts))  # TRL's path for episodes produced elsewhere
        return super()._rollout_episodes(prompts, trainer)

    def _claim(self, count: int) -> list[Episode]:
        group = self.num_generations
        now = time.monotonic()
        deadline, groups_until = now + self.wait_timeout, now + self.group_wait
        items: list = []
        while True:
            # whole same-task groups first; once `group_wait` is over, whatever is rewarded for the rest
            items += self._claim_fresh(count - len(items), group=group)
            if len(items) < count and time.monotonic() >= groups_until:
                items += self._claim_fresh(count - len(items))
            if len(items) >= count:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Only {len(items)} rewarded episodes arrived in {self.wait_timeout:g}s; a step needs {count}."
                )
            time.sleep(0.2)
        scored = online_rewards([(e, [r.value for r in rewards]) for e, rewards in items], group, self.baselines)
        sources = {id(episode): rewards for episode, rewards in items}
        episodes = []
        for index, (episode, reward, baseline) in enumerate(scored):
            self._rebase_versions(episode)
            episode.metadata["online_reward"] = reward
            episode.metadata["online_baseline"] = baseline
            episode.metadata["online_reward_sources"] = sorted({r.source for r in sources[id(episode)]})
            episode.group_index = index % group
            episodes.append(episode)
        metrics = self._metrics["train"]
        metrics["online/rewards_per_episode"].append(sum(len(r) for _, r in items) / len(items))
        rewards = [reward for _, reward, _ in scored if reward is not None]
        if rewards:
            metrics["online/reward"].append(sum(rewards) / len(rewards))
        fingerprints = [episode.metadata.get("fingerprint") for episode in episodes]
        groups = [fingerprints[i : i + group] for i in range(0, len(fingerprints), group)]
        same = [g[0] is not None and len(set(g)) == 1 for g in groups]
        metrics["online/fingerprint_groups"].append(sum(same) / len(same))
        return episodes

    # Versions

    def publish(self, step: int) -> None:
        """Save the current weights as version `step` and put them on trial at the serving side (unless another
        candidate is on trial and `wait_for_verdict` is off: then the next idle moment's weights go). A rollback that
        arrived during this step is acted on first: the weights go back to the incumbent's and nothing is published
        (the refused update's descendants never go on trial)."""
        if self._restore_incumbent_if_rolled_back() or self._on_trial() is not None:
            return
        model = self.accelerator.unwrap_model(self.model)
        path = Path(self.args.output_dir) / "versions" / f"v{step}"
        model.save_pretrained(path)
        self._last_published = step
        if self.versions is None:  # serving runs elsewhere: it loads the version from the store's record
            self.store.publish_version(step, str(path.resolve()))
            return
        serving = copy_model(model).eval()
        for parameter in serving.parameters():
            parameter.requires_grad_(False)
        incumbent = self.versions.engine_of(self.versions.incumbent)
        engine = TransformersEngine(
            serving, pad_token_id=self._tokenizer.pad_token_id, max_batch_size=getattr(incumbent, "max_batch_size", 16)
        )
        coroutine = self.versions.add_candidate_async(engine, version=step, path=str(path))
        if self.run_on_server is not None:
            self.run_on_server(coroutine)
        else:
            import asyncio

            asyncio.run(coroutine)

    def _on_trial(self) -> int | None:
        """The version on trial at the serving side (`None`: none), in this process or published through the store."""
        if self.versions is not None:
            return self.versions.candidate
        pending = [
            row["version"]
            for row in self.store.published_versions(self._decided_up_to)
            if row["state"] in (VERSION_PUBLISHED, "candidate")
        ]
        return pending[0] if pending else None

    def _restore_from_store(self) -> bool:
        """`_restore_incumbent_if_rolled_back` when serving runs elsewhere: the states serving wrote to the store."""
        rows = self.store.published_versions(-1)
        refused = [r["version"] for r in rows if r["state"] == "rolled_back" and r["version"] > self._decided_up_to]
        if not refused:
            return False
        self._decided_up_to = max(refused)
        if max(refused) != self._last_published:  # a later version builds on it: its own trial decides
            return False
        incumbent = next((r for r in rows if r["state"] == "incumbent"), None)
        if incumbent is None:
            return False
        path = incumbent["path"] or str(self._initial_path)  # serving's own first version: the weights at start
        model = self.accelerator.unwrap_model(self.model)
        weights = type(model).from_pretrained(path).state_dict()
        with torch.no_grad():
            model.load_state_dict(weights)
        self._rebased[incumbent["version"]] = self.state.global_step
        self.restored_at.append(self.state.global_step)
        self._metrics["train"]["online/rollbacks"].append(1.0)
        logger.warning("Version %d was rolled back: training goes on from the incumbent's weights.", max(refused))
        return True

    def _restore_incumbent_if_rolled_back(self) -> bool:
        """After a rollback, train on from the incumbent's weights (the refused update is dropped); `True` when the
        weights went back."""
        versions = self.versions
        if versions is None:
            return self._restore_from_store()
        if not versions.decisions:
            return False
        last = versions.decisions[-1]
        if self._handled_decisions == len(versions.decisions):
            return False
        self._handled_decisions = len(versions.decisions)
        model = self.accelerator.unwrap_model(self.model)
        # Only the rollback of the latest version published: when a later one was published before this step saw the
        # verdict (it builds on the refused weights), that later version's own trial decides (going back now would
        # leave it on trial, maybe promoted, while training went on from other weights).
        if last.action == "rolled_back" and last.version == self._last_published:
            serving = getattr(versions.engine_of(versions.incumbent), "model", None)
            if serving is not None and serving is not model:
                with torch.no_grad():
                    model.load_state_dict({k: v.detach().clone() for k, v in serving.state_dict().items()})
                # The policy is the incumbent's again: its tokens are as fresh as if sampled at this step
                self._rebased[versions.incumbent] = self.state.global_step
                self.restored_at.append(self.state.global_step)
                self._metrics["train"]["online/rollbacks"].append(1.0)
                logger.warning(
                    "Version %d was rolled back: training goes on from the incumbent's weights.", last.version
                )
                return True
        return False

    def _claim_fresh(self, count: int, group: int | None = None) -> list:
        """The freshest rewarded episodes within the staleness bound (when traffic outruns training, the backlog's
        oldest episodes age out untrained and stay in the store for evaluation)."""
        step, rebased = self.state.global_step, self._rebased
        floor = step - self.args.max_staleness
        fresh = [v for v in range(step + 1) if rebased.get(v, v) >= floor]
        if count <= 0:
            return []
        claim = self.store.claim_for_training(
            limit=count, step=step + 1, versions=fresh, newest_first=True, group=group
        )
        return claim.items

    def _rebase_versions(self, episode: Episode) -> None:
        """Staleness counts the updates between the weights that sampled a token and those that train on it. After a
        rollback, training restarts from the incumbent's weights at step s: a token the incumbent sampled is then as
        old as one sampled at step s, so its version reads s (in the claimed copy; the store keeps what was served)."""
        rebased = self._rebased
        if not rebased:
            return
        for turn in episode.turns:
            turn.policy_version = rebased.get(turn.policy_version, turn.policy_version)
            if turn.token_versions is not None:
                turn.token_versions = [rebased.get(v, v) for v in turn.token_versions]


def _grouped(items: list[tuple[Episode, Any]], group: int) -> list[tuple[Episode, Any]]:
    """Episodes of one fingerprint together where a whole group of them exists, the rest in arrival order."""
    by_fingerprint: dict[str, list] = {}
    for item in items:
        fingerprint = item[0].metadata.get("fingerprint")
        if fingerprint is not None:
            by_fingerprint.setdefault(fingerprint, []).append(item)
    ordered, used = [], set()
    for members in by_fingerprint.values():
        whole = len(members) - len(members) % group
        for item in members[:whole]:
            ordered.append(item)
            used.add(id(item))
    ordered += [item for item in items if id(item) not in used]
    return ordered


class _PublishVersion(TrainerCallback):
    def __init__(self, trainer: OnlineGRPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.publish(state.global_step)
