"""The embedded default workload: synthetic conversation traffic drawn from published statistics
of real traces, so that ``kvalloc replay`` and ``kvalloc demo`` work without any trace file.

Sources of the figures:
- Lengths and rate: the Azure LLM inference trace, conversation part (Patel et al., "Splitwise:
  Efficient Generative LLM Inference Using Phase Splitting", ISCA 2024; Azure/AzurePublicDataset,
  data/AzureLLMInferenceTrace_conv.csv). Measured on that file: input tokens median 1,020, p99
  4,142, range 2..14,050; output tokens median 129, p99 601, range 7..1,000; 5.5 requests/s.
  Each length is drawn log-normally with that median and 99th percentile, clipped to the range.
- Prefix structure: the Mooncake conversation trace (Qin et al., "Mooncake: Trading More Storage
  for Less Computation", FAST 2025; kvcache-ai/Mooncake, FAST25-release/traces). There, one shared
  system-prompt block (id 0) opens every request and later turns of a conversation repeat the
  earlier turns as their prefix; with an unlimited cache 36.6% of prompt blocks are prefix hits.
  Here every prompt opens with block id 0, and with probability FOLLOW_UP a request continues the
  most recent open conversation shorter than its prompt: that conversation's whole blocks (its
  prompt and answer) become the new prompt's prefix. Prompt lengths keep the Azure distribution.
  With Azure's shorter prompts the shared block 0 alone is a third of all prompt blocks, so the
  unlimited-cache hit rate of 512-token blocks comes out near 38% (Mooncake: 36.6%).
"""
from __future__ import annotations

import math
import random
import reprlib

from ..errors import InvalidArgument
from .traces import MOONCAKE_BLOCK_TOKENS, Request, Trace

INPUT_MEDIAN, INPUT_P99, INPUT_MIN, INPUT_MAX = 1020, 4142, 2, 14050
OUTPUT_MEDIAN, OUTPUT_P99, OUTPUT_MIN, OUTPUT_MAX = 129, 601, 7, 1000
REQUESTS_PER_SECOND = 5.5
# The workload is made in memory before the replay begins, about 300 bytes and 13 us a request:
# a million is 50 hours of traffic in 300 MiB; 2^64 of them would never have begun.
MAX_REQUESTS = 1_000_000
FOLLOW_UP = 0.3
OPEN_CONVERSATIONS = 256
_Z99 = 2.3263478740408408  # the standard normal's 99th percentile


def _lognormal(rng: random.Random, median: float, p99: float, low: int, high: int) -> int:
    sigma = (math.log(p99) - math.log(median)) / _Z99
    return int(min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))))


def default_workload(requests: int = 2000, seed: int = 2023) -> Trace:
    """``requests`` requests (at most MAX_REQUESTS) as a Trace, Poisson arrivals at the
    published rate."""
    if not 0 <= requests <= MAX_REQUESTS:
        raise InvalidArgument(f"the embedded workload holds 0 to {MAX_REQUESTS:,} requests, not {reprlib.repr(requests)}")
    rng = random.Random(seed)
    next_id = 1                                    # id 0 is the shared system prompt
    conversations: list[tuple[int, tuple[int, ...]]] = []   # (tokens so far, their hash ids)
    clock = 0.0
    out: list[Request] = []
    for _ in range(requests):
        clock += rng.expovariate(REQUESTS_PER_SECOND)
        output = _lognormal(rng, OUTPUT_MEDIAN, OUTPUT_P99, OUTPUT_MIN, OUTPUT_MAX)
        tokens = _lognormal(rng, INPUT_MEDIAN, INPUT_P99, INPUT_MIN, INPUT_MAX)
        ids = [0]
        if rng.random() < FOLLOW_UP:
            # Continue the most recent open conversation short enough to be this prompt's
            # prefix; the prompt length keeps the published distribution either way.
            for at in range(len(conversations) - 1, -1, -1):
                prior_tokens, prior_ids = conversations[at]
                if prior_tokens < tokens:
                    del conversations[at]
                    ids = list(prior_ids[:prior_tokens // MOONCAKE_BLOCK_TOKENS]) or [0]
                    break
        while len(ids) < -(-tokens // MOONCAKE_BLOCK_TOKENS):
            ids.append(next_id)
            next_id += 1
        out.append(Request(clock, tokens, output, tuple(ids)))
        conversations.append((tokens + output, tuple(ids)))
        del conversations[:-OPEN_CONVERSATIONS]
    return Trace(requests=out, source=f"default workload ({requests:,} requests, seed {seed})")
