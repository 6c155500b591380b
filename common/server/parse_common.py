"""Request parsing shared by /generate, /v1/completions and /v1/chat/completions.

Everything here is pure: a JSON body (already decoded) plus the tokenizer and config in, a
``ParsedRequest`` (a list of ``SubRequest`` the scheduler can run as-is) out, or ``ApiError(400)``
naming the first bad field. Nothing reaches the scheduler before parsing succeeded.

Grammars (``json_schema`` / ``regex`` / ``ebnf``, however the API spells them) are compiled here
once without a vocabulary (``common.grammar.backend.check_spec``, cached), so an invalid schema,
an unimplemented keyword or a regex that does not parse is a 400 naming the reason.

Length policy: a prompt must be non-empty and
strictly shorter than ``context_length``; ``max_new_tokens`` (however the API spells it) is
clipped to ``context_length - prompt_len`` so a too-large value ends with finish reason
``length`` instead of an error. Clipping is deterministic, so the prefill and decode nodes that
see the same body agree.

Fan-out: a batch of k prompts with ``n`` samples each becomes k*n sub-requests, item-major
(sub-request ``i*n + j`` is sample j of prompt i). With a ``seed``, sample j uses ``seed + j``
wrapped into [0, 2^63-1] (``sample_seed``), so the n samples differ yet stay reproducible; every
endpoint applies it in ``finalize_sub``. Bootstrap fields are a scalar or a list of length
k*n, one room per sub-request, in that same order — sglang-router sends lists of length
len(input_ids) for a /generate batch and of length n for a chat request with n > 1, but one
scalar room for n > 1 on /generate and /v1/completions: as SGLang does, sub-request i then takes
room + i (wrapped into [0, 2^63-1]), which both nodes derive alike from the same body.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from common.pd_contract import BOOTSTRAP_HOST, BOOTSTRAP_PORT, BOOTSTRAP_ROOM, is_room, sequence_room
from common.pd_contract import all_ints as all_ints, is_int as is_int  # the API's checks are the contract's
from common.grammar.factory import check_spec
from common.grammar.spec import schema_text, spec_of
from common.request import MAX_SEED, InvalidRequest, SamplingParams
from common.server.config import ApiConfig
from common.server.errors import ApiError, bad_request

if TYPE_CHECKING:
    from common.server.tools import ToolPlan

Kind = Literal["generate", "completion", "chat"]


@dataclass
class SubRequest:
    """One sequence to generate: exactly what becomes a ``GenerateReq``."""

    rid: str
    index: int  # position in the response: choice index / batch position
    input_ids: list[int]
    sampling: SamplingParams
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0


@dataclass
class ParsedRequest:
    kind: Kind
    rid: str  # the HTTP request's id (OpenAI "id"; parent of the sub-request rids)
    subs: list[SubRequest]
    stream: bool
    model: str
    n: int = 1  # samples per prompt; sub-request i*n + j is sample j of prompt i
    batch: bool = False  # native only: answer with a list
    include_usage: bool = False  # OpenAI stream_options.include_usage
    # stream_options.continuous_usage_stats (vLLM's): usage on every chunk, and a chunk for every
    # decoded token even when its text is not visible yet
    continuous_usage: bool = False
    return_text_in_logprobs: bool = False  # native only
    return_timeline: bool = False  # OpenAI only: add each choice's stage timeline (native: always)
    arrival_time: float = field(default_factory=time.time)
    tools: ToolPlan | None = None  # chat only: the tools whose calls the answer is parsed for


# ---- typed field access ------------------------------------------------------------------------


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def get_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean, got {_type_name(v)}")
    return v


def get_int(body: dict, key: str, default: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if not is_int(v):
        raise bad_request(f"'{key}' must be an integer, got {_type_name(v)}")
    return v


def get_str(body: dict, key: str, default: str | None = None) -> str | None:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad_request(f"'{key}' must be a string, got {_type_name(v)}")
    return v


def reject_unsupported(body: dict, keys: tuple[str, ...]) -> None:
    """Features we do not implement: silently ignoring them would return wrong output."""
    for key in keys:
        v = body.get(key)
        if v not in (None, False, "", [], {}):
            raise bad_request(f"'{key}' is not supported by this server")


def as_id_list(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all_ints(v):
        raise bad_request(f"{what} must be a list of integers")
    return v


# ---- sampling ----------------------------------------------------------------------------------


def normalize_stop(v: Any) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise bad_request("'stop' must be a string or a list of strings")


def build_sampling(fields: dict[str, Any]) -> SamplingParams:
    """SamplingParams from a dict; nulls mean "default", unknown keys are ignored. A
    ``json_schema`` may be an object or JSON text (SGLang sends text); it travels as text."""
    clean = {k: v for k, v in fields.items() if v is not None}
    if "stop" in clean:
        clean["stop"] = normalize_stop(clean["stop"])
    if "json_schema" in clean:
        try:
            clean["json_schema"] = schema_text(clean["json_schema"], "'json_schema'")
        except InvalidRequest as exc:
            raise bad_request(str(exc)) from exc
    try:
        return msgspec.convert(clean, SamplingParams)
    except msgspec.ValidationError as exc:
        raise bad_request(f"invalid sampling params: {exc}") from exc


# ---- fan-out helpers ---------------------------------------------------------------------------


def per_item(v: Any, count: int, what: str) -> list[Any]:
    """A scalar broadcast to ``count`` items, or a list that must have exactly ``count`` entries."""
    if isinstance(v, list):
        if len(v) != count:
            raise bad_request(f"'{what}' has {len(v)} entries for {count} sequences")
        return v
    return [v] * count


def expand_bootstrap(body: dict, count: int, default_port: int) -> list[tuple[str | None, int | None, int | None]]:
    hosts = per_item(body.get(BOOTSTRAP_HOST), count, BOOTSTRAP_HOST)
    ports = per_item(body.get(BOOTSTRAP_PORT), count, BOOTSTRAP_PORT)
    first = body.get(BOOTSTRAP_ROOM)
    if count > 1 and is_room(first):
        # A room pairs one sequence on each side: consecutive rooms, as SGLang derives them.
        rooms = [sequence_room(first, i) for i in range(count)]
    else:  # a list, or a scalar broadcast (None, or out of range: reported below)
        rooms = per_item(first, count, BOOTSTRAP_ROOM)
    out = []
    for host, port, room in zip(hosts, ports, rooms):
        if host is not None and not isinstance(host, str):
            raise bad_request(f"'bootstrap_host' must be a string, got {_type_name(host)}")
        if port is not None and not (is_int(port) and 0 < port < 65536):
            raise bad_request(f"'bootstrap_port' must be a port number or null, got {port!r}")
        if room is not None and not is_room(room):
            raise bad_request(f"'bootstrap_room' must be an integer in [0, 2^63-1], got {room!r}")
        if (host is None) != (room is None):
            raise bad_request("bootstrap_host and bootstrap_room must be given together")
        if host is not None and port is None:
            port = default_port
        out.append((host, port, room))
    if len({r for _, _, r in out if r is not None}) < sum(r is not None for _, _, r in out):
        raise bad_request("bootstrap_room values must be distinct within a request")
    return out


def make_rids(rid_field: Any, count: int, parent: str | None) -> tuple[str, list[str]]:
    """(parent rid, one rid per sub-request). A single sequence keeps the client's rid as is."""
    if isinstance(rid_field, list):
        if len(rid_field) != count or not all(isinstance(r, str) and r for r in rid_field):
            raise bad_request(f"'rid' must be a list of {count} non-empty strings")
        if len(set(rid_field)) != count:
            raise bad_request("'rid' entries must be distinct")
        return parent or rid_field[0], list(rid_field)
    if rid_field is not None and (not isinstance(rid_field, str) or not rid_field):
        raise bad_request("'rid' must be a non-empty string or a list of them")
    base = rid_field or parent or uuid.uuid4().hex
    if count == 1:
        return base, [base]
    return base, [f"{base}-{i}" for i in range(count)]


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample ``sample`` (0-based) of one prompt, from the request's valid seed."""
    return None if seed is None else (seed + sample) % (MAX_SEED + 1)


