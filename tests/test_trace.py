"""Turn and Episode, the records every other module reads."""

from trl_agentic.trace import Episode, Turn


def test_episode_versions_are_its_turns_tokens_versions_in_order():
    """`Episode.versions` used to read turn attributes an episode does not have (AttributeError): it is the policy
    version of every sampled token of the episode, turn after turn."""
    first = Turn(0, [1, 2], [3, 4], [-0.1, -0.2], "stop", policy_version=2)  # all tokens of one version
    second = Turn(1, [1, 2, 3, 4], [5, 6, 7], [-0.3] * 3, "stop", policy_version=4, token_versions=[3, 3, 4])
    episode = Episode(id="e", turns=[first, second])
    assert episode.versions == [2, 2, 3, 3, 4]
    assert len(episode.versions) == episode.num_sampled_tokens
    assert Episode(id="empty").versions == []
