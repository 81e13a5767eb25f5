"""Many agents at once: 32 concurrent episodes through one endpoint are recorded completely and apart, and the
engine really batches their calls."""

import asyncio
import itertools

import openai
import pytest

from trl_agentic.generation.transformers_engine import TransformersEngine
from trl_agentic.tiny_models import build_tiny_model, build_tiny_tokenizer


pytestmark = pytest.mark.usefixtures("single_torch_thread")


NUM_EPISODES = 32
TURNS = 3


@pytest.fixture(scope="module")
def served(start_server):
    tokenizer = build_tiny_tokenizer("qwen2_5")
    engine = TransformersEngine(
        build_tiny_model(tokenizer).eval(), pad_token_id=tokenizer.pad_token_id, max_batch_size=32, batch_wait_s=0.01
    )
    return start_server(engine, tokenizer), engine, tokenizer


def test_concurrent_episodes_are_complete_disjoint_and_batched(served):
    server, engine, tokenizer = served
    engine.batch_sizes.clear()
    sessions = [server.open_episode(task_index=i) for i in range(NUM_EPISODES)]

    async def agent(i, session):
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=session.key, max_retries=0, timeout=120)
        messages = [{"role": "user", "content": f"Episode {i} begins."}]
        for k in range(TURNS):
            response = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6, seed=i)
            messages += [
                response.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": f"Episode {i} turn {k}."},
            ]
        await client.close()
        return messages

    async def run_all():
        return await asyncio.gather(*[agent(i, s) for i, s in enumerate(sessions)])

    transcripts = asyncio.run(run_all())
    episodes = [server.close_episode(s.episode.id) for s in sessions]

    assert max(engine.batch_sizes) > 1, engine.batch_sizes
    assert sum(size * count for size, count in engine.batch_sizes.items()) == NUM_EPISODES * TURNS
    for i, (episode, transcript) in enumerate(zip(episodes, transcripts)):
        assert episode.task_index == i and episode.status == "ok"
        assert len(episode.turns) == TURNS and episode.num_forks == 0
        # Complete: the recorded final messages are the agent's conversation.
        assert episode.messages == transcript[:-1]
        for parent, turn in itertools.pairwise(episode.turns):
            exact = parent.prompt_ids + parent.completion_ids
            assert turn.parent_turn == parent.index and turn.prompt_ids[: len(exact)] == exact
        # Disjoint: only this episode's messages, in the messages and in the tokens.
        for turn in episode.turns:
            tags = {int(m["content"].split()[1]) for m in turn.request_messages if m["role"] == "user"}
            assert tags == {i}
            prompt_text = tokenizer.decode(turn.prompt_ids)
            assert all(f"Episode {j} " not in prompt_text for j in range(NUM_EPISODES) if j != i)
    # Every episode's first prompt is its own (no prompt was served to the wrong episode).
    assert len({tuple(e.turns[0].prompt_ids) for e in episodes}) == NUM_EPISODES
