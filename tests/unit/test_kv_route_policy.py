"""Exact cache-aware routing, router side (router/policies.py ExactCacheAware, router/prompt_key.py):
the prefill choice minimises tokens to compute plus queued tokens within the load bound, the decode
choice (ExactDecodeCacheAware) takes the longest cached prefix within it; both are the same in two
routers, fall back to load when they cannot predict, and the router tokenizes as the nodes do."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from common.kv_events import KVSnapshot, block_hashes
from router.config import CacheAwareConfig
from router.forward import reported_cached_tokens
from router.kv_index import KVIndex
from router.policies import ExactCacheAware, ExactDecodeCacheAware, make_policy
from router.prompt_key import PromptTokenizer, RouteKey
from router.workers import Worker

BS = 4


def index_with(holdings: dict[str, list[int]]) -> KVIndex:
    """Each worker's cache holds the blocks of the given token prefix."""
    idx = KVIndex()
    for url, tokens in holdings.items():
        idx.get(url).load(KVSnapshot(instance_id=url, seq=0, block_size=BS, role="prefill",
                                     blocks=block_hashes(tokens, BS)))
    return idx


def workers(*loads: int) -> list[Worker]:
    return [Worker(f"http://p{i}", "prefill", healthy=True, inflight=load) for i, load in enumerate(loads)]


def key(tokens: list[int]) -> RouteKey:
    return RouteKey(text=None, tokens=tokens)


PROMPT = list(range(100, 133))  # 33 tokens: 8 whole blocks, the last token's block never counts


def test_the_worker_with_the_longest_cached_prefix_wins_and_its_hit_is_predicted() -> None:
    ws = workers(0, 0, 0)
    idx = index_with({"http://p0": PROMPT[:8], "http://p1": PROMPT[:24], "http://p2": []})
    policy = ExactCacheAware(CacheAwareConfig(balance_abs_threshold=2), idx)
    k = key(PROMPT)
    assert policy.pick(ws, k).url == "http://p1"
    assert k.predicted == {"http://p0": 8, "http://p1": 24, "http://p2": 0}
    # A whole cached prompt still leaves its last token to compute: 32 of 33, never 33.
    whole = index_with({"http://p0": PROMPT, "http://p1": [], "http://p2": []})
    k = key(PROMPT)
    ExactCacheAware(CacheAwareConfig(), whole).pick(ws, k)
    assert k.predicted["http://p0"] == 32
    k = key(PROMPT[:32])  # exactly 8 blocks: the 8th holds the last token, so 7 can hit
    ExactCacheAware(CacheAwareConfig(), whole).pick(ws, k)
    assert k.predicted["http://p0"] == 28


def test_queued_tokens_count_against_a_holder_and_the_load_bound_excludes_it() -> None:
    idx = index_with({"http://p0": PROMPT[:24], "http://p1": []})
    policy = ExactCacheAware(CacheAwareConfig(balance_abs_threshold=2), idx)
    ws = workers(0, 0)
    ws[0].queued_tokens = 30  # 33 - 24 + 30 = 39 > 33 + 0
    assert policy.pick(ws, key(PROMPT)).url == "http://p1"
    ws[0].queued_tokens = 20  # 29 < 33
    assert policy.pick(ws, key(PROMPT)).url == "http://p0"
    ws = workers(3, 0)  # the holder has 3 more requests than the least loaded: over the bound of 2
    assert policy.pick(ws, key(PROMPT)).url == "http://p1"
    ws = workers(2, 0)  # at the bound: still a candidate
    assert policy.pick(ws, key(PROMPT)).url == "http://p0"
    assert policy.picks == Counter(exact=4)


def test_two_routers_choose_alike_and_cold_prompts_spread() -> None:
    holdings = {"http://p0": list(range(40)), "http://p1": list(range(1000, 1040)), "http://p2": []}
    a = ExactCacheAware(CacheAwareConfig(), index_with(holdings))
    b = ExactCacheAware(CacheAwareConfig(), index_with(holdings))
    prompts = [list(range(s, s + 30)) for s in range(0, 2000, 37)] + [list(range(40)) + [7] * i for i in range(5)]
    picks_a = [a.pick(workers(0, 1, 0), key(p)).url for p in prompts]
    assert picks_a == [b.pick(workers(0, 1, 0), key(p)).url for p in prompts]
    cold = Counter(a.pick(workers(0, 0, 0), key([9000 + s] * 30)).url for s in range(60))
    assert len(cold) == 3 and min(cold.values()) >= 8, cold  # rendezvous ties: no herd on one URL


