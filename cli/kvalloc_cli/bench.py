"""``kvalloc bench``: the benchmarks, shipped with the package.

Five programs measure the library against its targets (docs/benchmarks.md says what each one
does and records their figures):

  alloc    libkvalloc beside glibc malloc, jemalloc, mimalloc and tcmalloc, one thread: batches
           of 64 B and 4 KiB, shuffled frees, mixed sizes, 1-64 MiB blocks, first touch
  threads  the same allocators at 1, 2 and 4 x the CPUs' threads: batches and producer/consumer
  kv       the KV-cache manager: allocation, append, prefix hits, eviction, fork
  varpool  the variable-size pools (first, best and worst fit, TLSF) and the buddy on the same
           traces: fragmentation, waste, failures, ns per operation
  engines  vLLM's own KV-cache manager against pykvalloc.KVCache on the Mooncake conversation
           trace (--trace, default ../shared/traces beside a source checkout): prefill per
           request and decode per token, hit tokens asserted identical. Run it with the Python
           that has vLLM (make test-vllm makes .venv-vllm: .venv-vllm/bin/kvalloc bench
           engines); without vLLM it times pykvalloc alone and says so

Each runs in a child process of its own and prints its table as it goes; the peers run with
LD_PRELOAD set to their Debian libraries (libjemalloc2, libmimalloc2.0,
libgoogle-perftools4 / libtcmalloc-minimal4), and a peer that is not installed is left out.
Timings are only comparable within one run, on a machine with nothing else running. alloc,
threads and engines also give every figure as JSON, {"benchmarks": {"alloc": ..., "threads":
..., "engines": ...}}: --json prints it on stdout (the tables go to stderr then), -o FILE
writes it to FILE.

The exit status is 0 when every benchmark ran and met its targets as it judges them itself
(kv and varpool exit 1 when one of theirs is missed; alloc, threads and engines print their
verdicts and exit 0), else the first nonzero status.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pykvalloc

from .arguments import add_command
from .output import add_report_options, emit_json, wants_table

# name on the command line -> (executable, writes its figures as JSON); the engines benchmark
# is a module of this package, run by this Python (PYTHON_BENCHMARKS). --only names
# allocators, which alloc and threads compare (TAKES_ONLY).
BENCHMARKS = {
    "alloc": ("bench_alloc", True),
    "threads": ("bench_threads", True),
    "kv": ("bench_kv", False),
    "varpool": ("bench_varpool", False),
    "engines": ("kvalloc_cli.bench_engines", True),
}
PYTHON_BENCHMARKS = {"engines"}
TAKES_ONLY = {"alloc", "threads"}

ENV_VAR = "KVALLOC_BENCH_DIR"  # where the executables are, instead of the package's own


def search_dirs() -> list[Path]:
    """Where the benchmark executables may be, in order: ``$KVALLOC_BENCH_DIR`` alone when set;
    else pykvalloc's ``bench`` directory (where pip puts them; an editable install's package
    spans the source tree and site-packages), then ``build/tools`` of the source checkout
    pykvalloc is imported from."""
    override = os.environ.get(ENV_VAR)
    if override is not None:
        return [Path(override)]
    dirs = [Path(entry) / "bench" for entry in pykvalloc.__path__]
    dirs.append(Path(pykvalloc.__file__).resolve().parent.parent / "build" / "tools")
    return dirs


def find(executable: str) -> Path | None:
    if executable == BENCHMARKS["engines"][0]:
        return Path(sys.executable)
    for directory in search_dirs():
        candidate = directory / executable
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def command_line(name: str, path: Path, args: argparse.Namespace, figures: Path | None) -> list[str]:
    """The program's arguments; ``figures``: where it writes its JSON, None for none."""
    executable, writes_json = BENCHMARKS[name]
    argv = [str(path)]
    if name in PYTHON_BENCHMARKS:
        argv += ["-m", executable]
        if args.trace is not None:
            argv += ["--trace", str(args.trace)]
        if args.repeat is not None:
            argv += ["--repeat", str(args.repeat)]
    if args.quick:
        argv.append("--quick")
    if name in TAKES_ONLY and args.only:
        argv += ["--only", args.only]
    if writes_json and figures is not None:
        argv += ["--json", str(figures)]
    return argv


