#!/usr/bin/env bash
# format.sh — the C sources in the style the .clang-format files describe (the top one; tools/
# has its own), with Debian's clang-format (scripts/ensure-system-deps.sh installs it).
#
#     scripts/format.sh           rewrites every file that is not formatted
#     scripts/format.sh --check   changes nothing: lists the files that are not formatted and
#                                 exits 1 if there is any
#
# The files: every *.c and *.h under libkvalloc/, tests/ and tools/ that git tracks or would
# track (new files count, ignored ones do not).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

check=0
case "${1:-}" in
  --check) check=1 ;;
  "") ;;
  *) echo "usage: scripts/format.sh [--check]" >&2; exit 2 ;;
esac

command -v clang-format >/dev/null || scripts/ensure-system-deps.sh
mapfile -t files < <(git ls-files --cached --others --exclude-standard -- \
  'libkvalloc/*.c' 'libkvalloc/*.h' 'tests/*.c' 'tests/*.h' 'tools/*.c' 'tools/*.h')

if [ "$check" = 0 ]; then
  [ ${#files[@]} -eq 0 ] || clang-format -i --style=file -- "${files[@]}"
  exit 0
fi

unformatted=0
for f in "${files[@]}"; do
  if ! clang-format --dry-run --Werror --style=file -- "$f" >/dev/null 2>&1; then
    echo "$f"
    unformatted=1
  fi
done
if [ "$unformatted" = 1 ]; then
  echo "format.sh: the files above are not formatted; scripts/format.sh rewrites them" >&2
fi
exit "$unformatted"
