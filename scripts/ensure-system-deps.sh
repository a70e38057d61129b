#!/usr/bin/env bash
# Installs the system packages the build and the tests need, when they are missing and we may
# (root, apt-get present). A fresh machine has python3, gcc, cmake and make (it runs this script);
# this adds the rest.
set -euo pipefail
missing=()
command -v pkg-config >/dev/null || missing+=(pkg-config)
command -v strace >/dev/null || missing+=(strace)   # the no-system-call test
command -v clang-format >/dev/null || missing+=(clang-format)   # scripts/format.sh
command -v tmux >/dev/null || missing+=(tmux)   # kvalloc top in a real terminal (test_top_terminal.py)
# The replay's jemalloc baseline (tests/python/test_replay_sim.py); small, the runtime only.
# ldconfig lives in /sbin, outside a user's PATH on Debian; grep reads the whole list (grep -q
# would stop at the match, and with pipefail the writer's SIGPIPE would read as "missing").
ldconfig=$(command -v ldconfig || echo /sbin/ldconfig)
"$ldconfig" -p 2>/dev/null | grep 'libjemalloc\.so\.2 ' >/dev/null || missing+=(libjemalloc2)
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
# A real Prometheus server scrapes `kvalloc export` in tests/python/test_prometheus.py. Installed
# without its recommended node exporter, which nothing here uses.
lean=()
command -v prometheus >/dev/null || lean+=(prometheus)
# `ensure-system-deps.sh fuzz`: the fuzzer needs clang and its libFuzzer runtime, which Debian
# packages apart (libclang-rt-<version>-dev, only recommended by clang).
if [ "${1:-}" = fuzz ]; then
  if ! command -v clang >/dev/null; then
    missing+=(clang)
  elif ! echo 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; return (int)n * 0; }' |
      clang -fsanitize=fuzzer -x c - -o /dev/null 2>/dev/null; then
    missing+=("libclang-rt-$(clang -dumpversion | cut -d. -f1)-dev")
  fi
fi
[ ${#missing[@]} -eq 0 ] && [ ${#lean[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing: ${missing[*]} ${lean[*]}"
  apt-get update -qq
  [ ${#missing[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  [ ${#lean[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${lean[@]}" >/dev/null
elif [ ${#missing[@]} -ne 0 ]; then
  echo "missing system packages: ${missing[*]} (install them, or run as root with apt-get)" >&2
  exit 1
else
  # Only what one test uses is missing: that test says so and skips.
  echo "missing system packages: ${lean[*]} (tests/python/test_prometheus.py will skip)" >&2
fi
