#!/usr/bin/env bash
# The instructions per KV call (docs/benchmarks.md, "Cost of the KV call latencies and peaks"),
# from callgrind: tools/experiments/kv_call_cost at 2,000 and 4,000 rounds; the difference of
# the two leaves out the cache's creation. tools/run_kv_call_cost.sh [LIBRARY.a ...]: one column
# per static library given (default: build/libkvalloc.a), the program built against each.
set -euo pipefail
cd "$(dirname "$0")/.."
libs=("$@")
[ ${#libs[@]} -gt 0 ] || { cmake --build build --target kvalloc_static -j >/dev/null; libs=(build/libkvalloc.a); }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in "${!libs[@]}"; do
  cc -O2 -std=c11 -I libkvalloc/include tools/experiments/kv_call_cost.c "${libs[$i]}" -lpthread -ldl \
     -o "$work/kv_call_cost.$i"
done
count() { valgrind --tool=callgrind --callgrind-out-file=/dev/null "$@" 2>&1 |
          awk '/refs/ {gsub(",", "", $4); print $4}'; }
printf "%-11s" pattern; for lib in "${libs[@]}"; do printf " %28s" "$lib"; done; echo
for pattern in ${KV_CALL_PATTERNS:-alloc_free append hit lookup commit pin}; do
  printf "%-11s" "$pattern"
  for i in "${!libs[@]}"; do
    per=$(( $(count "$work/kv_call_cost.$i" "$pattern" 4000) - $(count "$work/kv_call_cost.$i" "$pattern" 2000) ))
    awk -v p="$per" 'BEGIN { printf " %24.1f /op", p / 2000 }'
  done
  echo
done
