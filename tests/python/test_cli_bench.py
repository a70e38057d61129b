"""``kvalloc bench``: the C benchmarks that ship with the package, run for real (quick modes)."""

from __future__ import annotations

import json
from pathlib import Path

from support import run_kvalloc

from kvalloc_cli import bench


def test_every_benchmark_is_installed():
    listed = run_kvalloc("bench", "--list")
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert [row[0] for row in rows] == list(bench.BENCHMARKS)
    for name, executable, path in rows:
        assert executable == bench.BENCHMARKS[name][0]
        assert Path(path).is_file() and Path(path).name == executable


def test_alloc_runs_the_comparison_and_writes_its_figures(tmp_path):
    done = run_kvalloc("bench", "alloc", "--quick", "--only", "kvalloc,glibc", "--json", str(tmp_path / "out"),
                       timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== kvalloc bench alloc:" in done.stdout and "--only kvalloc,glibc" in done.stdout
    assert "64 B batch, ns/op" in done.stdout          # the table the program prints
    figures = json.loads((tmp_path / "out" / "bench_alloc.json").read_text())
    assert set(figures["allocators"]) == {"glibc", "kvalloc"}
    assert figures["allocators"]["kvalloc"]["metrics"]["batch64_ns_per_op"] > 0


def test_varpool_exit_status_is_the_programs_verdict():
    done = run_kvalloc("bench", "varpool", "--quick", timeout=300)
    verdicts = [line for line in done.stdout.splitlines() if line.rstrip().endswith((": pass", ": FAIL"))]
    assert len(verdicts) == 5, done.stdout  # TLSF's speed and four traces' fragmentation
    missed = any(line.rstrip().endswith("FAIL") for line in verdicts)
    assert (done.returncode == 1) == missed and done.returncode in (0, 1), done.stdout + done.stderr
    assert ("exit status 1" in done.stdout) == missed


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


def test_json_must_name_a_directory(tmp_path):
    # An existing file (or a path through one) ended in a FileExistsError traceback.
    afile = tmp_path / "afile"
    afile.write_text("")
    for target in (afile, afile / "below"):
        done = run_kvalloc("bench", "alloc", "--quick", "--json", str(target))
        assert done.returncode == 2 and "is not a directory" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_options_a_benchmark_does_not_take_are_said_to_be_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv(bench.ENV_VAR, str(tmp_path))  # nothing runs: the programs are "missing"
    done = run_kvalloc("bench", "kv", "--only", "kvalloc")
    assert "kv measure libkvalloc alone" in done.stderr and "--only and --json apply to alloc and threads" in done.stderr
