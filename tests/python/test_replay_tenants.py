"""What a multi-tenant engine does, in the replay (``--tenants``, ``--pin-system-prompt``): each
conversation in a namespace of its tenant, prefixes shared only within one, and the system
prompt pinned in each tenant, never evicted; both off by default, both on in ``kvalloc demo``."""
from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from support import run_kvalloc

from kvalloc_cli import main
from pykvalloc.errors import InvalidArgument
from pykvalloc.replay.backends import Geometry
from pykvalloc.replay.simulator import (MAX_TENANTS, ReplayConfig, ReplayResult, replay, system_prompt,
                                        tenant_of)
from pykvalloc.replay.traces import Request, Trace
from pykvalloc.replay.workload import default_workload

TINY_MODEL = Geometry(layers=1, kv_heads=1, head_dim=16, dtype="float16")  # 64 B per token
SYSTEM = 0       # the system prompt's hash id: 512 tokens, 32 blocks of 16
PROMPT = 512     # tokens of a hash id
GAP = 100.0      # seconds between arrivals: each request has finished before the next arrives


def conversations(count: int, turns: int) -> Trace:
    """``count`` conversations of ``turns`` turns, turn 0 of each first, then turn 1, ...: turn t
    of conversation c opens with the system prompt, then repeats the ids of turn t-1 (its
    history) and adds one of its own, as in the Mooncake trace."""
    requests = []
    for turn in range(turns):
        for c in range(count):
            base = 1000 * (c + 1)
            ids = (SYSTEM,) + tuple(range(base, base + turn + 1))
            requests.append(Request(len(requests) * GAP, len(ids) * PROMPT, 4, ids))
    return Trace(requests, source=f"{count} conversations of {turns} turns")


def expected_hits(trace: Trace, namespaces: list[int]) -> dict[int, list[int]]:
    """Per namespace: [requests, hit tokens, looked-up tokens], from a cache that keeps every
    block (nothing is evicted) and shares a prefix only within a namespace: a request hits the
    longest run of its leading hash ids an earlier request of its namespace had."""
    seen: dict[int, set[tuple[int, ...]]] = {}
    rows: dict[int, list[int]] = {}
    for request, namespace in zip(trace.requests, namespaces):
        ids = request.hash_ids or ()
        known = seen.setdefault(namespace, set())
        hit = max((k for k in range(len(ids) + 1) if ids[:k] in known), default=0)
        row = rows.setdefault(namespace, [0, 0, 0])
        row[0] += 1
        row[1] += hit * PROMPT
        row[2] += request.input_tokens
        known.update(ids[:k] for k in range(1, len(ids) + 1))
    return rows


def rows_of(result: ReplayResult) -> dict[int, list[int]]:
    assert result.tenants is not None
    return {t["namespace"]: [t["requests"], t["hit_tokens"], t["query_tokens"]] for t in result.tenants}


def run(trace: Trace, capacity_tokens: int, **options: Any) -> ReplayResult:
    result = replay(trace, ReplayConfig(mode="paged", capacity_tokens=capacity_tokens, geometry=TINY_MODEL,
                                        **options))
    assert result.finished == result.requests and result.rejected == 0
    return result


