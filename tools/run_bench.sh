#!/usr/bin/env bash
# run_bench.sh — builds libkvalloc and bench_alloc (Release), runs the full comparison against
# glibc malloc, jemalloc, mimalloc and tcmalloc, writes every figure to build/bench.json and
# prints the table. About half a minute on a 2-core machine. Extra arguments go to bench_alloc
# (--quick, --only kvalloc,tcmalloc, --rounds N); KVA_BUILD_DIR picks another build folder.
#
# The syscall check runs inside bench_alloc under strace. By hand it is
#     strace -f -o trace.log build/tools/bench_alloc --child kvalloc --pattern syscalls
# after which trace.log must hold no line between the write of KVA_SYSCALL_CHECK_BEGIN and
# the write of KVA_SYSCALL_CHECK_END: the pool is created before the first and destroyed
# after the second.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${KVA_BUILD_DIR:-$root/build}"

if ! command -v strace >/dev/null 2>&1; then
    echo "run_bench.sh: installing strace for the syscall check" >&2
    apt-get install -y strace >/dev/null ||
        echo "run_bench.sh: strace could not be installed; the syscall check will say skipped" >&2
fi

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j"$(nproc)" --target bench_alloc
"$build/tools/bench_alloc" --json "$build/bench.json" "$@"
