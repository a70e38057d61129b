"""The continuous-batching simulation: its invariants on small traffic, and the report."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pykvalloc.cli import main
from pykvalloc.errors import InvalidArgument
from pykvalloc.replay.backends import Geometry, jemalloc_available
from pykvalloc.replay.simulator import ReplayConfig, replay
from pykvalloc.replay.traces import Request, Trace
from pykvalloc.replay.workload import default_workload

SMALL_MODEL = Geometry(layers=2, kv_heads=2, head_dim=64, dtype="float16")   # 1 KiB per token


def burst(n: int, prompt: int, output: int, gap: float = 0.0) -> Trace:
    return Trace([Request(i * gap, prompt, output) for i in range(n)], source="burst")


@pytest.mark.parametrize("mode", ["malloc-glibc"])
def test_malloc_baseline_finishes_everything_within_its_budget(mode: str) -> None:
    trace = default_workload(300, seed=11)
    config = ReplayConfig(mode=mode, capacity_tokens=40_000, geometry=SMALL_MODEL)
    result = replay(trace, config)
    assert result.finished == result.requests == 300
    assert result.preemptions == 0                      # the whole answer is reserved up front
    assert 0 < result.mean_kv_use <= result.peak_kv_use <= 1.0
    # It reserves prompt + answer on admission, so while an answer is being written part of the
    # reservation is empty: that is its internal waste.
    assert 0.0 < result.internal_waste < 1.0
    assert result.alloc_ns_p50 > 0 and result.alloc_ns_p50 <= result.alloc_ns_p99 <= result.alloc_ns_p999
    assert 0.0 < result.allocator_share < 1.0


def test_a_request_that_can_never_fit_is_reported() -> None:
    with pytest.raises(InvalidArgument, match="can never fit"):
        replay(burst(1, prompt=5000, output=10), ReplayConfig(mode="malloc-glibc", capacity_tokens=4000,
                                                             geometry=SMALL_MODEL))


def test_waiting_requests_are_admitted_as_memory_frees() -> None:
    # Ten requests that each need the whole cache: they must run one after another.
    result = replay(burst(10, prompt=900, output=100), ReplayConfig(mode="malloc-glibc", capacity_tokens=1000,
                                                                     geometry=SMALL_MODEL))
    assert result.finished == 10
    assert result.peak_kv_use == pytest.approx(1.0)


def test_the_time_scale_compresses_arrivals() -> None:
    trace = burst(20, prompt=100, output=5, gap=10.0)
    slow = replay(trace, ReplayConfig(mode="malloc-glibc", capacity_tokens=10_000, geometry=SMALL_MODEL))
    fast = replay(trace, ReplayConfig(mode="malloc-glibc", capacity_tokens=10_000, geometry=SMALL_MODEL,
                                      time_scale=100.0))
    assert slow.simulated_s > 180 and fast.simulated_s < 5


def test_replay_command_writes_the_json_report(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    status = main(["replay", "--mode", "malloc-glibc", "--requests", "200", "--kv-tokens", "60000",
                   "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--json", str(out), "--quiet"])
    assert status == 0
    report = json.loads(out.read_text())
    for key in ("requests", "finished", "preemptions", "kv_use_at_first_preemption", "peak_kv_use",
                "mean_kv_use", "internal_waste", "fragmentation", "prefix_hit_rate", "alloc_ns_p50",
                "alloc_ns_p99", "alloc_ns_p999", "allocator_share", "wall_s"):
        assert key in report
    assert report["requests"] == report["finished"] == 200


def test_replay_command_names_a_bad_trace_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,2\n2023-11-16 18:15:47.1,x,2\n")
    assert main(["replay", str(bad), "--mode", "malloc-glibc", "--quiet"]) == 1
    assert "bad.csv:3" in capsys.readouterr().err
    assert main(["replay", str(bad), "--mode", "malloc-glibc", "--quiet", "--skip-bad"]) == 0
    assert "skipped 1 malformed" in capsys.readouterr().out


@pytest.mark.parametrize("block_tokens", [16, 32, 64, 128])
def test_paged_replay_finishes_everything_and_frees_every_block(block_tokens: int) -> None:
    # Overloaded on purpose (a small cache, arrivals compressed): preemption must happen, and
    # paging fills the cache before it does.
    trace = default_workload(400, seed=5)
    config = ReplayConfig(mode="paged", block_tokens=block_tokens, capacity_tokens=24_000, geometry=SMALL_MODEL,
                          time_scale=20.0)
    result = replay(trace, config)      # the run itself verifies check() and that no block is left
    assert result.finished == 400 and result.preemptions > 0
    assert result.kv_use_at_first_preemption >= 0.97
    assert 0.0 < result.internal_waste < block_tokens / 100   # only the last block is partly empty
    assert 0.2 < result.prefix_hit_rate < 0.6                  # the workload's shared prefixes
    assert result.timing == "inside the library" and 0.0 < result.allocator_share < 0.5
    assert 0 < result.alloc_ns_p50 <= result.alloc_ns_p99 <= result.alloc_ns_p999


def test_larger_blocks_waste_more_and_paging_beats_contiguous() -> None:
    trace = default_workload(300, seed=9)
    common = dict(capacity_tokens=30_000, geometry=SMALL_MODEL, time_scale=20.0)
    small = replay(trace, ReplayConfig(mode="paged", block_tokens=16, **common))
    large = replay(trace, ReplayConfig(mode="paged", block_tokens=128, **common))
    contiguous = replay(trace, ReplayConfig(mode="contiguous", **common))
    assert small.internal_waste < large.internal_waste
    assert contiguous.finished == 300
    # Power-of-two buckets waste far more than partial blocks, and they fragment the pool.
    assert contiguous.internal_waste > 3 * small.internal_waste
    assert contiguous.preemptions > small.preemptions
    assert contiguous.fragmentation > 0.0


def test_a_named_replay_publishes_for_the_inspector() -> None:
    from pykvalloc import stats
    name = f"replay-{id(object())}"
    seen: list[int] = []

    def look(simulated_s: float) -> None:
        if not seen:
            with stats.open_segment(name) as segment:
                seen.append(int(segment.snapshot().kv["total_blocks"]))

    replay(default_workload(50, seed=1), ReplayConfig(mode="paged", capacity_tokens=20_000, geometry=SMALL_MODEL,
                                                       pool_name=name), on_step=look)
    assert seen == [20_000 // 16]


@pytest.mark.skipif(not jemalloc_available(), reason="jemalloc is not installed (Debian: libjemalloc2)")
def test_compare_runs_jemalloc_preloaded_in_a_child(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    status = main(["replay", "--compare", "--requests", "150", "--kv-tokens", "60000", "--layers", "2",
                   "--kv-heads", "2", "--head-dim", "64", "--time-scale", "10", "--json", str(out), "--quiet"])
    assert status == 0
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["paged"] * 4 + ["contiguous", "malloc-glibc", "malloc-jemalloc"]
    jemalloc = rows[-1]
    assert jemalloc["finished"] == 150 and jemalloc["timing"] == "around the ctypes call"