def test_without_a_synced_index_or_token_ids_it_routes_by_load() -> None:
    idx = index_with({"http://p0": PROMPT[:24]})  # p1 has no index (never synced, or cleared)
    policy = ExactCacheAware(CacheAwareConfig(), idx)
    ws = workers(1, 0)
    assert policy.pick(ws, key(PROMPT)).url == "http://p1"
    assert policy.pick(ws, RouteKey(text="some chat", tokens=None)).url == "http://p1"
    assert policy.pick(ws, None).url == "http://p1"
    idx.get("http://p1").load(KVSnapshot(instance_id="x", seq=0, block_size=BS, role="prefill", blocks=[]))
    assert policy.pick(ws, key(PROMPT)).url == "http://p0"
    idx.forget("http://p0")  # it left rotation: what it held no longer counts
    assert policy.pick(ws, key(PROMPT)).url == "http://p1"
    assert policy.picks == Counter(exact=1, unsynced=2, no_tokens=2)


def test_the_prefills_reported_hit_is_read_from_either_answer_shape() -> None:
    assert reported_cached_tokens("generate", {"meta_info": {"cached_tokens": 48}}) == 48
    assert reported_cached_tokens("chat", {"usage": {"prompt_tokens_details": {"cached_tokens": 16}}}) == 16
    assert reported_cached_tokens("completions", {"usage": {"prompt_tokens": 3}}) is None
    assert reported_cached_tokens("generate", [{"meta_info": {"cached_tokens": 1}}]) is None  # a batch
    assert reported_cached_tokens("generate", {"meta_info": {"cached_tokens": True}}) is None
    # A decode's own hit, beside the prefill's, in both shapes.
    answer = {"meta_info": {"cached_tokens": 48, "decode_reused_tokens": 32}}
    assert reported_cached_tokens("generate", answer, "decode_reused_tokens") == 32
    details = {"usage": {"prompt_tokens_details": {"cached_tokens": 0, "decode_reused_tokens": 16}}}
    assert reported_cached_tokens("chat", details, "decode_reused_tokens") == 16
    assert reported_cached_tokens("generate", {"meta_info": {"cached_tokens": 48}}, "decode_reused_tokens") is None


