"""The workload of ``pdcluster bench``: random token-id prompts, output lengths, arrival times.

Lengths follow SGLang's ``bench_serving --dataset-name random``: with length L and range ratio r,
each request draws uniformly from ``[max(1, int(L * r)), L]`` (r = 1 means every request is L).
Prompts are token ids drawn uniformly from ``[0, vocab_size)`` and sent as ``input_ids``, so no
tokenizer round trip can change their length; with ``ignore_eos`` the decode node generates
exactly the requested number of tokens, which makes token counts checkable.

Arrivals are a Poisson process: exponential gaps with mean ``1 / rate``, the first request at 0.
A rate of ``inf`` sends everything at once (a concurrency cap, if any, then paces the run).
The ``mixed`` workload (``--workload mixed``) draws each prompt's length from a weighted list
instead, ``--mixed-lengths 128:0.9,2048:0.1`` by default: 90 % short chat turns and 10 % long
documents, the mix where a long prefill stalls an aggregated engine's decode (DistServe's case for
disaggregation); output lengths still follow ``--output-len`` and ``--range-ratio``.

Everything is drawn from one ``random.Random(seed)``: the same seed gives the same workload.
With a ``prompt_salt`` the token ids come from a generator of their own (seeded by both), while the
lengths and the arrival pattern still come from ``seed``: a rate sweep sends the same shapes at
every rate (the arrivals of one rate are the other's scaled, since each gap is one uniform draw
divided by the rate) with prompts no earlier rate left in the prefix cache.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    index: int
    input_ids: list[int]
    output_len: int  # max_new_tokens; exact because the bench sets ignore_eos
    arrival_s: float  # offset from the start of the run at which the request is due

    @property
    def input_len(self) -> int:
        return len(self.input_ids)


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive [low, high] range a length is drawn from."""
    if length < 1:
        raise ValueError(f"length {length} must be >= 1")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range ratio {range_ratio} must be in [0, 1]")
    return max(1, int(length * range_ratio)), length


def arrival_offsets(rng: random.Random, n: int, rate: float) -> list[float]:
    """Seconds from the start at which each of ``n`` requests is due (non-decreasing)."""
    if not rate > 0:
        raise ValueError(f"request rate {rate} must be > 0 (inf: all at once)")
    if math.isinf(rate):
        return [0.0] * n
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


DEFAULT_MIX = "128:0.9,2048:0.1"


def parse_mix(text: str) -> list[tuple[int, float]]:
    """``"128:0.9,2048:0.1"`` -> [(128, 0.9), (2048, 0.1)]; lengths >= 1, weights > 0 (normalised)."""
    out = []
    for part in text.split(","):
        length, sep, weight = part.strip().partition(":")
        try:
            n, w = int(length), float(weight)
        except ValueError:
            raise ValueError(f"--mixed-lengths {text!r}: {part!r} is not LENGTH:WEIGHT") from None
        if not sep or n < 1 or not w > 0:
            raise ValueError(f"--mixed-lengths {text!r}: {part!r} needs a length >= 1 and a weight > 0")
        out.append((n, w))
    return out


def make_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                  request_rate: float, seed: int, mix: list[tuple[int, float]] | None = None,
                  prompt_salt: int | None = None) -> list[BenchRequest]:
    """``mix`` (LENGTH, WEIGHT) pairs replace the uniform prompt-length draw when given;
    ``prompt_salt``: token ids from their own generator (the module docstring)."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts {num_prompts} must be >= 1")
    if vocab_size < 1:
        raise ValueError(f"vocab size {vocab_size} must be >= 1")
    rng = random.Random(seed)
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    if mix:
        in_lens = rng.choices([n for n, _ in mix], weights=[w for _, w in mix], k=num_prompts)
    else:
        in_lens = [rng.randint(in_lo, in_hi) for _ in range(num_prompts)]
    out_lens = [rng.randint(out_lo, out_hi) for _ in range(num_prompts)]
    arrivals = arrival_offsets(rng, num_prompts, request_rate)
    tokens = rng if prompt_salt is None else random.Random(f"{seed}/prompts/{prompt_salt}")
    return [BenchRequest(i, [tokens.randrange(vocab_size) for _ in range(n_in)], n_out, t)
            for i, (n_in, n_out, t) in enumerate(zip(in_lens, out_lens, arrivals))]
