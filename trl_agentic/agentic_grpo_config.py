"""Configuration of the [`AgenticGRPOTrainer`]: TRL's `GRPOConfig` plus the agent-side knobs."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig


# The `generation_kwargs` keys every engine honours (the embedded engine samples with them, vLLM gets them): TRL lets
# them override the named settings. Others (`num_beams`, `suppress_tokens`, ...) are refused, not silently ignored.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class AgenticGRPOConfig(GRPOConfig):
    r"""
    Configuration class for the [`AgenticGRPOTrainer`].

    Everything of [`trl.GRPOConfig`] keeps its meaning (loss, KL `beta`, clipping, `num_generations` = episodes per
    task, `temperature`/`top_p`/`top_k`/`min_p`/`repetition_penalty` = how the policy samples, whatever the agent asks
    for, and `generation_kwargs` overriding them as in TRL). One generation slot is one *episode* of the agent;
    `max_completion_length` caps the tokens of one model call. TRL settings that do not apply to episodes are refused
    with a `ValueError` saying what to do: `cache_implementation`, `use_transformers_continuous_batching` (and the
    deprecated `use_transformers_paged`), and `generation_kwargs` keys other than those five.

    Parameters:
        > Parameters that control the episodes

        max_concurrent_episodes (`int`, *optional*, defaults to `64`):
            Most episodes running at once on this process.
        max_turns (`int`, *optional*, defaults to `16`):
            Most model calls in one episode. The call past the limit is answered with an error and the episode ends
            with status `limit_exceeded`.
        max_episode_tokens (`int` or `None`, *optional*, defaults to `None`):
            Most sampled tokens in one episode (over all its calls). `None`: no limit beyond `max_turns`.
        episode_timeout (`float`, *optional*, defaults to `300.0`):
            Wall-clock seconds an episode may run, counted from its start (not while it waits for a slot); then the
            agent is cancelled (a command agent's process group is killed), given a second to end and otherwise
            abandoned, and the episode ends with status `timeout`.
        shared_prefix_scoring (`bool`, *optional*, defaults to `True`):
            Score the rows of a micro-batch with the prompt prefix they share (system prompt, tool schemas) computed
            once instead of once per row (`trl_agentic/shared_prefix.py`): the same log-probabilities as TRL's, up to
            float rounding. Used on a single process without gradient checkpointing; elsewhere TRL's own scoring runs.
        prefix_tree_training (`bool`, *optional*, defaults to `False`):
            Pack the rows of each chunk (the training forward's micro-batch, and the old and reference log-probability
            passes) into a prefix tree (`trl_agentic/prefix_tree.py`): every token the rows share (the prompt of a
            group, the turns before a fork or a tree's branch point) runs through the model once, with a tree
            attention mask. The same log-probabilities, entropies and gradients as TRL's, up to float rounding. Needs
            an attention that takes a 4D mask (`attn_implementation="eager"` or `"sdpa"`); a chunk that would not save
            tokens is scored as without it. Takes precedence over `shared_prefix_scoring`.
        agent_columns (`list[str]`, *optional*, defaults to `["prompt"]`):
            Dataset columns the agent's `task` dict holds. The others (the checker's `answer`, `expected`, ...) never
            reach the agent; every column still reaches the reward functions. Bundled tasks declare theirs
            (`TaskSuite.agent_columns`, added by `trl-agentic train`).

        > Parameters that control the endpoint the agents talk to

        endpoint_host (`str`, *optional*, defaults to `"127.0.0.1"`):
            Address the in-process OpenAI-compatible endpoint binds. Keep the loopback unless agents run elsewhere.
        endpoint_port (`int`, *optional*, defaults to `0`):
            Port of the endpoint; `0` picks a free one (each process of a multi-process run gets its own).
        generation_batch_wait_ms (`float`, *optional*, defaults to `0.0`):
            How long a request reaching an idle embedded engine waits for others before sampling starts. Batching is
            continuous (later requests join the running batch between decode steps), so no wait is needed.
        max_generation_batch_size (`int`, *optional*, defaults to `64`):
            Most requests the embedded engine samples together.
        max_open_episodes (`int` or `None`, *optional*, defaults to `None`):
            Most episodes open at once on the endpoint (more are refused, 429). `None`: no cap beyond
            `max_concurrent_episodes`, which the trainer's own rollouts never exceed.
        episode_idle_timeout (`float` or `None`, *optional*, defaults to `None`):
            Seconds without a model call after which the endpoint closes an episode with status `cancelled`. `None`:
            never (`episode_timeout` already bounds the trainer's episodes).

        > Parameters that control how episodes become training rows

        max_rows_per_episode (`int`, *optional*, defaults to `8`):
            Most rows one episode may produce (a fork starts a row). Turns past the cap are not trained and are
            counted in `episodes/rows_capped`.
        side_calls (`str`, *optional*, defaults to `"train"`):
            How a conversation that is neither the episode's main line nor a sub-agent (e.g. a title or summary
            request; decided by lineage when the episode closes, `trl_agentic/lineage.py`) is trained: `"train"` as
            rows of its own, `"skip"` not at all.
        sub_agents (`str`, *optional*, defaults to `"train"`):
            How a sub-agent's conversation (one a tool call of the agent handed a task, e.g. Claude Code's `Agent`
            tool) is trained: `"train"` as rows of its own with the episode's advantage, `"skip"` not at all.
        forks (`str`, *optional*, defaults to `"train"`):
            How the continuation after a history rewrite is trained: `"train"` as a new row, `"skip"` only the main
            line up to the fork is trained.
        row_weighting (`str`, *optional*, defaults to `"auto"`):
            How an episode's advantage is spread over its rows (an episode becomes several rows when the agent rewrote
            its history or made a side call). `"auto"`: every sampled token weighs what TRL's `loss_type` would give
            it if the episode were one sequence (token-level losses such as `"dapo"`: every row carries the full
            advantage; `"grpo"`: a row carries its share of the episode's sampled tokens; see
            `trl_agentic/rollout/loss_weights.py`). `"episode"`: the rows split it equally. `"row"`: every row
            carries it fully.

        > Parameters that control per-turn (process) rewards (trl_agentic/rewards/process.py)

        turn_reward_weight (`float`, *optional*, defaults to `0.5`):
            Largest magnitude `w` of the per-turn term in the advantage of a token sampled in turn t of episode i:
            `A[i, t] = A[i] + w * m[i, t] / max(1, M)`, where `A[i]` is TRL's advantage of the final rewards,
            `m[i, t]` the `gamma`-weighted mean of the normalised rewards of t's conversation from t on, and `M`
            the largest magnitude of `m` in the group (a reward function returns, per episode, a list with one reward
            per turn, or `{"final": r, "turns": [...]}`). With `0.5` two episodes' terms differ by at most 1, less
            than the gap TRL's group normalization puts between a passed and a failed episode (at least 1.41): the
            per-turn term cannot outweigh the outcome. Used only when a batch holds per-turn rewards; episodes with
            final rewards alone train exactly as without. `0`: per-turn rewards are logged, not trained on.
        turn_reward_discount (`float`, *optional*, defaults to `1.0`):
            `gamma` in [0, 1]: `1` averages every later turn's reward of the conversation (reward-to-go), `0` keeps
            each turn's own.
        turn_reward_normalization (`str`, *optional*, defaults to `"group"`):
            `n`, over every rewarded turn of the group: `"group"` `(r - mean) / (std + 1e-4)` (the process supervision
            of DeepSeekMath's GRPO, arXiv:2402.03300), `"mean"` `r - mean`, `"none"` the raw reward.

        > Parameters that control tree rollouts (trl_agentic/rollout/tree_groups.py, docs/tree_rollouts.md)

        rollout_tree (`bool`, *optional*, defaults to `False`):
            Sample each training group as a tree: `num_generations - tree_branches` root episodes, then
            `tree_branches` branch episodes, each the agent run again on the task with the endpoint replaying a closed
            episode's first calls and sampling fresh from a chosen call (`rollout/replay.py`). Each segment of the tree
            (the tokens between two branch points) gets an advantage from the rewards of the episodes under it
            (`rollout/tree.py`: the group-relative term plus `tree_local_weight` times the difference with its parent
            segment), and a segment shared by several episodes counts once in the loss (the tokens a branch replayed
            are its parent's). Needs whole groups on each process and `scale_rewards` `"group"` or `"none"`;
            evaluation stays flat. `False`: groups of independent episodes, exactly as before.
        tree_branches (`int`, *optional*, defaults to `2`):
            Branch episodes per group (at most `num_generations - 1`; the rest are roots). Keep two roots or more:
            with one, the root's prefix is shared by every episode of the group, so its advantage is always 0 (it is
            the group's baseline) and nothing corrects it; in the third learning study (docs/tree_rollouts.md) one
            root per group let the model drop its first call, and the run collapsed.
        tree_branch_points (`str`, *optional*, defaults to `"uniform"`):
            Where an episode is branched: `"uniform"` (uniform over the calls it can be branched at), `"entropy"` (the
            call whose sampled tokens had the highest mean `-logprob`), or `"tool_error"` (the call whose reply led to
            its first tool error, sampled again; `"uniform"` when it has none), or `"first"` (the earliest call it can
            be branched at: a root after its first call, so its branches share that call), or `"call:K"` with `K` an
            integer >= 1 (call `K` and no other: every branch replays calls `0 .. K-1` and samples call `K` afresh,
            for a task whose decision is call `K` after deterministic calls; an episode with `K` calls or fewer is
            not branched).
        tree_depth (`int`, *optional*, defaults to `1`):
            Levels of branches: `1` branches the roots only; `2` also branches the branches (a three-level tree), the
            branches split evenly over the levels. At most `tree_branches`.
        tree_local_weight (`float`, *optional*, defaults to `1.0`):
            Weight of a segment's local term (its value minus its parent segment's, what the choice at its branch
            point changed); `0` gives every segment the group-relative term of the rewards under it only.

        > Parameters that control which tasks are sampled (trl_agentic/task_sampling.py)

        task_sampling (`str`, *optional*, defaults to `"uniform"`):
            `"uniform"`: TRL's sampler (the dataset shuffled, each task once per epoch). `"adaptive"`: each group's task
            is chosen where its episodes are likely to disagree (running success near the middle), per difficulty
            bucket and per task ([`AdaptiveTaskSampler`]): easier or harder buckets as the model improves, the target
            never starved. A generation batch's tasks are drawn when it is consumed, from the results of every batch
            before it.
        difficulty_column (`str` or `None`, *optional*, defaults to `"difficulty"`):
            Dataset column with each task's difficulty (numbers, larger = harder). When the dataset has it, the
            `sampling/*` metrics are logged per bucket whatever `task_sampling` is.
        target_difficulty (`float` or `None`, *optional*, defaults to `None`):
            The difficulty the run is for: it gets at least `target_min_share` of the groups. `None`: the hardest.
        target_min_share (`float`, *optional*, defaults to `0.25`):
            Least share of groups drawn from the target difficulty.
        target_affinity (`float`, *optional*, defaults to `0.5`):
            A bucket's draw weight (its split rate: the share of its recent groups that split, shrunk towards the
            binomial split probability of its success estimate) is multiplied by this per bucket between it and the
            target while the target's groups split; as they stop splitting (solved or out of reach) the factor rises
            to `1 -` the target's split rate, so neighbours that still split take over.
        sampling_explore (`float`, *optional*, defaults to `0.1`):
            Share of groups spread evenly over all buckets whatever their estimate (so estimates follow the model).
        sampling_memory (`int`, *optional*, defaults to `16`):
            Recent groups a bucket's success estimate and split rate mostly reflect.
        sampling_revisit (`float`, *optional*, defaults to `0.5`):
            Share of a bucket's groups that go back to a task whose last group split (a bucket's tasks are seldom
            alike: its mean success overrates a new task's chance to split), before any is seen; then tilted by how
            often the bucket's recent revisits and new tasks split (`r^2` against `f^2`; 0 and 1 stay fixed).
            `sampling/revisit_share` logs the share of groups whose task was drawn before.

        > Parameters that control logging

        log_episodes (`bool`, *optional*, defaults to `False`):
            Write every episode (turns, messages, rewards, advantage, rows with their masks) as JSONL under
            `output_dir/episodes/`.

        > Parameters that control the alarms (trl_agentic/alarms/) and the held-out evaluation

        alarms (`bool`, *optional*, defaults to `True`):
            Check the training metrics at every log for reward hacking (reward rising while held-out success does
            not), length drift, spikes of malformed tool calls or unscorable episodes, entropy collapse and a low split
            rate. Each is logged as `alarms/<name>` (1.0 while it holds), warned about once when it starts, and listed
            in `output_dir/alarms.json` and `trainer.alarms`.
        held_out_eval_steps (`int`, *optional*, defaults to `0`):
            Evaluate the policy on `eval_dataset` (a split never trained on) before training, every this many steps
            and at the last step, and log `held_out/success` (successes over all episodes). `0`: never; the
            `reward_hacking` alarm needs it.
        held_out_num_samples (`int`, *optional*, defaults to `1`):
            Episodes per held-out task.
        alarm_window (`int`, *optional*, defaults to `10`):
            Logged steps averaged on each side of an alarm's comparison.
        alarm_reward_rise (`float`, *optional*, defaults to `0.1`):
            Rise of the training reward (reward units) that counts as "rising" for `reward_hacking` and
            `length_drift`.
        alarm_held_out_min_gain (`float`, *optional*, defaults to `0.02`):
            Gain of held-out success (0.02 = 2 points) expected while the training reward rises.
        alarm_length_growth (`float`, *optional*, defaults to `0.5`):
            Relative growth of sampled tokens or turns per episode that counts as drift when reward does not rise.
        alarm_spike (`float`, *optional*, defaults to `0.1`):
            Rise of the malformed-tool-call share of model calls, or of the unscorable share of episodes, that alarms.
        alarm_entropy_ratio (`float`, *optional*, defaults to `0.1`):
            Entropy collapse: recent token entropy below this fraction of its level at the start of training.
        alarm_min_split_rate (`float`, *optional*, defaults to `0.25`):
            Least share of groups whose rewards differ (`1 - frac_reward_zero_std`) over the last `alarm_window` logs.
        alarm_noise_z (`float`, *optional*, defaults to `3.0`):
            `reward_hacking` fires only when held-out success falls short of the training reward's rise by more than
            this many standard errors (the scatter of the training windows, the held-out evaluations' binomial noise),
            and, with a difficulty column, `malformed_tool_calls` only on a rise beyond this many standard errors of
            what the last steps' groups could give by chance.
        alarm_reward_metric (`str` or `None`, *optional*, defaults to `None`):
            A logged metric `reward_hacking` holds against held-out success, e.g. `"rewards/trajectory_judge/mean"`
            (a judge's score beside other reward functions: their weighted sum can stay level while the judge's term
            climbs). `None`: the training success at the target difficulty when logged, else the training reward.

        > Parameters that control asynchronous rollouts

        async_rollouts (`bool`, *optional*, defaults to `False`):
            Generate the episodes of the next steps while the trainer optimises the current one (a producer running
            ahead, paced by `max_staleness`). Episodes in flight when the weights change go on with the new weights;
            every sampled token records the policy version that sampled it, and TRL's importance-sampling correction
            (`vllm_importance_sampling_correction`, `vllm_importance_sampling_mode`, the clip bounds) reweights
            tokens from the behaviour policy to the policy at the step that trains them. Worth it when episodes wait
            on tools (shells, tests, web calls): the model samples while the trainer trains. Not with vLLM colocate
            (generation and training share the GPU in turns).
        max_staleness (`int`, *optional*, defaults to `1`):
            Most optimizer steps between the weights that sampled a trained token and the step that trains it. The
            producer starts a group only when it will be consumed within this bound (it is paced, never discards);
            `0` keeps the producer from running ahead (a synchronous schedule through the asynchronous path).
        rollout_process (`bool`, *optional*, defaults to `False`):
            With `async_rollouts`: run the producer, its endpoint, the agents and the embedded engine (over an
            inference copy of the policy) in a spawned process of their own, the weights handed over in shared memory
            after each optimizer step. In one process they share the trainer's interpreter lock, so with small models
            on CPU generation and training overlap little; in their own process they overlap. The embedded engine
            only (a vLLM server already generates in its own process), one training process, a model on the CPU
            without PEFT; the agent must pickle with `dill` (closures and lambdas do) and its result with `pickle`.
    """

    max_concurrent_episodes: int = field(default=64, metadata={"help": "Most episodes running at once."})
    max_turns: int = field(default=16, metadata={"help": "Most model calls in one episode."})
    max_episode_tokens: int | None = field(
        default=None, metadata={"help": "Most sampled tokens in one episode; None = no limit beyond max_turns."}
    )
    episode_timeout: float = field(default=300.0, metadata={"help": "Wall-clock seconds an episode may run."})
    endpoint_host: str = field(default="127.0.0.1", metadata={"help": "Address the agent endpoint binds."})
    endpoint_port: int = field(default=0, metadata={"help": "Port of the agent endpoint; 0 picks a free one."})
    generation_batch_wait_ms: float = field(
        default=0.0, metadata={"help": "How long a request reaching an idle embedded engine waits for company."}
    )
    max_generation_batch_size: int = field(
        default=64, metadata={"help": "Most requests the embedded engine samples together."}
    )
    max_rows_per_episode: int = field(default=8, metadata={"help": "Most training rows one episode may produce."})
    side_calls: str = field(
        default="train", metadata={"help": "How side calls are trained.", "choices": ["train", "skip"]}
    )
    sub_agents: str = field(
        default="train", metadata={"help": "How sub-agent conversations are trained.", "choices": ["train", "skip"]}
    )
    forks: str = field(
        default="train", metadata={"help": "How continuations after a fork are trained.", "choices": ["train", "skip"]}
    )
    row_weighting: str = field(
        default="auto",
        metadata={"help": "How an episode's advantage is spread over its rows.", "choices": ["auto", "episode", "row"]},
    )
    turn_reward_weight: float = field(
        default=0.5, metadata={"help": "Largest magnitude of the per-turn (process) term in each token's advantage."}
    )
    turn_reward_discount: float = field(
        default=1.0,
        metadata={"help": "Discount over the conversation's later rewards (1 = reward-to-go, 0 = the turn's own)."},
    )
    turn_reward_normalization: str = field(
        default="group",
        metadata={"help": "How per-turn rewards are normalised in a group.", "choices": ["group", "mean", "none"]},
    )
    rollout_tree: bool = field(
        default=False, metadata={"help": "Sample each group as a tree: roots, then branches replaying their parent."}
    )
    tree_branches: int = field(default=2, metadata={"help": "Branch episodes per group (the rest are roots)."})
    tree_branch_points: str = field(
        default="uniform",
        metadata={"help": "Where episodes are branched: uniform, entropy, tool_error, first, or call:K (K >= 1)."},
    )
    tree_depth: int = field(default=1, metadata={"help": "Levels of branches (2: branches of branches too)."})
    tree_local_weight: float = field(
        default=1.0, metadata={"help": "Weight of a tree segment's advantage over its parent segment's."}
    )
    task_sampling: str = field(
        default="uniform", metadata={"help": "How tasks are chosen.", "choices": ["uniform", "adaptive"]}
    )
    difficulty_column: str | None = field(
        default="difficulty", metadata={"help": "Dataset column with each task's difficulty (numbers)."}
    )
    target_difficulty: float | None = field(
        default=None, metadata={"help": "Difficulty never starved by adaptive sampling (None = the hardest)."}
    )
    target_min_share: float = field(default=0.25, metadata={"help": "Least share of groups at the target difficulty."})
    target_affinity: float = field(default=0.5, metadata={"help": "Weight factor per bucket away from the target."})
    sampling_explore: float = field(default=0.1, metadata={"help": "Share of groups spread evenly over buckets."})
    sampling_memory: int = field(default=16, metadata={"help": "Recent groups a bucket's estimate reflects."})
    sampling_revisit: float = field(
        default=0.5, metadata={"help": "Share of groups that go back to a task whose last group split."}
    )
    log_episodes: bool = field(default=False, metadata={"help": "Write every episode as JSONL under output_dir."})
    alarms: bool = field(
        default=True, metadata={"help": "Check training metrics for reward hacking, drift, spikes, collapse."}
    )
    held_out_eval_steps: int = field(
        default=0, metadata={"help": "Evaluate on eval_dataset every this many steps (0 = never)."}
    )
    held_out_num_samples: int = field(default=1, metadata={"help": "Episodes per held-out task."})
    alarm_window: int = field(default=10, metadata={"help": "Logged steps averaged on each side of an alarm check."})
    alarm_reward_rise: float = field(default=0.1, metadata={"help": "Reward rise that counts as rising."})
    alarm_held_out_min_gain: float = field(
        default=0.02, metadata={"help": "Held-out success gain expected while the reward rises."}
    )
    alarm_length_growth: float = field(default=0.5, metadata={"help": "Relative length/turns growth that is drift."})
    alarm_spike: float = field(default=0.1, metadata={"help": "Rise of the malformed or unscorable share that alarms."})
    alarm_entropy_ratio: float = field(default=0.1, metadata={"help": "Entropy below this x its start collapses."})
    alarm_min_split_rate: float = field(
        default=0.25, metadata={"help": "Least share of groups with differing rewards."}
    )
    alarm_noise_z: float = field(
        default=3.0, metadata={"help": "Standard errors the held-out shortfall must exceed for reward_hacking."}
    )
    alarm_reward_metric: str | None = field(
        default=None, metadata={"help": "Logged metric reward_hacking holds against held-out success (None: auto)."}
    )
    shared_prefix_scoring: bool = field(
        default=True, metadata={"help": "Score rows with their shared prompt prefix computed once (one process)."}
    )
    prefix_tree_training: bool = field(
        default=False, metadata={"help": "Pack each chunk's rows into a prefix tree: shared tokens forwarded once."}
    )
    agent_columns: list[str] = field(
        default_factory=lambda: ["prompt"], metadata={"help": "Dataset columns the agent's task holds."}
    )
    max_open_episodes: int | None = field(
        default=None, metadata={"help": "Most episodes open at once on the endpoint (429 beyond); None = no cap."}
    )
    episode_idle_timeout: float | None = field(
        default=None, metadata={"help": "Seconds without a call before an episode is closed; None = never."}
    )

    async_rollouts: bool = field(
        default=False, metadata={"help": "Generate the next steps' episodes while the trainer optimises this one."}
    )
    max_staleness: int = field(
        default=1, metadata={"help": "Most optimizer steps between a token's sampling policy and its training step."}
    )
    rollout_process: bool = field(
        default=False,
        metadata={"help": "With async_rollouts: the producer, endpoint, agents and engine in a process of their own."},
    )

    def __post_init__(self):
        super().__post_init__()  # also parses a `generation_kwargs` given as JSON text (the CLI)
        self._check_trl_generation_settings()
        if self.max_concurrent_episodes < 1:
            raise ValueError(f"max_concurrent_episodes must be >= 1, got {self.max_concurrent_episodes}.")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 (one model call at least), got {self.max_turns}.")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 1:
            raise ValueError(f"max_episode_tokens must be >= 1 or None (no limit), got {self.max_episode_tokens}.")
        if self.episode_timeout <= 0:
            raise ValueError(f"episode_timeout must be > 0 seconds, got {self.episode_timeout}.")
        if self.max_rows_per_episode < 1:
            raise ValueError(f"max_rows_per_episode must be >= 1, got {self.max_rows_per_episode}.")
        for name, allowed in (
            ("side_calls", ("train", "skip")),
            ("sub_agents", ("train", "skip")),
            ("forks", ("train", "skip")),
            ("row_weighting", ("auto", "episode", "row")),
            ("turn_reward_normalization", ("group", "mean", "none")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")
        if not math.isfinite(self.turn_reward_weight) or not 0 <= self.turn_reward_discount <= 1:
            raise ValueError(
                f"turn_reward_weight must be a finite number and turn_reward_discount in [0, 1]; got "
                f"{self.turn_reward_weight} and {self.turn_reward_discount}."
            )
        if not 0 <= self.endpoint_port < 65536:
            raise ValueError(f"endpoint_port must be in [0, 65535] (0 = pick a free port), got {self.endpoint_port}.")
        if self.use_vllm and self.vllm_mode not in ("server", "colocate"):
            raise ValueError(f"vllm_mode must be 'server' or 'colocate', got {self.vllm_mode!r}.")
        if self.max_open_episodes is not None and self.max_open_episodes < self.max_concurrent_episodes:
            raise ValueError(
                f"max_open_episodes ({self.max_open_episodes}) must be >= max_concurrent_episodes "
                f"({self.max_concurrent_episodes}), or None: the rollout opens that many episodes at once."
            )
        if self.episode_idle_timeout is not None and self.episode_idle_timeout <= 0:
            raise ValueError(
                f"episode_idle_timeout must be > 0 seconds or None (never), got {self.episode_idle_timeout}."
            )
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 optimizer steps, got {self.max_staleness}.")
        if self.async_rollouts and self.use_vllm and self.vllm_mode == "colocate":
            raise ValueError(
                "async_rollouts=True needs generation beside training, and vLLM colocate shares the GPU with the "
                "trainer in turns. Serve the policy with `trl vllm-serve` and set vllm_mode='server', or generate with "
                "the embedded engine (use_vllm=False), or set async_rollouts=False."
            )
        if self.rollout_process and (not self.async_rollouts or self.use_vllm):
            raise ValueError(
                "rollout_process=True runs the asynchronous producer and the embedded engine in a process of their "
                "own: set async_rollouts=True and use_vllm=False (a vLLM server already generates in its own process), "
                "or set rollout_process=False."
            )
        if self.rollout_tree:
            self._check_rollout_tree()
        if self.task_sampling not in ("uniform", "adaptive"):
            raise ValueError(f"task_sampling must be 'uniform' or 'adaptive', got {self.task_sampling!r}.")
        if not (
            0 <= self.target_min_share <= 1
            and 0 <= self.sampling_explore <= 1
            and self.sampling_memory >= 1
            and 0 <= self.target_affinity <= 1
            and 0 <= self.sampling_revisit <= 1
        ):
            raise ValueError(
                "target_min_share, target_affinity, sampling_explore and sampling_revisit must be in [0, 1] and "
                f"sampling_memory >= 1; got {self.target_min_share}, {self.target_affinity}, {self.sampling_explore}, "
                f"{self.sampling_revisit} and {self.sampling_memory}."
            )
        if self.held_out_eval_steps < 0 or self.held_out_num_samples < 1 or self.alarm_window < 1:
            raise ValueError(
                "held_out_eval_steps must be >= 0 (0 = never), held_out_num_samples >= 1 and alarm_window >= 1; got "
                f"{self.held_out_eval_steps}, {self.held_out_num_samples} and {self.alarm_window}."
            )
        for name in (
            "alarm_reward_rise",
            "alarm_held_out_min_gain",
            "alarm_length_growth",
            "alarm_spike",
            "alarm_entropy_ratio",
            "alarm_min_split_rate",
            "alarm_noise_z",
        ):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}.")

    def _check_rollout_tree(self) -> None:
        """`rollout_tree=True`: the tree's shape fits a group, and the settings it cannot honour are refused."""
        from .rollout.tree_groups import TreeSpec  # checks branches, depth and branch points

        roots = TreeSpec(self.tree_branches, self.tree_branch_points, self.tree_depth).roots(self.num_generations)
        if roots == 1:
            warnings.warn(
                f"tree_branches={self.tree_branches} of num_generations={self.num_generations} leaves one root per "
                "group: its prefix is shared by every episode of the group, so its advantage is always 0 and nothing "
                "corrects it (one root let a study's model drop its first call, and the run collapsed: "
                "docs/tree_rollouts.md). Keep two roots or more (tree_branches <= num_generations - 2).",
                stacklevel=4,  # the user's AgenticGRPOConfig(...) line (through __post_init__ and the dataclass __init__)
            )
        if not math.isfinite(self.tree_local_weight) or self.tree_local_weight < 0:
            raise ValueError(f"tree_local_weight must be a finite number >= 0, got {self.tree_local_weight}.")
        if self.scale_rewards not in ("group", "none") or self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "rollout_tree=True normalises rewards within each tree (its group): set scale_rewards='group' or "
                f"'none' (got {self.scale_rewards!r}) and multi_objective_aggregation='sum_then_normalize' (got "
                f"{self.multi_objective_aggregation!r}), or set rollout_tree=False."
            )
        if self.rollout_process:
            raise ValueError(
                "rollout_tree=True runs its branches through the producer of this process: set rollout_process=False "
                "(async_rollouts=True still runs trees ahead of the trainer), or set rollout_tree=False."
            )

    def _check_trl_generation_settings(self) -> None:
        """TRL's generation settings: those the episodes' sampling honours are checked, the others refused (issue 40:
        they used to be ignored without a word)."""
        if self.cache_implementation is not None:
            raise ValueError(
                f"cache_implementation={self.cache_implementation!r} configures TRL's `model.generate`, which the "
                "agentic trainer does not call: the embedded engine keeps its own key/value cache (continuous batching "
                "with per-episode prefix reuse) and vLLM its own. Remove it."
            )
        if self.use_transformers_continuous_batching:
            raise ValueError(
                "use_transformers_continuous_batching=True (or the deprecated use_transformers_paged=True, which TRL "
                "turns into it) selects TRL's transformers generation, which the agentic trainer does not call: the "
                "embedded engine already batches the episodes' calls continuously (see max_generation_batch_size), "
                "and use_vllm=True serves them with vLLM. Set it to False."
            )
        unknown = sorted(set(self.generation_kwargs or {}) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(
                f"generation_kwargs {unknown} cannot be honoured: every model call of an episode is sampled by the "
                f"endpoint's engine, which takes {list(SAMPLING_KEYS)} (they override the settings of the same name, "
                "as in TRL). Remove the others."
            )
        sampling = self.sampling_kwargs()
        if not (
            isinstance(sampling["repetition_penalty"], int | float) and 0 < sampling["repetition_penalty"] < math.inf
        ):
            raise ValueError(
                f"repetition_penalty must be > 0 and finite (1.0: off), got {sampling['repetition_penalty']!r}."
            )
        if sampling["min_p"] is not None and not 0 <= sampling["min_p"] <= 1:
            raise ValueError(f"min_p must be in [0, 1] or None (off), got {sampling['min_p']!r}.")

    def sampling_kwargs(self) -> dict:
        """How every model call of an episode is sampled, whatever the agent asks for: `temperature`, `top_p`,
        `top_k`, `min_p` and `repetition_penalty`, with `generation_kwargs` overriding them as in TRL.

        Example:

        ```python
        >>> args = AgenticGRPOConfig(output_dir="out", temperature=1.0, generation_kwargs={"temperature": 0.7})
        >>> args.sampling_kwargs()
        {'temperature': 0.7, 'top_p': 1.0, 'top_k': 0, 'min_p': None, 'repetition_penalty': 1.0}
        ```
        """
        named = {key: getattr(self, key) for key in SAMPLING_KEYS}
        return {**named, **(self.generation_kwargs or {})}
