#!/usr/bin/env bash
# Called once by `bazel coverage --combined_report=lcov`: concatenates the
# per-test reports listed in --reports_file into --output_file.
set -euo pipefail
reports="" out=""
for arg in "$@"; do
  case "$arg" in
    --reports_file=*) reports="${arg#*=}" ;;
    --output_file=*) out="${arg#*=}" ;;
  esac
done
[ -n "$out" ] && [ -n "$reports" ] || { echo "coverage_report_generator: missing flags" >&2; exit 2; }
: > "$out"
while read -r f; do
  [ -s "$f" ] && cat "$f" >> "$out"
done < "$reports"
