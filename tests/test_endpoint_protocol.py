"""The strict JSON reader of request bodies (`protocol.parse_json_body`): what it rejects, exactly at its limits."""

import json
import random

import pytest

from trl_agentic.endpoint.protocol import MAX_JSON_DEPTH, _nests_deeper_than, parse_json_body


TRICKY = ["[", "]", "{", "}", '"', "\\", '\\"', '"]', "\\\\", "[[{{", 'a"b', "\\u005b", "é", "\n", ""]


def depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


def random_json(rng: random.Random, levels: int):
    if levels == 0:
        return rng.choice([rng.choice(TRICKY) * rng.randint(0, 3), 1, 2.5, None, True])
    children = [random_json(rng, rng.randint(0, levels - 1)) for _ in range(rng.randint(0, 3))]
    children.append(random_json(rng, levels - 1))
    rng.shuffle(children)
    if rng.random() < 0.5:
        return children
    return {f"{rng.choice(TRICKY)}{i}": child for i, child in enumerate(children)}


def test_depth_check_agrees_with_the_parsed_value():
    rng = random.Random(0)
    for _ in range(400):
        value = random_json(rng, rng.randint(1, 9))
        data = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        for limit in range(1, 11):
            assert _nests_deeper_than(data, limit) == (depth(value) > limit), (data, limit)


def nested(levels: int, filler: str) -> bytes:
    value = filler
    for k in range(levels):
        value = [filler, value] if k % 2 else {filler: filler, "x": value}
    return json.dumps(value).encode()


@pytest.mark.parametrize("filler", ["plain", '"]}]}', "[{[{\\", '\\"]'])
def test_bodies_nested_up_to_the_limit_pass_and_one_level_more_is_rejected(filler):
    for levels in (MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH):
        data = nested(levels, filler)
        assert depth(json.loads(data)) == levels and parse_json_body(data) == json.loads(data)
    with pytest.raises(ValueError, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
        parse_json_body(nested(MAX_JSON_DEPTH + 1, filler))


def test_brackets_in_strings_cannot_hide_deep_nesting():
    # Each level's strings hold the opposite brackets: counted with the structure, every bracket would find a pair.
    value = []
    for _ in range(200):
        value = ["]", value, "["]
    data = json.dumps(value).encode()
    with pytest.raises(ValueError, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
        parse_json_body(data)
