"""The continuous-batching simulation: its invariants on small traffic, and the report."""
from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
from support import run_kvalloc

from kvalloc_cli import main
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


def step_limit(limit: int):
    """An on_step that fails a replay still running after ``limit`` steps (one that never ends)."""
    steps = [0]

    def count(simulated_s: float) -> None:
        steps[0] += 1
        if steps[0] > limit:
            raise AssertionError(f"the replay runs past {limit} steps")

    return count


@pytest.mark.parametrize("mode, capacity, prompt, output", [
    ("paged", 160, 100, 200),          # the prompt fits, prompt + answer never does
    ("contiguous", 8192, 4000, 200),   # growing out of the 4,096 bucket holds it and the 8,192 one
    ("contiguous", 12288, 8000, 300),  # past max_context (8,192 here), though within the capacity
    ("malloc-glibc", 4000, 5000, 10),  # the prompt alone is over the budget
])
def test_a_request_that_can_never_complete_is_rejected_and_the_replay_goes_on(
        mode: str, capacity: int, prompt: int, output: int) -> None:
    # The first two preempted themselves and were readmitted forever; the third raised
    # InvalidArgument from the cache mid-run; the fourth aborted the whole replay.
    trace = Trace([Request(0.0, prompt, output), Request(0.5, 50, 10)], source="one too large")
    result = replay(trace, ReplayConfig(mode=mode, capacity_tokens=capacity, geometry=SMALL_MODEL),
                    on_step=step_limit(1000))
    assert (result.finished, result.rejected) == (1, 1)
    assert result.as_dict()["rejected"] == 1


def test_a_request_stuck_alone_in_the_cache_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    # Past what the backend foresees, a request that preempts itself or cannot be admitted with
    # nothing else running has proved it can never fit: rejected, not readmitted forever.
    from pykvalloc.replay.backends import PagedBackend
    monkeypatch.setattr(PagedBackend, "never_fits", lambda self, prompt, final: None)
    trace = Trace([Request(0.0, 100, 200), Request(0.0, 200, 5), Request(0.5, 50, 10)], source="stuck")
    result = replay(trace, ReplayConfig(mode="paged", capacity_tokens=160, geometry=SMALL_MODEL),
                    on_step=step_limit(1000))
    assert (result.finished, result.rejected) == (1, 2)


def test_a_rejected_request_is_in_the_report_and_the_exit_status(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "big.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 100, "output_length": 5}\n'
                     '{"timestamp": 10, "input_length": 900, "output_length": 200}\n')
    out = tmp_path / "report.json"
    assert main(["replay", str(trace), "--kv-tokens", "1000", "--layers", "2", "--kv-heads", "2",
                 "--head-dim", "64", "-o", str(out), "--quiet"]) == 1
    printed = " ".join(capsys.readouterr().out.split())      # however the console wraps it
    assert "rejected 1 of 2 requests, which can never complete" in printed
    report = json.loads(out.read_text())["runs"][0]
    assert (report["finished"], report["rejected"]) == (1, 1)


