"""Two processes (gloo, CPU) train with multi-turn agents; ranks must end with identical parameters."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch


pytestmark = pytest.mark.slow  # two processes train end to end (the full suite runs it; `-m "not slow"` skips it)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_ranks_agree_after_training(tmp_path, mode):
    worker = Path(__file__).parent / "ddp_worker.py"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(worker),
        str(tmp_path),
        mode,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]

    rank0 = torch.load(tmp_path / "params-rank0.pt")
    rank1 = torch.load(tmp_path / "params-rank1.pt")
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    steps = [json.loads((tmp_path / f"steps-rank{r}.json").read_text()) for r in (0, 1)]
    assert steps[0] == steps[1] and steps[0]["global_step"] == 2

    # The ranks really produced different numbers of rows: rank 1's agent rewrites its history (a fork per episode).
    rows_per_rank, records_per_rank = [], []
    for r in (0, 1):
        lines = (tmp_path / "episodes" / f"episodes-rank{r}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert len(records) == 4 and all(rec["episode"]["status"] == "ok" for rec in records)
        rows_per_rank.append(sum(len(rec["rows"]) for rec in records))
        records_per_rank.append(records)
    assert rows_per_rank == [4, 8]
    if mode == "async":  # both ranks consumed the same global batches (each its half of a group), within the bound
        for step in (0, 1):
            tasks = {
                rec["episode"]["messages"][0]["content"]
                for records in records_per_rank
                for rec in records
                if rec["step"] == step
            }
            assert len(tasks) == 1, tasks
        for records in records_per_rank:
            for rec in records:
                assert rec["episode"]["metadata"]["staleness"] <= 1

    # Each rank holds half of a step's group (one task, 4 episodes): the first calls of its 4 episodes have the same
    # prompt, and sample 4 different answers. Seeded alike on both ranks, episode i of rank 0 sampled what episode i of
    # rank 1 did (the seeds derive from the process index too).
    for step in (0, 1):
        first_turns = [
            rec["episode"]["turns"][0] for records in records_per_rank for rec in records if rec["step"] == step
        ]
        assert len(first_turns) == 4 and len({json.dumps(t["prompt_ids"]) for t in first_turns}) == 1
        assert len({json.dumps(t["completion_ids"]) for t in first_turns}) == 4, [
            t["completion_ids"] for t in first_turns
        ]