def test_tenants_keep_each_conversations_hits_in_its_namespace_and_share_nothing_across():
    trace = conversations(8, 3)
    assert system_prompt(trace) == (SYSTEM,)
    tenants = 3
    namespaces = [tenant_of(r, i, tenants, (SYSTEM,)) for i, r in enumerate(trace.requests)]
    # A conversation's turns share a tenant; the conversations are spread over several.
    by_conversation = {r.hash_ids[1]: set() for r in trace.requests}
    for request, namespace in zip(trace.requests, namespaces):
        by_conversation[request.hash_ids[1]].add(namespace)
    assert all(len(spaces) == 1 for spaces in by_conversation.values())
    assert len(set(namespaces)) == tenants

    big = 64 * 1024  # tokens: every block of the trace stays cached
    apart = run(trace, big, tenants=tenants)
    together = run(trace, big)
    assert rows_of(apart) == expected_hits(trace, namespaces)
    # The cache's own counters say the same: nothing hit across namespaces.
    assert apart.kv_hit_counters is not None and together.kv_hit_counters is not None
    assert apart.kv_hit_counters["hit_tokens"] == sum(row[1] for row in rows_of(apart).values())
    one = expected_hits(trace, [0] * len(trace.requests))[0]
    assert together.kv_hit_counters["hit_tokens"] == one[1]
    # Conversations' own turns hit as they did in one namespace; only the system prompt, shared
    # across conversations, is missed once more by each further tenant's first request.
    assert one[1] - apart.kv_hit_counters["hit_tokens"] == (tenants - 1) * PROMPT
    assert apart.prefix_hit_rate < together.prefix_hit_rate
    assert together.tenants is None and together.system_prompt is None

    # One tenant is one namespace: the same run as without tenants.
    single = run(trace, big, tenants=1)
    assert single.kv_hit_counters == together.kv_hit_counters
    assert rows_of(single) == {0: one}


def test_a_request_without_a_conversation_is_a_tenant_of_its_own():
    # The Azure trace carries no hash ids: each request is spread on its own.
    plain = [Request(i * GAP, 300, 4) for i in range(64)]
    spread = {tenant_of(r, i, 4, ()) for i, r in enumerate(plain)}
    assert spread == {0, 1, 2, 3}
    result = run(Trace(plain, source="no ids"), 8192, tenants=4)
    assert sum(t["requests"] for t in result.tenants) == 64 and len(result.tenants) == 4
    assert result.prefix_hit_rate is None  # no keys, nothing measured


def pressure_trace() -> Trace:
    """Three of every five requests open with the system prompt (64 blocks: it and one id of
    their own); the other two are 90 blocks of their own each, which in a cache of 128 blocks
    evict everything cached before them, the system prompt too unless it is pinned."""
    requests = []
    for i in range(20):
        if i % 5 < 3:
            ids: tuple[int, ...] = (SYSTEM, 10_000 + i)
            tokens = 2 * PROMPT
        else:
            ids = (20_000 + 3 * i, 20_001 + 3 * i, 20_002 + 3 * i)
            tokens = 90 * 16
        requests.append(Request(i * GAP, tokens, 4, ids))
    return Trace(requests, source="pressure")


def test_a_pinned_system_prompt_is_never_evicted_under_pressure():
    trace = pressure_trace()
    assert system_prompt(trace) == (SYSTEM,)
    capacity = 128 * 16
    pinned = run(trace, capacity, pin_system_prompt=True)
    unpinned = run(trace, capacity)
    prompt = pinned.system_prompt
    assert prompt is not None and unpinned.system_prompt is None
    assert prompt["blocks"] == 32 and prompt["pins"] == 1 and prompt["pinned_blocks"] == 32
    assert prompt["requests_opening"] == 12 and prompt["capacity_blocks"] == 128
    assert prompt["evictions"] > 0  # under pressure: the cache evicted
    # Every request that opened with it after the first found it whole, every time.
    assert prompt["admissions_after_pin"] == 11 and prompt["found_whole"] == 11
    assert pinned.kv_hit_counters["hit_tokens"] == 11 * PROMPT
    # Without the pin, the long requests evicted it: later ones found less of it.
    assert unpinned.kv_hit_counters["hit_tokens"] < 11 * PROMPT


def test_each_tenant_pins_its_own_system_prompt():
    trace = conversations(8, 2)
    result = run(trace, 64 * 1024, tenants=3, pin_system_prompt=True)
    prompt = result.system_prompt
    assert prompt["pins"] == 3 and prompt["pinned_blocks"] == 3 * 32
    # After a tenant's first request pinned it, every later first turn there found it.
    assert prompt["found_whole"] == prompt["admissions_after_pin"] == len(trace.requests) - 3