def test_compare_shows_a_failed_configuration_as_a_failed_column(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    # 40 tokens of KV hold no contiguous bucket (64 tokens at least): that configuration fails
    # when its cache is made, and the others still make the table.
    trace = tmp_path / "small.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n')
    out = tmp_path / "compare.json"
    assert main(["replay", str(trace), "--compare", "--kv-tokens", "40", "--layers", "2", "--kv-heads", "2",
                 "--head-dim", "64", "-o", str(out), "--quiet"]) == 1
    printed = " ".join(capsys.readouterr().out.split())      # however the console wraps it
    assert "contiguous failed: invalid argument" in printed and "holds no bucket" in printed
    rows = json.loads(out.read_text())["runs"]
    assert [r["mode"] for r in rows][:6] == ["paged"] * 4 + ["contiguous", "malloc-glibc"]
    assert "error" in rows[4] and all(r["finished"] == 1 for i, r in enumerate(rows) if i != 4)


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_decodes() -> None:
    # A 9,000-token prompt over the 8,192-token budget, chunked, runs beside the first request's
    # answer; waiting for an empty batch would take that answer's 1,000 steps.
    tiny = Geometry(layers=1, kv_heads=1, head_dim=1)
    trace = Trace([Request(0.0, 100, 1000), Request(0.001, 9000, 1000)], source="long prompt")
    config = ReplayConfig(capacity_tokens=1 << 20, geometry=tiny)
    times = [0.0]
    result = replay(trace, config, on_step=times.append)
    assert result.finished == 2 and result.steps < 1010
    longest = max(b - a for a, b in zip(times, times[1:]))
    assert longest <= config.step_base_s + config.step_token_s * config.max_batch_tokens + 1e-9


def test_only_uncached_prompt_tokens_take_the_step_budget() -> None:
    tiny = Geometry(layers=1, kv_heads=1, head_dim=1)
    ids = tuple(range(16))
    trace = Trace([Request(0.0, 100, 1000), Request(0.001, 8192, 1, ids), Request(0.05, 8192, 1, ids)],
                  source="shared prompt")
    config = ReplayConfig(capacity_tokens=1 << 20, geometry=tiny)
    result = replay(trace, config)
    assert result.finished == 3 and result.prefix_hit_rate > 0.4
    # The second copy of the prompt was all but free: about one prompt's prefill in all.
    prefill_s = result.simulated_s - result.steps * config.step_base_s - 1000 * config.step_token_s
    assert prefill_s < (100 + 8192 + 512) * config.step_token_s


def test_the_time_weighted_fragmentation_is_a_share() -> None:
    # Measured every 16th step and weighted as 16 steps, a 3-step run reported 252%.
    trace = Trace([Request(0.0, 100, 2), Request(0.0, 300, 2)], source="two requests")
    result = replay(trace, ReplayConfig(mode="contiguous", capacity_tokens=1024))
    assert result.steps < 16
    assert 0.0 < result.fragmentation <= 1.0


@pytest.mark.parametrize("mode, trace", [
    ("malloc-glibc", default_workload(20, seed=2)),
    ("contiguous", default_workload(20, seed=2)),
    ("paged", burst(5, prompt=600, output=5)),          # no hash ids
])
def test_a_hit_rate_that_cannot_be_measured_is_none_and_shows_as_a_dash(
        mode: str, trace: Trace, capsys: pytest.CaptureFixture[str]) -> None:
    from kvalloc_cli.report import print_report
    result = replay(trace, ReplayConfig(mode=mode, capacity_tokens=60_000, geometry=SMALL_MODEL))
    assert result.prefix_hit_rate is None
    print_report([result])
    row = next(line for line in capsys.readouterr().out.splitlines() if "prefix hit rate" in line)
    assert "-" in row and "%" not in row


def test_a_block_size_that_cannot_be_keyed_is_said_and_not_measured(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # 48 neither divides 512 nor is a multiple of it: the hit rate printed 0.0%, silently.
    trace = tmp_path / "ids.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}\n'
                     '{"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}\n')
    common = ["replay", str(trace), "--kv-tokens", "4096", "--layers", "2", "--kv-heads", "2", "--head-dim", "64",
              "--quiet"]
    assert main([*common, "--block-tokens", "48"]) == 0
    said = capsys.readouterr()
    printed = said.out
    assert "--block-tokens 48 neither divides nor is a multiple" in " ".join(said.err.split())
    row = next(line for line in printed.splitlines() if "prefix hit rate" in line)
    assert "-" in row and "%" not in row
    # A multiple of 512 keys each block by the ids it covers: the second request hits both.
    out = tmp_path / "report.json"
    assert main([*common, "--block-tokens", "1024", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["runs"][0]["prefix_hit_rate"] == pytest.approx(1024 / 2200)


def test_hash_ids_up_to_64_bits_replay() -> None:
    # ids << 8 overflowed the cache's 64-bit keys from 2^56 up.
    trace = Trace([Request(0.0, 600, 5, (1 << 56, 1)), Request(1.0, 600, 5, ((1 << 64) - 1, 1))], source="big ids")
    result = replay(trace, ReplayConfig(capacity_tokens=4096, geometry=SMALL_MODEL))
    assert result.finished == 2 and result.prefix_hit_rate == 0.0


def test_waiting_requests_are_admitted_as_memory_frees() -> None:
    # Ten requests that each need the whole cache: they must run one after another.
    result = replay(burst(10, prompt=900, output=100), ReplayConfig(mode="malloc-glibc", capacity_tokens=1000,
                                                                     geometry=SMALL_MODEL))
    assert result.finished == 10
    assert result.peak_kv_use == pytest.approx(1.0)


def test_the_peak_is_the_fullest_the_cache_was(monkeypatch: pytest.MonkeyPatch) -> None:
    # The peak was read at the end of each step, after finished requests gave their blocks
    # back: a finishing request's last block, or the moment of a preemption, could be fuller
    # (13 of 300 such random runs reported a peak below the true one, some below the use at
    # the first preemption). Every allocation the backend makes is watched here.
    import random

    from pykvalloc.replay.backends import PagedBackend
    fullest = [0.0]
    admit, extend = PagedBackend.admit, PagedBackend.extend

    def watched(method):
        def call(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            fullest[0] = max(fullest[0], self.usage()[0])
            return out
        return call

    monkeypatch.setattr(PagedBackend, "admit", watched(admit))
    monkeypatch.setattr(PagedBackend, "extend", watched(extend))
    rng = random.Random(1)
    tiny = Geometry(layers=1, kv_heads=1, head_dim=1)
    for _ in range(300):
        requests = sorted((Request(rng.random() * 2, rng.randint(20, 200), rng.randint(1, 150))
                           for _ in range(rng.randint(2, 8))), key=lambda r: r.arrival_s)
        fullest[0] = 0.0
        result = replay(Trace(requests, "random"), ReplayConfig(capacity_tokens=480, geometry=tiny))
        assert result.peak_kv_use == pytest.approx(fullest[0])
        assert (result.kv_use_at_first_preemption or 0.0) <= result.peak_kv_use


def test_the_time_scale_compresses_arrivals() -> None:
    trace = burst(20, prompt=100, output=5, gap=10.0)
    slow = replay(trace, ReplayConfig(mode="malloc-glibc", capacity_tokens=10_000, geometry=SMALL_MODEL))
    fast = replay(trace, ReplayConfig(mode="malloc-glibc", capacity_tokens=10_000, geometry=SMALL_MODEL,
                                      time_scale=100.0))
    assert slow.simulated_s > 180 and fast.simulated_s < 5


def test_replay_command_writes_the_json_report(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    status = main(["replay", "--mode", "malloc-glibc", "--requests", "200", "--kv-tokens", "60000",
                   "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "-o", str(out), "--quiet"])
    assert status == 0
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 1  # one configuration: a list of one, as --compare's is of several
    report = runs[0]
    for key in ("requests", "finished", "rejected", "preemptions", "kv_use_at_first_preemption", "peak_kv_use",
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
    assert "skipped 1 malformed" in capsys.readouterr().err


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
                   "--kv-heads", "2", "--head-dim", "64", "--time-scale", "10", "-o", str(out), "--quiet"])
    assert status == 0
    rows = json.loads(out.read_text())["runs"]
    assert [r["mode"] for r in rows] == ["paged"] * 4 + ["contiguous", "malloc-glibc", "malloc-jemalloc"]
    jemalloc = rows[-1]
    assert jemalloc["finished"] == 150 and jemalloc["timing"] == "around the ctypes call"


@pytest.mark.skipif(not jemalloc_available(), reason="jemalloc is not installed (Debian: libjemalloc2)")
def test_the_jemalloc_column_stands_when_a_request_is_rejected(tmp_path: Path) -> None:
    # The child's exit status 1 (a rejected request) made the parent call the column failed,
    # with an empty reason; the child's report says what was rejected.
    out = tmp_path / "compare.json"
    assert main(["replay", "--compare", "--requests", "300", "--kv-size", "1G", "-o", str(out), "--quiet"]) == 1
    jemalloc = json.loads(out.read_text())["runs"][-1]
    assert jemalloc["mode"] == "malloc-jemalloc" and "error" not in jemalloc
    assert jemalloc["rejected"] == 1 and jemalloc["finished"] == 299


def test_preemptions_do_not_raise_the_prefix_hit_rate() -> None:
    # A re-admitted request finds its own blocks of a moment ago. Counted as prefix hits, they
    # would make a cache too small for the load (1 GiB of 16 GiB: about a hundred preemptions)
    # hit more, not less (58 % against 44 % on 2,000 requests), so they are counted apart.
    trace = default_workload(300)
    geometry = Geometry()
    def run(size: int):
        return replay(trace, ReplayConfig(mode="paged", capacity_tokens=size // geometry.bytes_per_token,
                                          geometry=geometry))
    small, large = run(1 << 30), run(16 << 30)
    assert small.preemptions > 50 and large.preemptions == 0
    assert small.readmission_hit_rate is not None and small.readmission_hit_rate > 0.8
    assert large.readmission_hit_rate is None
    assert abs(small.prefix_hit_rate - large.prefix_hit_rate) < 0.03, (small.prefix_hit_rate, large.prefix_hit_rate)
    # The replay marks its re-admissions (again=True): the cache's own counters give the same
    # two rates, exactly.
    for result in (small, large):
        c = result.kv_hit_counters
        assert c is not None
        first_query = c["query_tokens"] - c["readmit_query_tokens"]
        assert result.prefix_hit_rate == (c["hit_tokens"] - c["readmit_hit_tokens"]) / first_query
    c = small.kv_hit_counters
    assert c["readmit_query_tokens"] > 0
    assert small.readmission_hit_rate == c["readmit_hit_tokens"] / c["readmit_query_tokens"]
    assert large.kv_hit_counters["readmit_query_tokens"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--block-tokens", "0"], "argument --block-tokens: must be at least 1, not 0"),
    (["--layers", "0"], "argument --layers: must be at least 1"),
    (["--kv-heads", "0"], "argument --kv-heads: must be at least 1"),
    (["--head-dim", "-3"], "argument --head-dim: must be at least 1"),
    (["--kv-tokens", "0"], "argument --kv-tokens: must be at least 1"),
    (["--max-batch-tokens", "0"], "argument --max-batch-tokens: must be at least 1"),
    (["--requests", "-1"], "argument --requests: must be at least 1, not -1"),
    (["--dtype", "bogus"], "argument --dtype: unknown KV dtype 'bogus'"),
    (["--time-scale", "0"], "argument --time-scale: must be a finite number above 0"),
    (["--time-scale", "nan"], "argument --time-scale: must be a finite number above 0, not 'nan'"),
    (["--time-scale", "-1"], "argument --time-scale: must be a finite number above 0"),
    (["--speed", "nan"], "argument --speed: must be a finite number above 0"),
    (["-o", "/nonexistent/x.json"], "argument -o/--output: cannot write /nonexistent/x.json: no directory"),
    (["--plot", "/"], "argument --plot: cannot write /: it is a directory"),
])
def test_replay_refuses_bad_arguments_before_it_runs(argv: list[str], message: str) -> None:
    # A real kvalloc process: each of these is refused before the replay starts, with exit
    # status 2 and no traceback (not a hang, not a silently dropped request for --requests -1,
    # not a -o failure after the whole replay).
    done = run_kvalloc("replay", "--mode", "malloc-glibc", "--requests", "50", "--quiet", *argv,
                       timeout=60)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""


def test_the_replay_config_refuses_what_would_divide_by_zero_or_never_end() -> None:
    # The same numbers given to the Python API: InvalidArgument, not a hang or ZeroDivisionError.
    for bad in (dict(time_scale=0.0), dict(time_scale=float("nan")), dict(time_scale=-1.0),
                dict(block_tokens=0), dict(capacity_tokens=0), dict(max_batch_tokens=0)):
        with pytest.raises(InvalidArgument, match=next(iter(bad))):
            ReplayConfig(mode="malloc-glibc", geometry=SMALL_MODEL, **bad)
    for bad in (dict(layers=0), dict(kv_heads=0), dict(head_dim=0), dict(dtype="bogus")):
        with pytest.raises(InvalidArgument, match="bogus" if "dtype" in bad else next(iter(bad))):
            Geometry(**bad)
    # The replay sizes KV with the cache's own dtype table: engines' names work in both.
    assert Geometry(layers=2, kv_heads=2, head_dim=64, dtype="fp8").bytes_per_token == 512


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_trace_with_a_non_finite_number_names_its_line(tmp_path: Path, number: str) -> None:
    # NaN passed `timestamp < 0` and the replay waited for its arrival forever; Infinity ended
    # as "simulated_s": Infinity, which is not JSON.
    trace = tmp_path / "nonfinite.jsonl"
    trace.write_text(f'{{"timestamp": {number}, "input_length": 10, "output_length": 5}}\n'
                     '{"timestamp": 1000, "input_length": 10, "output_length": 5}\n')
    done = run_kvalloc("replay", str(trace), "--mode", "malloc-glibc", "--quiet", timeout=60)
    assert done.returncode == 1
    assert f"{trace}:1: " in done.stderr and "Traceback" not in done.stderr
    report = tmp_path / "report.json"
    done = run_kvalloc("replay", str(trace), "--mode", "malloc-glibc", "--quiet", "--skip-bad",
                       "-o", str(report), timeout=60)
    assert done.returncode == 0, done.stderr
    assert "skipped 1 malformed" in done.stderr and f"wrote {report}" in done.stderr
    runs = json.loads(report.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in JSON"))["runs"]
    report_json = runs[0]
    assert report_json["requests"] == report_json["finished"] == 1


@pytest.mark.parametrize("content, line, reason", [
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,2\n"
     b"2023-11-16 18:15:47.1,1\xff\xfe,2\n2023-11-16 18:15:48.1,10,2\n", 3, "not UTF-8 text: byte 0xff"),
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,2\n"
     b"2023-11-16 18:15:47.1," + b"9" * 140_000 + b",2\n2023-11-16 18:15:48.1,10,2\n", 3, "field larger than field limit"),
])
def test_a_csv_line_that_cannot_be_read_names_its_line(tmp_path: Path, content: bytes, line: int,
                                                       reason: str) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_bytes(content)
    done = run_kvalloc("replay", str(trace), "--mode", "malloc-glibc", "--quiet", timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"bad.csv:{line}: {reason}" in done.stderr
    done = run_kvalloc("replay", str(trace), "--mode", "malloc-glibc", "--quiet", "--skip-bad", timeout=60)
    assert done.returncode == 0, done.stderr
    assert "skipped 1 malformed" in done.stderr


@pytest.mark.parametrize("mode", ["paged", "contiguous"])
def test_a_replay_asked_to_stop_gives_back_its_blocks_and_says_so(mode: str) -> None:
    # The demo's replay, watched live, is stopped when the person watching quits: it stops at the
    # next step with requests under way, gives their memory back (the run still verifies that
    # nothing is left) and reports the run so far.
    trace = default_workload(400, seed=5)
    config = ReplayConfig(mode=mode, capacity_tokens=24_000, geometry=SMALL_MODEL, time_scale=20.0)
    asked: list[int] = []
    result = replay(trace, config, on_step=lambda s: asked.append(1),
                    should_stop=lambda: len(asked) >= 300)
    assert result.stopped and result.steps == 300
    assert 0 < result.finished < 400 and result.simulated_s > 0
    assert result.as_dict()["stopped"] is True
    whole = replay(trace, config)
    assert not whole.stopped and whole.finished == 400 and whole.steps > 300


def test_a_replay_held_to_a_speed_stopped_by_a_signal_reports_the_run_so_far(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    from pykvalloc import stats
    from pykvalloc.errors import SegmentNotFound
    from support import clean_env
    name = f"stopped-{os.getpid()}"
    out = tmp_path / "report.json"
    engine = subprocess.Popen([sys.executable, "-m", "kvalloc_cli", "replay", "--speed", "5", "--name", name,
                               "--quiet", "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=clean_env())
    try:
        for polls in itertools.count():  # its segment exists once the replay runs, and it handles SIGTERM by then
            try:
                with stats.open_segment(name):
                    break
            except SegmentNotFound:
                assert engine.poll() is None, engine.communicate()
                assert polls < 2400, "hung: the replay published no statistics in 2,400 polls of 0.05 s"
                time.sleep(0.05)
        time.sleep(0.5)
        engine.send_signal(signal.SIGTERM)
        said, errors = engine.communicate(timeout=60)
    finally:
        if engine.poll() is None:
            engine.kill()
    assert engine.returncode == 130, errors
    report = json.loads(out.read_text())["runs"][0]
    assert report["stopped"] is True and report["finished"] < report["requests"] == 2000
    assert "stopped early, as asked" in said


@pytest.mark.parametrize("argv", [["--mode", "contiguous"], ["--mode", "malloc-glibc"], ["--compare"]])
def test_block_tokens_where_there_are_none_to_size_is_refused(argv: list[str], capsys) -> None:
    # Taken and ignored before: contiguous and malloc have no blocks, and --compare runs 16 .. 128.
    assert main(["replay", "--requests", "3", "--block-tokens", "32", *argv]) == 2
    assert "--block-tokens applies to --mode paged without --compare" in capsys.readouterr().err


def test_a_contiguous_report_says_why_it_preempts(capsys) -> None:
    assert main(["replay", "--requests", "300", "--kv-size", "1G", "--mode", "contiguous"]) == 1  # 2 rejected
    said = " ".join(capsys.readouterr().out.split())
    assert "contiguous: each request holds one buffer of a power of two of tokens" in said
    assert "preemptions where a paged cache of the same size needs far fewer" in said


def test_engine_buffers_move_the_buddy_the_slabs_and_fragmentation() -> None:
    # kvalloc demo's engine: beside its KV cache, in the same pool, the buffers of each step and
    # each request, so that the inspector's buddy, slab and fragmentation panels move.
    from pykvalloc import stats
    name = f"engine-{id(object())}"
    free_blocks: set[tuple[int, ...]] = set()
    slab_classes: set[int] = set()
    fragmentation: list[float] = []
    steps = [0]

    def look(simulated_s: float) -> None:
        steps[0] += 1
        if steps[0] % 25:
            return
        # The pool publishes from its calls at most every 200 ms: a pause lets a few happen.
        time.sleep(0.02)
        with stats.open_segment(name) as segment:
            snap = segment.snapshot()
        assert snap.kv is not None  # one segment: the pool's, with its KV cache
        free_blocks.add(tuple(int(n) for n in snap.free_blocks))
        slab_classes.update(int(c["object_size"]) for c in snap.classes if c["slabs"])
        fragmentation.append(snap.fragmentation)

    config = ReplayConfig(mode="paged", capacity_tokens=16384, pool_name=name, engine_buffers=True)
    result = replay(default_workload(150, seed=3), config, on_step=look)
    assert result.finished == result.requests == 150
    assert len(free_blocks) >= 2                       # the buddy's orders moved
    assert {64, 64 << 10} <= slab_classes              # token metadata, scratch
    assert max(fragmentation) > 0.0
    costs = result.engine_buffers
    assert costs is not None and list(costs) == ["activations", "attn output", "scratch", "token meta"]
    for kind, cost in costs.items():
        assert cost["allocations"] > 0 and cost["failures"] == 0, kind
        assert cost["calls"] == 2 * cost["allocations"]  # each freed: the backend checked none is left
    assert costs["activations"]["path"] == "both" and costs["token meta"]["path"] == "slab"
    assert costs["activations"]["mean_bytes"] > 64 << 10


def test_engine_buffers_are_in_the_report_and_only_for_a_paged_cache(capsys) -> None:
    assert main(["replay", "--requests", "60", "--kv-tokens", "4096", "--engine-buffers", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "the engine's buffers beside the KV cache" in out
    for kind in ("activations", "attn output", "scratch", "token meta"):
        assert kind in out
    with pytest.raises(InvalidArgument):
        replay(default_workload(5), ReplayConfig(mode="contiguous", capacity_tokens=4096, engine_buffers=True))
    assert main(["replay", "--mode", "contiguous", "--engine-buffers", "--requests", "5"]) == 2
    assert "--engine-buffers applies to --mode paged" in capsys.readouterr().err


def test_every_dash_and_odd_figure_of_the_report_is_explained(capsys) -> None:
    # The Azure trace has no prefix ids: every hit rate is '-' (re-admissions said 0.0 %, a
    # figure never measured), and the malloc columns peak at 100 % KV use with no preemption.
    from kvalloc_cli.report import notes, print_report
    no_ids = burst(30, 500, 400, gap=0.05)
    results = [replay(no_ids, ReplayConfig(mode=mode, capacity_tokens=6_000, geometry=SMALL_MODEL))
               for mode in ("paged", "malloc-glibc")]
    paged, malloc = (r.as_dict() for r in results)
    assert paged["preemptions"] > 0                     # re-admissions happened: not measured
    assert paged["prefix_hit_rate"] is None and paged["readmission_hit_rate"] is None
    assert paged["hits_unmeasured"] == "the trace carries no prefix ids (hash ids) to key blocks by"
    assert malloc["hits_unmeasured"] == "malloc has no prefix cache"
    assert malloc["preemptions"] == 0 and malloc["kv_use_at_first_preemption"] is None
    said = notes([paged, malloc])
    assert any(n.startswith("prefix hit rate - (paged/16): the trace carries no prefix ids") for n in said)
    assert any(n.startswith("malloc-glibc: each request reserves its whole KV") for n in said)
    full = notes([dict(malloc, peak_kv_use=1.0)])
    assert any("the peak of 100.0% (malloc-glibc) is the budget full of reservations" in n for n in full)
    print_report(results)
    out = " ".join(capsys.readouterr().out.split())
    assert "the trace carries no prefix ids" in out and "never preempted" in out

    keyed = replay(default_workload(60, seed=2), ReplayConfig(mode="paged", capacity_tokens=60_000,
                                                               geometry=SMALL_MODEL)).as_dict()
    assert keyed["preemptions"] == 0 and keyed["hits_unmeasured"] is None
    assert keyed["prefix_hit_rate"] is not None and keyed["readmission_hit_rate"] is None
    said = notes([keyed])
    assert any("re-admissions - (paged/16): no request was preempted" in n for n in said)
    assert any("KV use at first preemption - (paged/16): nothing was preempted" in n for n in said)


def test_the_plot_draws_every_configuration_on_a_shared_sensible_time_axis(tmp_path: Path) -> None:
    from kvalloc_cli.report import plot_layout, report_json
    trace = default_workload(80, seed=4)
    paged = replay(trace, ReplayConfig(mode="paged", capacity_tokens=20_000, geometry=SMALL_MODEL, sample_every=4))
    # A configuration replayed in a child process (jemalloc) comes back as its JSON, samples in it.
    child = report_json([replay(trace, ReplayConfig(mode="malloc-glibc", capacity_tokens=20_000,
                                                    geometry=SMALL_MODEL, sample_every=4))], samples=True)["runs"][0]
    child["mode"] = "malloc-jemalloc"
    assert child["samples"] and len(child["samples"][0]) == 5
    stretched = dict(child, mode="contiguous", simulated_s=10 * paged.simulated_s,
                     samples=[[10 * s[0], *s[1:]] for s in child["samples"]])
    failed = {"mode": "contiguous", "block_tokens": 16, "error": "too small"}
    layout = plot_layout([paged, child, stretched, failed])
    assert [row["mode"] for row, _ in layout.series] == ["paged", "malloc-jemalloc", "contiguous"]
    assert layout.not_drawn == ["contiguous"]
    # The run ten times longer does not stretch the axis: it goes off its edge, and says so.
    assert layout.x_max == max(paged.simulated_s, child["simulated_s"])
    assert layout.names[2] == f"contiguous (runs to {stretched['simulated_s']:,.0f} s)"
    assert "samples" not in report_json([child])["runs"][0]  # only the child's report carries them


def test_the_plot_file_is_written_with_every_configuration(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra (matplotlib)")
    from kvalloc_cli.report import write_plot
    trace = default_workload(60, seed=4)
    results = [replay(trace, ReplayConfig(mode=mode, capacity_tokens=20_000, geometry=SMALL_MODEL, sample_every=4))
               for mode in ("paged", "malloc-glibc")]
    write_plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_replay_asked_for_its_samples_writes_them_in_its_json(tmp_path: Path) -> None:
    out = tmp_path / "child.json"
    done = run_kvalloc("replay", "--mode", "malloc-glibc", "--requests", "40", "--quiet", "--with-samples",
                       "-o", str(out))
    assert done.returncode == 0, done.stderr
    run = json.loads(out.read_text())["runs"][0]
    assert run["samples"] and all(len(sample) == 5 for sample in run["samples"])
