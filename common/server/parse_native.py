"""Parse SGLang's native ``/generate`` body into a ``ParsedRequest``."""
from __future__ import annotations

from typing import Any

from common.server.config import ApiConfig
from common.server.errors import bad_request
from common.server.parse_common import (
    ParsedRequest,
    SubRequest,
    as_id_list,
    build_sampling,
    expand_bootstrap,
    finalize_sub,
    get_bool,
    all_ints,
    is_int,
    make_rids,
    per_item,
    reject_unsupported,
)
from common.server.textio import TokenizerLike

_UNSUPPORTED_BODY = ("image_data", "audio_data", "input_embeds", "lora_path", "session_params",
                     "custom_logit_processor", "return_hidden_states")
_UNSUPPORTED_SAMPLING = ("structural_tag", "no_stop_trim", "custom_params")


def _prompts(body: dict, tok: TokenizerLike) -> tuple[list[list[int]], bool]:
    """(token ids per prompt, whether the body was a batch)."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise bad_request("give either 'text' or 'input_ids', not both")
    if text is None and ids is None:
        raise bad_request("the body needs 'text' or 'input_ids'")
    if text is not None:
        if isinstance(text, str):
            return [tok.encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [tok.encode(t) for t in text], True
        raise bad_request("'text' must be a string or a non-empty list of strings")
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        return [as_id_list(x, "'input_ids' entries") for x in ids], True
    if isinstance(ids, list) and all_ints(ids):
        return [ids], False
    raise bad_request("'input_ids' must be a list of integers or a non-empty list of such lists")


def parse_generate(body: Any, cfg: ApiConfig, tok: TokenizerLike) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    reject_unsupported(body, _UNSUPPORTED_BODY)
    prompts, batch = _prompts(body, tok)
    k = len(prompts)

    raw_sp = body.get("sampling_params")
    sp_list = per_item(raw_sp if raw_sp is not None else {}, k, "sampling_params")
    samplings = []
    for sp in sp_list:
        if not isinstance(sp, dict):
            raise bad_request("'sampling_params' must be an object or a list of objects")
        reject_unsupported(sp, _UNSUPPORTED_SAMPLING)
        samplings.append(build_sampling(sp))
    n = samplings[0].n
    if any(s.n != n for s in samplings):
        raise bad_request("every item of a batch must use the same 'n'")
    if n < 1:
        raise bad_request(f"'n' must be >= 1, got {n}")
    if n > cfg.max_n:
        raise bad_request(f"'n' is {n}; this server allows at most {cfg.max_n} (--max-n)")
    count = k * n
    if count > cfg.max_batch_size:
        raise bad_request(f"{count} sequences in one request; the limit is {cfg.max_batch_size}")

    stream = get_bool(body, "stream")
    lp_raw = body.get("return_logprob")
    top_raw = body.get("top_logprobs_num")
    lps = per_item(False if lp_raw is None else lp_raw, k, "return_logprob")
    tops = per_item(0 if top_raw is None else top_raw, k, "top_logprobs_num")
    for lp, top in zip(lps, tops):
        if not isinstance(lp, bool):
            raise bad_request("'return_logprob' must be a boolean or a list of booleans")
        if not is_int(top):
            raise bad_request("'top_logprobs_num' must be an integer or a list of integers")

    boots = expand_bootstrap(body, count, cfg.bootstrap_port)
    parent, rids = make_rids(body.get("rid"), count, None)
    subs = []
    for i in range(k):
        for j in range(n):
            idx = i * n + j
            host, port, room = boots[idx]
            sampling = build_sampling(sp_list[i])  # a fresh copy: finalize_sub mutates it
            sampling.n = 1
            sub = SubRequest(rid=rids[idx], index=idx, input_ids=prompts[i], sampling=sampling,
                             bootstrap_host=host, bootstrap_port=port, bootstrap_room=room,
                             return_logprob=lps[i], top_logprobs_num=tops[i])
            finalize_sub(sub, cfg, tok.vocab_size, sample=j)
            subs.append(sub)
    return ParsedRequest(
        kind="generate", rid=parent, subs=subs, stream=stream, model=cfg.model_name, n=n,
        batch=batch or n > 1, return_text_in_logprobs=get_bool(body, "return_text_in_logprobs"),
    )
