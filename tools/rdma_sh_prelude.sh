#!/usr/bin/env bash
# What every rdma_sh_test script (tools/rdma_test.bzl) begins with: the macro
# writes this file in front of the script, so that the checks the smoke tests
# share live in one place and travel with the copy the VM runs. It refuses to
# run without an RDMA address, sets `fail` to 0, and defines:
#
#   out=$(run_or_fail "what" CMD ARGS...) || exit 1
#   expect_figures "$out" NAME...        # each "NAME VALUE" line is positive
#   counter "reads=" "$out"              # a value of the counters line
#   expect "what" "$got" -ge 400         # a number, compared
#
# A check that fails prints "FAIL: ..." and sets fail=1; the script ends
# with `exit $fail`.
if [ -z "${RDMARPC_TEST_ADDR:-}" ]; then
  echo "FAIL: no RDMA address: this test needs verbs; run it with make test (tools/vm/run.sh)"
  exit 1
fi
fail=0

# CMD's output, stdout and stderr together. When it exits non-zero, the
# output and a FAIL line naming `what` go to stderr instead (shown even when
# the caller captures stdout), and the status is 1.
run_or_fail() {
  local what=$1 output
  shift
  output=$("$@" 2>&1) || {
    echo "$output" >&2
    echo "FAIL: $what exited non-zero" >&2
    return 1
  }
  echo "$output"
}

# Benchmarks print their figures as "NAME VALUE" lines: each NAME's must be a
# positive number.
expect_figures() {
  local output=$1 figure value
  shift
  for figure in "$@"; do
    value=$(awk -v k="$figure" '$1 == k {print $2}' <<<"$output")
    if ! awk -v v="${value:-x}" 'BEGIN {exit !(v + 0 > 0)}'; then
      echo "FAIL: $figure is '${value}', not a positive number"
      fail=1
    fi
  done
}

# The value after KEY on the transport's counters line, as the benchmarks
# ("counters sends=1 (inline 1, ...") and the demo ("rdma counters: ...")
# print it. KEY ends with its separator ("sends=", "inline ", "in place "),
# which tells "reads=" from "(behind reads 0)".
counter() {
  sed -nE "s/^(rdma )?counters:? (.*[ (])?$1([0-9]+).*/\3/p" <<<"$2"
}

# WHAT, the value got (a missing or non-numeric one fails), a test(1)
# comparison and its bound.
expect() {
  if ! [[ "$2" =~ ^[0-9]+$ ]] || ! test "$2" "$3" "$4"; then
    echo "FAIL: $1 is ${2:-missing}, expected $3 $4"
    fail=1
  fi
}