def test_tenants_and_pins_are_in_the_report(capsys):
    from kvalloc_cli.report import print_report
    result = run(conversations(8, 2), 64 * 1024, tenants=3, pin_system_prompt=True)
    print_report([result])
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"tenants │ +3 │", out) and re.search(r"system prompt pinned │ +96 blocks │", out)
    assert "is in namespace hash(id) % 3" in out and "so the hit rate is lower than in one namespace" in out
    assert "pinned in each of 3 namespaces" in out and "Eviction never takes a pinned block" in out
    data = result.as_dict()
    assert data["tenant_count"] == 3 and len(data["tenants"]) == 3
    assert data["system_prompt"]["pinned_blocks"] == 96


def test_both_are_off_by_default():
    config = ReplayConfig()
    assert config.tenants is None and config.pin_system_prompt is False
    result = replay(default_workload(50), ReplayConfig(capacity_tokens=40_000, geometry=TINY_MODEL))
    data = result.as_dict()
    assert data["tenants"] is None and data["system_prompt"] is None and data["tenant_count"] is None


def test_bad_values_are_refused_before_anything_runs():
    for bad, message in ((dict(tenants=0), "tenants must be a whole number of at least 1"),
                         (dict(tenants=True), "tenants must be a whole number"),
                         (dict(tenants=MAX_TENANTS + 1), f"tenants must be at most {MAX_TENANTS:,}"),
                         (dict(pin_system_prompt="yes"), "pin_system_prompt must be True or False")):
        with pytest.raises(InvalidArgument, match=message):
            ReplayConfig(**bad)
    trace = conversations(2, 1)
    for config, message in (
            (ReplayConfig(mode="contiguous", capacity_tokens=8192, tenants=2), "need a paged KV cache"),
            (ReplayConfig(mode="malloc-glibc", capacity_tokens=8192, pin_system_prompt=True),
             "need a paged KV cache"),
            (ReplayConfig(capacity_tokens=8192, geometry=TINY_MODEL, pin_system_prompt=True,
                          prefix_caching=False), "no system prompt to pin: prefix caching was turned off"),
            (ReplayConfig(capacity_tokens=8192, geometry=TINY_MODEL, pin_system_prompt=True,
                          block_tokens=1024), "fills no block of 1,024 tokens")):
        with pytest.raises(InvalidArgument, match=message):
            replay(trace, config)
    no_ids = Trace([Request(0.0, 100, 4)], source="no ids")
    with pytest.raises(InvalidArgument, match="the trace carries no prefix ids"):
        replay(no_ids, ReplayConfig(capacity_tokens=8192, geometry=TINY_MODEL, pin_system_prompt=True))
    scattered = Trace([Request(0.0, 1024, 4, (1, 2)), Request(1.0, 1024, 4, (3, 4))], source="no shared")
    with pytest.raises(InvalidArgument, match="no prefix of hash ids opens more than half"):
        replay(scattered, ReplayConfig(capacity_tokens=8192, geometry=TINY_MODEL, pin_system_prompt=True))


@pytest.mark.parametrize("argv, message", [
    (["--tenants", "0"], "argument --tenants: must be at least 1, not 0"),
    (["--tenants", "many"], "argument --tenants: not a whole number: 'many'"),
    (["--tenants", str(MAX_TENANTS + 1)], f"argument --tenants: must be at most {MAX_TENANTS:,}"),
    (["--tenants", "4", "--compare"], "--tenants applies to --mode paged without --compare"),
    (["--tenants", "4", "--mode", "contiguous"], "--tenants applies to --mode paged without --compare"),
    (["--pin-system-prompt", "--mode", "malloc-glibc"],
     "--pin-system-prompt applies to --mode paged without --compare"),
    (["--pin-system-prompt", "--no-prefix-caching"],
     "--pin-system-prompt: no system prompt to pin: prefix caching was turned off"),
    (["--pin-system-prompt", "--block-tokens", "1024"],
     "--pin-system-prompt: no system prompt to pin: the shared prefix of 512 tokens fills no block of 1,024"),
])
def test_the_command_refuses_bad_options_before_it_runs(argv: list[str], message: str) -> None:
    done = run_kvalloc("replay", "--requests", "20", "--quiet", *argv, timeout=60)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""


