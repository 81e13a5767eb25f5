"""What a training run prints (issue 33): one line per step, full metrics kept for the loggers, no raw dicts, and
TRL's whole-episode warning in one line."""

import logging
import sys

from transformers.trainer_callback import PrinterCallback, ProgressCallback

from test_agentic_grpo_trainer import config, dataset, length_reward, tool_agent
from trl_agentic import AgenticGRPOTrainer
from trl_agentic.console import StepLinePrinter, StepLines, quiet_known_warnings, step_line
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


def test_a_step_line_shows_what_matters_and_the_alarms_that_fire():
    logs = {
        "loss": 0.01,
        "reward": 0.4167,
        "reward_std": 0.3,
        "sampling/split_rate": 0.75,
        "held_out/success": 0.55,
        "episodes/unscorable": 0.0625,
        "episodes/sampled_tokens_mean": 41.25,
        "step_time": 2.31,
        "alarms/low_split_rate": 1.0,
        "alarms/entropy_collapse": 0.0,
        "completions/mean_length": 12.0,
    }
    assert step_line(logs, 12, 300) == (
        "step  12/300  reward 0.42 ±0.30  split 0.75  held-out 0.55  unscorable 0.06  "
        "tokens/episode 41.2  2.31 s/step  ALARM low_split_rate"
    )
    assert step_line({"train_runtime": 3.0, "train_loss": 0.1}, 300, 300) is None  # the end-of-training summary


def test_training_prints_one_line_per_step_and_keeps_every_metric(tmp_path, capsys, monkeypatch):
    tokenizer = build_tiny_tokenizer("qwen2_5")
    trainer = AgenticGRPOTrainer(
        build_tiny_model(tokenizer),
        agent=tool_agent,
        reward_funcs=length_reward,
        args=config(tmp_path, max_steps=2, disable_tqdm=True),
        train_dataset=dataset(4),
        processing_class=tokenizer,
    )
    kinds = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert StepLinePrinter in kinds and PrinterCallback not in kinds and ProgressCallback not in kinds
    try:
        trainer.train()
    finally:
        trainer.close()
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"]
    assert "{'loss'" not in printed and "'episodes/turns_mean'" not in printed  # no raw dict
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logged) == 2 and len(logged[0]) > 40  # the loggers still get every metric

    def installed(interactive: bool) -> list[type]:
        monkeypatch.setattr(sys.stdout, "isatty", lambda: interactive, raising=False)
        monkeypatch.setattr(sys.stderr, "isatty", lambda: interactive, raising=False)
        with_bar = AgenticGRPOTrainer(
            build_tiny_model(tokenizer),
            agent=tool_agent,
            reward_funcs=length_reward,
            args=config(tmp_path / "bar", max_steps=1),  # disable_tqdm unset: a progress bar
            train_dataset=dataset(2),
            processing_class=tokenizer,
        )
        with_bar.close()
        return [type(cb) for cb in with_bar.callback_handler.callbacks]

    assert StepLines in installed(interactive=True)
    # issue 40: off a terminal (a file, a pipe) a bar is one line of carriage returns: plain lines instead
    kinds = installed(interactive=False)
    assert StepLinePrinter in kinds and StepLines not in kinds and ProgressCallback not in kinds


def test_trls_whole_episode_warning_becomes_one_line(caplog):
    quiet_known_warnings()
    episode_text = "x" * 20_000
    with caplog.at_level(logging.WARNING, logger="trl.trainer.grpo_trainer"):
        logging.getLogger("trl.trainer.grpo_trainer").warning(
            f"All reward functions returned None for the following kwargs:\n{{'episodes': '{episode_text}'}}\n"
            "Please ensure that at least one reward function returns a valid reward."
        )
        logging.getLogger("trl.trainer.grpo_trainer").warning("y" * 5000)
    first, second = caplog.records
    assert "episodes/unscorable" in first.getMessage() and len(first.getMessage()) < 400
    assert len(second.getMessage()) < 500 and "more characters" in second.getMessage()
