#!/usr/bin/env bash
# run_bench_threads.sh — builds libkvalloc and bench_threads (Release), runs the multi-threaded
# throughput comparison against glibc malloc, jemalloc, mimalloc and tcmalloc at 1, 2 and
# 4 x nproc threads, writes every figure to build/bench_threads.json and prints the table.
# About a minute on a 2-core machine. Extra arguments go to bench_threads (--quick,
# --only kvalloc,tcmalloc, --threads 1,2, --patterns batch64,prodcons, --processes N, --ms N);
# KVA_BUILD_DIR picks another build folder.
#
# The figures are only as quiet as the machine: on a 2-core box, anything else running (a build)
# takes a core from the 2-thread runs and shows up as poor scaling.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${KVA_BUILD_DIR:-$root/build}"

# The peers are preloaded, never linked: a missing one is skipped by bench_threads. As root
# with apt-get, install the missing ones first (the Debian packages of bench_protocol.h).
missing=()
for pair in libjemalloc.so.2:libjemalloc2 libmimalloc.so.2:libmimalloc2.0 \
            libtcmalloc_minimal.so.4:libtcmalloc-minimal4; do
    ldconfig -p 2>/dev/null | grep -q "${pair%%:*} " || missing+=("${pair##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "run_bench_threads.sh: installing ${missing[*]}" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null ||
            echo "run_bench_threads.sh: could not install ${missing[*]}; they will say skipped" >&2
    else
        echo "run_bench_threads.sh: missing ${missing[*]}; they will say skipped" >&2
    fi
fi

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j"$(nproc)" --target bench_threads
"$build/tools/bench_threads" --json "$build/bench_threads.json" "$@"
