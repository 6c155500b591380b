"""Request-level plain data shared by the API process, schedulers and the engine driver."""
from __future__ import annotations

import enum
import math

import msgspec


class InvalidRequest(ValueError):
    """Bad input from a client: reported as HTTP 400, touches no pool."""


# Temperatures below this sample greedily (as SGLang does): dividing logits by a tiny temperature
# overflows float32 (1e-50 is 0.0 there), which would turn the distribution into NaNs.
GREEDY_TEMPERATURE = 1e-5
# Integer fields travel as msgpack ints (at most 64 bits) to the scheduler; bounds below keep every
# accepted value encodable and meaningful. A seed is any non-negative int64 (the per-sample rule
# ``seed + j`` wraps modulo 2^63); top_k beyond the vocabulary means "off".
MAX_SEED = 2**63 - 1
MAX_TOP_K = 2**31 - 1


MAX_REPETITION_PENALTY = 100.0


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k filter; at most MAX_TOP_K (>= vocabulary: no filter either)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None  # in [0, MAX_SEED]
    n: int = 1
    skip_special_tokens: bool = True
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # OpenAI logit_bias: token id -> additive bias in [-100, 100], applied after penalties and
    # before greedy/sampling; logprobs stay the raw model's. Travels prefill -> decode with the rest.
    logit_bias: dict[int, float] = {}
    # SGLang min_new_tokens / OpenAI-extension min_tokens: EOS and stop_token_ids are masked out
    # while fewer output tokens exist (HF MinNewTokensLengthLogitsProcessor). Stop strings still apply.
    min_new_tokens: int = 0
    # Constrained decoding (common/grammar): at most one of a JSON schema (JSON text), a regex or an
    # EBNF/Lark grammar. The text travels with the request, so the prefill (which samples the first
    # token) and the decode (which advances its own matcher by that token) compile the same grammar.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequest naming the first bad field."""

        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(f"invalid sampling params: {msg}")

        if self.max_new_tokens < 0:
            raise bad(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise bad(f"top_k must be -1 (off) or in [1, 2^31-1], got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        # Bounded above so a penalised logit stays finite in float32 (1e300 would make NaN rows).
        if not math.isfinite(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise bad(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            val = getattr(self, name)
            if not math.isfinite(val) or not -2.0 <= val <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {val}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise bad(f"seed must be in [0, 2^63-1], got {self.seed}")
        if self.n < 1:
            raise bad(f"n must be >= 1, got {self.n}")
        if self.top_logprobs_num < 0 or self.top_logprobs_num > 20:
            raise bad(f"top_logprobs_num must be in [0, 20], got {self.top_logprobs_num}")
        if any(not s for s in self.stop):
            raise bad("stop strings must be non-empty")
        if not 0 <= self.min_new_tokens <= max(self.max_new_tokens, 0):
            raise bad(f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}")
        grammars = [k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None]
        if len(grammars) > 1:
            raise bad(f"at most one of json_schema, regex and ebnf, got {' and '.join(grammars)}")
        if grammars and not getattr(self, grammars[0]):
            raise bad(f"{grammars[0]} must not be empty")
        for t, b in self.logit_bias.items():
            if not math.isfinite(b) or not -100.0 <= b <= 100.0:
                raise bad(f"logit_bias for token {t} must be in [-100, 100], got {b}")
            if t < 0:
                raise bad(f"logit_bias token id {t} must be >= 0")
        if vocab_size is not None:
            for t in self.logit_bias:
                if t >= vocab_size:
                    raise bad(f"logit_bias token id {t} outside vocabulary [0, {vocab_size})")
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    raise bad(f"stop_token_ids entry {t} outside vocabulary [0, {vocab_size})")

    @property
    def is_greedy(self) -> bool:
        """The one place that decides argmax vs sampling; a sampled row has a temperature of at
        least ``GREEDY_TEMPERATURE``, so the sampler never divides by (float32) zero."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


class FinishReason(msgspec.Struct, kw_only=True):
    """Why generation ended; ``to_json`` gives SGLang's meta_info.finish_reason shape."""

    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # stop token id or stop string
    length: int | None = None
    message: str | None = None

    def to_json(self) -> dict:
        out: dict = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        elif self.message is not None:
            out["message"] = self.message
        return out

    @property
    def openai(self) -> str:
        return {"stop": "stop", "length": "length"}.get(self.type, "abort")


class ReqState(enum.Enum):
    QUEUED = "queued"
    BOOTSTRAPPING = "bootstrapping"
    WAITING = "waiting"
    RUNNING = "running"
    TRANSFERRING = "transferring"
    FINISHED = "finished"