def allocator_names(text: str) -> str:
    """--only's comma-separated allocators, at least one: an empty list ran nothing, or
    everything, and exited 0. The programs themselves refuse a name they do not know."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected NAME[,NAME...] (glibc, jemalloc, mimalloc, tcmalloc, kvalloc), "
                                         f"not {text!r}")
    return ",".join(names)


def benchmark_name(text: str) -> str:
    """A benchmark's name (argparse's choices would refuse the empty default of nargs="*")."""
    if text not in BENCHMARKS and text != "all":
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join([*BENCHMARKS, 'all'])})")
    return text


def register(subparsers: Any) -> None:
    parser = add_command(subparsers, "bench", "run the allocator benchmarks against glibc, jemalloc, mimalloc, "
                         "tcmalloc", __doc__)
    parser.add_argument("benchmarks", nargs="*", metavar="BENCHMARK", type=benchmark_name,
                        default=[],
                        help="alloc, threads, kv, varpool, engines or all (default: alloc)")
    parser.add_argument("--quick", action="store_true",
                        help="a few seconds each: a smoke run, not figures to keep")
    parser.add_argument("--only", metavar="NAME[,NAME...]", type=allocator_names,
                        help="alloc and threads: these allocators only "
                             "(glibc, jemalloc, mimalloc, tcmalloc, kvalloc)")
    parser.add_argument("--trace", type=Path, metavar="FILE",
                        help="engines: the Mooncake conversation trace (JSON lines)")
    parser.add_argument("--repeat", type=int, metavar="N",
                        help="engines: runs of each KV manager, in turn (default 3, or 1 with "
                             "--quick); the figures are their medians")
    add_report_options(parser, "alloc's, threads' and engines' figures")
    parser.add_argument("--list", action="store_true",
                        help="say which benchmarks are installed, and where, then exit")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    names = list(dict.fromkeys(args.benchmarks or ["alloc"]))
    if "all" in names:
        names = list(BENCHMARKS)
    if args.list:
        for name, (executable, _) in BENCHMARKS.items():
            path = find(executable)
            print(f"{name:8} {executable:14} {path if path else 'not installed'}")
        return 0
    if (args.trace is not None or args.repeat is not None) and "engines" not in names:
        print("kvalloc bench: --trace and --repeat apply to the engines benchmark only",
              file=sys.stderr)
        return 2
    if args.repeat is not None and args.repeat < 1:
        print("kvalloc bench: --repeat is at least 1", file=sys.stderr)
        return 2
    wants_json = args.json or args.output is not None
    ignoring = [name for name in names if (args.only and name not in TAKES_ONLY)
                or (wants_json and not BENCHMARKS[name][1])]
    if ignoring:
        print(f"kvalloc bench: {', '.join(ignoring)} ignore some of the options given: --json and "
              f"-o apply to alloc, threads and engines, --only (allocators) to alloc and threads",
              file=sys.stderr)
    found = {name: find(BENCHMARKS[name][0]) for name in names}
    paths = {name: path for name, path in found.items() if path is not None}
    missing = [BENCHMARKS[name][0] for name in names if name not in paths]
    if missing:
        where = ", ".join(str(directory) for directory in search_dirs())
        print(f"kvalloc bench: {', '.join(missing)} not found (looked in {where}); pip installs "
              f"them with the package, and a source checkout builds them with "
              f"`cmake --build build`", file=sys.stderr)
        return 2
    status = 0
    figures: dict[str, Any] = {}
    # The programs print their tables on this process's stdout, or, when stdout holds the JSON
    # alone (--json), on its stderr (descriptor 2).
    tables = None if wants_table(args) else 2
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            written = Path(scratch) / f"{BENCHMARKS[name][0]}.json" if wants_json else None
            argv = command_line(name, paths[name], args, written)
            print(f"== kvalloc bench {name}: {' '.join(argv)}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            code = subprocess.run(argv, stdout=tables, check=False).returncode
            if code < 0:  # killed by a signal: the shell's way of saying so
                code = 128 - code
            if code != 0:
                print(f"== kvalloc bench {name}: exit status {code}", file=sys.stderr, flush=True)
                status = status or code
            if written is not None and written.is_file():
                figures[name] = json.loads(written.read_text())
    emit_json(args, {"benchmarks": figures})
    return status
