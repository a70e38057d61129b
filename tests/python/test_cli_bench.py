"""``kvalloc bench``: the benchmarks that ship with the package, run for real (quick modes)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from support import run_kvalloc

from kvalloc_cli import bench


def test_every_benchmark_is_installed():
    listed = run_kvalloc("bench", "--list")
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert [row[0] for row in rows] == list(bench.BENCHMARKS)
    for name, executable, path in rows:
        assert executable == bench.BENCHMARKS[name][0]
        if name in bench.PYTHON_BENCHMARKS:  # a module, run by the command's own Python
            assert path == sys.executable
        else:
            assert Path(path).is_file() and Path(path).name == executable


def test_alloc_runs_the_comparison_and_writes_its_figures(tmp_path):
    out = tmp_path / "bench.json"
    done = run_kvalloc("bench", "alloc", "--quick", "--only", "kvalloc,glibc", "-o", str(out), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # What runs is a status line (stderr); the program's table is the report (stdout).
    assert "== kvalloc bench alloc:" in done.stderr and "--only kvalloc,glibc" in done.stderr
    assert "64 B batch, ns/op" in done.stdout and "== kvalloc" not in done.stdout
    assert f"wrote {out}" in done.stderr
    figures = json.loads(out.read_text())["benchmarks"]["alloc"]
    assert set(figures["allocators"]) == {"glibc", "kvalloc"}
    assert figures["allocators"]["kvalloc"]["metrics"]["batch64_ns_per_op"] > 0


def test_json_puts_the_figures_alone_on_stdout():
    done = run_kvalloc("bench", "alloc", "--quick", "--only", "kvalloc", "--json", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(done.stdout)["benchmarks"]["alloc"]  # nothing else on stdout
    assert set(figures["allocators"]) == {"kvalloc"}
    assert "64 B batch, ns/op" in done.stderr


def test_varpool_exit_status_is_the_programs_verdict():
    done = run_kvalloc("bench", "varpool", "--quick", timeout=300)
    verdicts = [line for line in done.stdout.splitlines() if line.rstrip().endswith((": pass", ": FAIL"))]
    assert len(verdicts) == 5, done.stdout  # TLSF's speed and four traces' fragmentation
    missed = any(line.rstrip().endswith("FAIL") for line in verdicts)
    assert (done.returncode == 1) == missed and done.returncode in (0, 1), done.stdout + done.stderr
    assert ("exit status 1" in done.stderr) == missed


def test_missing_programs_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv(bench.ENV_VAR, str(tmp_path))
    done = run_kvalloc("bench", "kv", "varpool")
    assert done.returncode == 2
    assert "bench_kv, bench_varpool not found" in done.stderr and str(tmp_path) in done.stderr


def test_unknown_benchmark_is_a_usage_error():
    done = run_kvalloc("bench", "alloc", "nonsense")
    assert done.returncode == 2 and "invalid choice: 'nonsense'" in done.stderr


def test_only_names_allocators_it_knows():
    # ",,," ran an empty table with exit status 0, and "" every allocator.
    for only in (",,,", "", "kvalloc,,glibc"):
        done = run_kvalloc("bench", "alloc", "--quick", "--only", only)
        assert done.returncode == 2 and "expected NAME[,NAME...]" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    done = run_kvalloc("bench", "alloc", "--quick", "--only", "kvalloc,ptmalloc")  # the program's own refusal
    assert done.returncode == 1 and "unknown allocator 'ptmalloc'" in done.stderr, done.stderr


def test_output_must_be_a_file_it_can_write(tmp_path):
    # Refused before anything runs: a directory, a path through a file.
    afile = tmp_path / "afile"
    afile.write_text("")
    for target, why in ((tmp_path, "it is a directory"), (afile / "below", "no directory")):
        done = run_kvalloc("bench", "alloc", "--quick", "-o", str(target))
        assert done.returncode == 2 and why in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_options_a_benchmark_does_not_take_are_said_to_be_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv(bench.ENV_VAR, str(tmp_path))  # nothing runs: the programs are "missing"
    done = run_kvalloc("bench", "kv", "--only", "kvalloc")
    assert "kv ignore some of the options given" in done.stderr
    assert "--only (allocators) to alloc and threads" in done.stderr
    done = run_kvalloc("bench", "engines", "alloc", "--only", "kvalloc")
    assert "engines ignore some" in done.stderr  # alloc takes it
    done = run_kvalloc("bench", "engines", "--json", "--trace", str(tmp_path / "none.jsonl"))
    assert "ignore some" not in done.stderr


TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


@pytest.mark.skipif(not TRACE.is_file(), reason=f"the Mooncake trace is not at {TRACE} "
                    "(../shared beside the repository)")
def test_engines_times_pykvalloc_and_says_when_vllm_is_not_there(tmp_path):
    out = tmp_path / "engines.json"
    done = run_kvalloc("bench", "engines", "--quick", "--trace", str(TRACE), "-o", str(out),
                       timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())["benchmarks"]["engines"]
    assert figures["requests"] == 200
    rows = figures["rows"]
    assert [row["blocks"] for row in rows][1:] == [16000]
    for row in rows:  # figures, not judged: a time is whatever the machine gives
        assert math.isfinite(row["pykvalloc_prefill_us"])
        assert math.isfinite(row["pykvalloc_decode_us_per_token"])
        assert row["hit_tokens"] > 0 and row["runs"] == 1
    try:
        import vllm  # noqa: F401
    except ImportError:  # the test environment's case: said in one line, pykvalloc timed alone
        assert "vLLM is not importable here" in done.stdout
        assert all("vllm_prefill_us" not in row for row in rows)
    else:
        assert all(math.isfinite(row["prefill_ratio"]) for row in rows)


def test_engines_says_where_the_trace_is_missing(tmp_path):
    done = run_kvalloc("bench", "engines", "--trace", str(tmp_path / "none.jsonl"))
    assert done.returncode == 2
    assert "none.jsonl" in done.stdout + done.stderr and "give --trace" in done.stdout + done.stderr


def test_trace_and_repeat_are_for_the_engines_benchmark_only(tmp_path):
    for option in (("--trace", str(tmp_path)), ("--repeat", "2")):
        done = run_kvalloc("bench", "kv", *option)
        assert done.returncode == 2
        assert "--trace and --repeat apply to the engines benchmark only" in done.stderr
    done = run_kvalloc("bench", "engines", "--repeat", "0")
    assert done.returncode == 2 and "--repeat is at least 1" in done.stderr


def test_engines_figures_are_the_medians_of_the_runs():
    from kvalloc_cli import bench_engines

    def outcome(prefill_ns: int) -> bench_engines.Outcome:
        return bench_engines.Outcome(timings=bench_engines.Timings(prefill_ns=prefill_ns,
                                                                   prefills=1))

    runs = [outcome(ns) for ns in (3000, 1000, 2000)]
    assert bench_engines.median_per(runs, "prefill") == 2.0  # µs
    assert bench_engines.median_per(runs + [outcome(4000)], "prefill") == 2.5