def finalize_sub(sub: SubRequest, cfg: ApiConfig, vocab_size: int, sample: int) -> None:
    """Length checks, max_new_tokens clip, sampling validation, per-sample seed (in place).

    The caller has put the requested (or default) ``max_new_tokens`` and the request's ``seed``
    into ``sub.sampling``; ``sample`` is j for sample j of its prompt.
    """
    n_prompt = len(sub.input_ids)
    if n_prompt == 0:
        raise bad_request("the prompt is empty")
    if n_prompt >= cfg.context_length:
        raise bad_request(
            f"the prompt has {n_prompt} tokens; this model's context length is {cfg.context_length} "
            f"tokens (prompt + output), so the prompt must be at most {cfg.context_length - 1} tokens"
        )
    for t in sub.input_ids:
        if not 0 <= t < vocab_size:
            raise bad_request(f"input token id {t} is outside the vocabulary [0, {vocab_size})")
    if sub.top_logprobs_num:
        sub.return_logprob = True
    s = sub.sampling
    s.return_logprob = sub.return_logprob
    s.top_logprobs_num = sub.top_logprobs_num
    try:
        s.validate(vocab_size)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc)) from exc
    spec = spec_of(s)
    if spec is not None:  # checked here so a spec that cannot compile allocates nothing anywhere
        reason = check_spec(spec, cfg.grammar_backend)
        if reason is not None:
            raise bad_request(reason)
    s.max_new_tokens = min(s.max_new_tokens, cfg.context_length - n_prompt)
    s.seed = sample_seed(s.seed, sample)  # after validate: an invalid seed must not wrap into range
