"""Worker for tests/test_judge.py: two gloo ranks each hold half of one group of four episodes, as TRL's
`_calculate_rewards` hands a relative judge its process's slice; each rank writes the scores it got back."""

import json
import sys
from pathlib import Path

from accelerate import PartialState

from trl_agentic.rewards import TrajectoryJudge
from trl_agentic.trace import Episode


TASK = [{"role": "user", "content": "What is 2 + 2?"}]


def episode(number: int, group_index: int, answer: int) -> Episode:
    messages = [*TASK, {"role": "assistant", "content": f"The answer is {answer}."}]
    return Episode(f"ep{number}", group_index=group_index, status="ok", messages=messages, result=str(answer))


def main(base_url: str, key: str, out: str) -> None:
    state = PartialState(cpu=True)
    episodes = [episode(0, 0, 4), episode(1, 1, 5), episode(2, 2, 4), episode(3, 3, 3)]
    local = episodes[2 * state.process_index : 2 * state.process_index + 2]
    judge = TrajectoryJudge(model="policy", base_url=base_url, api_key=key)
    scores = judge(prompts=[TASK] * 2, completions=[ep.messages[1:] for ep in local], episodes=local)
    result = {"scores": scores, "requests": judge.stats.requests}
    Path(out, f"rank{state.process_index}.json").write_text(json.dumps(result))
    # Leave the process group before the interpreter exits: with gloo's threads still up at exit, a rank can abort
    # with "terminate called without an active exception" (a CI failure of this test).
    state.wait_for_everyone()
    state.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
