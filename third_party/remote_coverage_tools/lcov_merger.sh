#!/usr/bin/env bash
# Called per test by Bazel's collect_coverage.sh: merges that test's lcov files.
set -euo pipefail
dir="" out=""
for arg in "$@"; do
  case "$arg" in
    --coverage_dir=*) dir="${arg#*=}" ;;
    --output_file=*) out="${arg#*=}" ;;
  esac
done
[ -n "$out" ] || { echo "lcov_merger: --output_file missing" >&2; exit 2; }
: > "$out"
if [ -n "$dir" ] && [ -d "$dir" ]; then
  find "$dir" -name '*.dat' -o -name '*.info' | sort | while read -r f; do
    [ "$f" = "$out" ] || cat "$f" >> "$out"
  done
fi
