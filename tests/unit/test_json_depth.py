"""``common.http_limits.json_too_deep`` against an independent reference: the depth of what
``json.loads`` builds, walked in Python, on random bodies whose strings are full of brackets,
quotes and backslashes (the characters a byte-level scan could mistake for structure)."""
from __future__ import annotations

import json
import random
from typing import Any

import pytest

from common.http_limits import MAX_JSON_DEPTH, json_too_deep

TRICKY = ['[', ']', '{', '}', '"', '\\', '\\"', '\\\\', 'a', ' ', 'é', '"]', '\\[']


def depth(v: Any) -> int:
    if isinstance(v, list):
        return 1 + max((depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((depth(x) for x in v.values()), default=0)
    return 0


def random_value(rng: random.Random, budget: int) -> Any:
    kind = rng.random()
    if budget <= 0 or kind < 0.3:
        return rng.choice([1, 2.5, None, True, "".join(rng.choice(TRICKY) for _ in range(rng.randint(0, 12)))])
    if kind < 0.65:
        return [random_value(rng, budget - 1) for _ in range(rng.randint(0, 3))]
    return {"".join(rng.choice(TRICKY) for _ in range(rng.randint(0, 5))): random_value(rng, budget - 1)
            for _ in range(rng.randint(0, 3))}


def chain(levels: int) -> Any:
    v: Any = "x[{"
    for i in range(levels):
        v = [v] if i % 2 else {"k]": v}
    return v


@pytest.mark.parametrize("seed", range(300))
def test_matches_the_decoded_depth(seed: int) -> None:
    rng = random.Random(seed)
    value = chain(rng.randint(0, 12)) if seed % 3 == 0 else random_value(rng, rng.randint(1, 14))
    raw = json.dumps(value, ensure_ascii=bool(seed % 2)).encode()
    limit = rng.randint(0, 10)
    reason = json_too_deep(raw, limit)
    want = depth(json.loads(raw))
    assert (reason is not None) == (want > limit), (raw, want, limit, reason)
    if reason is not None:
        assert f"{want} deep" in reason


def test_a_100k_deep_body_is_refused_and_a_shallow_one_with_many_brackets_is_not() -> None:
    assert json_too_deep(b"[" * 100_000 + b"]" * 100_000) is not None
    wide = json.dumps({"input_ids": [[1, 2]] * 10_000, "text": "[" * 10_000}).encode()
    assert json_too_deep(wide) is None
    assert json_too_deep(json.dumps(chain(MAX_JSON_DEPTH)).encode()) is None
    assert json_too_deep(json.dumps(chain(MAX_JSON_DEPTH + 1)).encode()) is not None