def test_the_router_tokenizes_prompts_as_the_node_does(tiny_qwen3: str) -> None:
    from common.tokenizer import Tokenizer

    node, router = Tokenizer(tiny_qwen3), PromptTokenizer(tiny_qwen3)
    texts = ["hello world", "A shared system prompt, then a question?  Spaces  and\nnewlines.", "ünïcödé ✓ 123",
             "a long one, encoded through the batch binding " * 400]
    for text in texts:
        assert router.prompt_ids("generate", {"text": text}) == node.encode(text)
        assert router.prompt_ids("completions", {"prompt": [text, "second"]}) == node.encode(text)
    assert router.prompt_ids("generate", {"input_ids": [[5, 6, 7], [8]]}) == [5, 6, 7]
    assert router.prompt_ids("completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert router.prompt_ids("generate", {"input_ids": [1, 1 << 40]}) is None  # cannot be hashed: by load
    with pytest.raises(Exception):
        PromptTokenizer("/nonexistent/tokenizer.json")


QWEN_LIKE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- set ns = namespace(users=0) %}\n"
    "{%- for message in messages %}\n"
    "  {%- if message.role == 'user' %}{%- set ns.users = ns.users + 1 %}{%- endif %}\n"
    "  {%- if message.role != 'system' or not loop.first %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "  {%- endif %}\n"
    "{%- endfor %}\n"
    "{{- '<!-- ' + ns.users|string + ' ' + (messages[-1] | tojson) + ' -->' }}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_the_router_renders_chat_templates_as_the_node_does(tiny_qwen3: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import shutil

    from common.tokenizer import Tokenizer

    other = tmp_path / "qwen-like"
    other.mkdir()
    shutil.copy(f"{tiny_qwen3}/tokenizer.json", other / "tokenizer.json")
    config = json.loads((Path(tiny_qwen3) / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN_LIKE}))
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ünï ✓ <b>"},
              {"role": "assistant", "content": "ok"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                   {"type": "text", "text": "b"}]}]]
    for directory in (tiny_qwen3, str(other)):
        node, router = Tokenizer(directory), PromptTokenizer(directory)
        for msgs in chats:
            assert router.prompt_ids("chat", {"messages": msgs}) == node.apply_chat_template(msgs), directory
    router = PromptTokenizer(str(other))
    assert router.prompt_ids("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}) is None
    assert router.prompt_ids("chat", {"messages": "not a list"}) is None


# ---- the decode pick (ExactDecodeCacheAware): the decodes' prefix caches, by their KV events ----


def decodes(*loads: int) -> list[Worker]:
    return [Worker(f"http://d{i}", "decode", healthy=True, inflight=load) for i, load in enumerate(loads)]


def test_the_decode_holding_the_longest_prefix_wins_within_the_load_bound() -> None:
    idx = index_with({"http://d0": PROMPT[:8], "http://d1": PROMPT[:24], "http://d2": []})
    policy = make_policy("cache-aware", CacheAwareConfig(balance_abs_threshold=2), idx, "decode")
    assert isinstance(policy, ExactDecodeCacheAware)
    k = key(PROMPT)
    assert policy.pick(decodes(0, 0, 0), k).url == "http://d1"
    assert k.decode_predicted == {"http://d0": 8, "http://d1": 24, "http://d2": 0} and k.predicted == {}
    ws = decodes(0, 0, 0)
    ws[1].queued_tokens = 10_000  # a prefill's notion: a decode computes no prompt, its queue does not count
    assert policy.pick(ws, key(PROMPT)).url == "http://d1"
    assert policy.pick(decodes(0, 2, 0), key(PROMPT)).url == "http://d1"  # at the bound: still a candidate
    assert policy.pick(decodes(0, 3, 0), key(PROMPT)).url == "http://d0"  # over it: the next longest
    assert policy.pick(decodes(1, 3, 0), key(PROMPT)).url == "http://d0"  # d0's 8 tokens beat d2's load of 0
    assert policy.picks == Counter(exact=5)


def test_prefill_and_decode_picks_of_one_request_keep_their_own_predictions() -> None:
    idx = index_with({"http://p0": PROMPT[:16], "http://p1": [], "http://d0": [], "http://d1": PROMPT[:32]})
    k = key(PROMPT)
    prefill = make_policy("cache-aware", CacheAwareConfig(), idx, "prefill")
    decode = make_policy("cache-aware", CacheAwareConfig(), idx, "decode")
    assert prefill.pick(workers(0, 0), k).url == "http://p0"
    assert decode.pick(decodes(0, 0), k).url == "http://d1"
    assert k.predicted == {"http://p0": 16, "http://p1": 0}
    assert k.decode_predicted == {"http://d0": 0, "http://d1": 32}


def test_decode_picks_are_alike_in_two_routers_and_fall_back_to_load_like_the_prefills() -> None:
    holdings = {"http://d0": list(range(40)), "http://d1": list(range(1000, 1040)), "http://d2": []}
    a = ExactDecodeCacheAware(CacheAwareConfig(), index_with(holdings))
    b = ExactDecodeCacheAware(CacheAwareConfig(), index_with(holdings))
    prompts = [list(range(s, s + 30)) for s in range(0, 2000, 37)] + [list(range(40)) + [7] * i for i in range(5)]
    picks = [a.pick(decodes(0, 1, 0), key(p)).url for p in prompts]
    assert picks == [b.pick(decodes(0, 1, 0), key(p)).url for p in prompts]
    cold = Counter(a.pick(decodes(0, 0, 0), key([9000 + s] * 30)).url for s in range(60))
    assert len(cold) == 3 and min(cold.values()) >= 8, cold  # rendezvous ties: no herd on one decode
    idx = index_with({"http://d0": PROMPT[:24]})  # d1 publishes nothing (its cache is off): never synced
    policy = ExactDecodeCacheAware(CacheAwareConfig(), idx)
    assert policy.pick(decodes(1, 0), key(PROMPT)).url == "http://d1"
    assert policy.pick(decodes(1, 0), RouteKey(text="chat", tokens=None)).url == "http://d1"
    assert policy.picks == Counter(unsynced=1, no_tokens=1)


def test_the_predicted_decode_hit_is_what_the_decode_cache_reuses() -> None:
    """The reference is the radix cache itself: a finished turn cached there, its events mirrored
    into the router's index, the next turn's predicted hit equals the cache's own match (whole
    pages, the last prompt token always sent)."""
    from common.kv_events import EventCodec
    from common.kvcache.allocator import PageAllocator
    from common.kvcache.kv_event_log import KVEventLog
    from common.kvcache.radix_cache import RadixCache

    alloc = PageAllocator(64)
    cache = RadixCache(alloc, BS)
    cache.events = log = KVEventLog("decode", BS, EventCodec(None))
    turn1 = list(range(500, 530)) + list(range(700, 711))  # prompt + output whose KV the decode holds
    pages = alloc.alloc(len(turn1) // BS)
    assert pages is not None
    cache.insert(turn1[: len(pages) * BS], pages)
    idx = KVIndex()
    idx.get("http://d0").load(log.snapshot())
    for turn2 in (turn1 + [9, 9, 9], turn1[:20], turn1[:21], turn1[:10] + [1] * 30, [42] * 20):
        k = key(turn2)
        ExactDecodeCacheAware(CacheAwareConfig(), idx).pick(decodes(0), k)
        assert k.decode_predicted["http://d0"] == cache.match_prefix(turn2, max_tokens=len(turn2) - 1).num_tokens