def test_pinning_needs_a_trace_with_prefix_ids(tmp_path: Path) -> None:
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n")
    done = run_kvalloc("replay", str(csv), "--pin-system-prompt", "--quiet", timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert ("--pin-system-prompt: no system prompt to pin: the trace carries no prefix ids (hash ids)"
            in done.stderr)
    # Tenants need no ids: each request is its own conversation.
    done = run_kvalloc("replay", str(csv), "--tenants", "2", "--json", timeout=60)
    assert done.returncode == 0, done.stderr
    assert '"tenant_count": 2' in done.stdout


def test_the_demo_reports_its_tenants_and_pinned_system_prompt(capsys):
    assert main(["demo", "--requests", "300", "--no-tui"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"tenants │ +4 │", out) and re.search(r"system prompt pinned │ +128 blocks │", out)
    assert "pinned in each of 4 namespaces" in out


def test_the_watched_demo_lights_the_namespace_rows_and_pinned_blocks(capsys, monkeypatch):
    # The demo's inspector, driven by Textual's pilot in the terminal's place, against the
    # demo's real replay in its child process: a row per tenant in the namespaces panel and
    # pinned blocks in the KV bar, its legend and the heap map's.
    import kvalloc_tui.app
    from kvalloc_cli import demo
    from kvalloc_tui import render
    from test_tui import shown, until

    seen: dict[str, Any] = {}

    class Watched(kvalloc_tui.app.KvallocTop):
        def run(self, *args: Any, **kwargs: Any) -> None:
            async def watch_then_quit() -> None:
                async with self.run_test(size=(80, 24)) as pilot:
                    def lit() -> bool:
                        snap = self.current.last if self.current else None
                        return bool(snap and snap.kv_namespaces and len(snap.kv_namespaces) >= demo.TENANTS
                                    and snap.kv is not None and int(snap.kv["pinned_blocks"]) > 0)
                    await until(pilot, lit, timeout=120)
                    await pilot.pause(0.6)  # a refresh or two, drawn
                    seen["namespaces"] = shown(self, "#namespaces").plain
                    seen["kv"] = shown(self, "#kv").plain
                    seen["bar"] = shown(self, "#kv").spans
                    await pilot.press("v")
                    await until(pilot, lambda: self.screen.query_one("#heap").display)
                    await pilot.pause(0.6)
                    seen["heap"] = shown(self, "#heap")
                    await pilot.press("q")
            asyncio.run(watch_then_quit())

    monkeypatch.setattr(kvalloc_tui.app, "KvallocTop", Watched)
    status = demo.watched(argparse.Namespace(requests=2000, kv_size=2 << 30, speed=10.0))
    assert status == 0, capsys.readouterr().err
    rows = [line.split()[0] for line in seen["namespaces"].splitlines()[1:] if line.strip()]
    assert {row for row in rows if row.isdigit()} == {str(t) for t in range(demo.TENANTS)}, seen["namespaces"]
    pinned = re.search(r"pinned (\d[\d,]*)", seen["kv"])
    assert pinned and int(pinned[1].replace(",", "")) > 0, seen["kv"]
    assert any(span.style == render.PINNED_STYLE for span in seen["bar"])
    # The segment's heap map has pinned cells (each pin is 2 MiB of each layer's region, less
    # than one cell drawn at 80 columns, where it may be merged away): the legend names them.
    assert "kv pinned" in seen["heap"].plain.splitlines()[-1]
