#!/usr/bin/env bash
# The instructions a named pool's statistics segment adds per operation (docs/benchmarks.md),
# from callgrind: each pattern at 200 and at 400 rounds, anonymous and named; the difference of
# the two run lengths leaves out the fixed cost of creating the pool and its segment.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVA_BUILD_DIR:-build}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" --target bench_publish -j >/dev/null
count() { valgrind --tool=callgrind --callgrind-out-file=/dev/null "$build/tools/bench_publish" "$@" 2>&1 |
          awk '/refs/ {gsub(",", "", $4); print $4}'; }
printf "%-8s %14s %14s %8s\n" pattern anonymous named added
for pattern in batch64 batch4k large; do
  ops=$([ "$pattern" = large ] && echo 16 || echo 2000)
  for named in 0 1; do
    per[$named]=$(( ($(count $pattern $named 400) - $(count $pattern $named 200)) / 200 ))
  done
  awk -v p=$pattern -v a=${per[0]} -v n=${per[1]} -v ops=$ops \
      'BEGIN { printf "%-8s %11.1f/op %11.1f/op %7.2f%%\n", p, a/ops, n/ops, 100*(n-a)/a }'
done
