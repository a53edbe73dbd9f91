#!/usr/bin/env bash
# Line coverage of the project's own code by its tests, to find what no test
# reaches (error paths above all). Not part of CI: it rebuilds everything
# with gcov instrumentation in an output base of its own (the usual build and
# its cache stay as they are), runs each RDMA test in a boot of its own of
# the Soft-RoCE VM (or on this machine's device) and the host tests with Bazel,
# then prints each file's line coverage and writes every line no test ran to
# .cache/coverage/uncovered.txt.
#
#   tools/coverage.sh             everything (~20 min on 2 cores)
#   tools/coverage.sh --host      host tests only (no VM)
#   tools/coverage.sh --report    the report again, from the last run's counts
#
# `bazel coverage` gives empty reports with Debian's Bazel 4 and gcc 12, hence
# this. A two-VM test runs in two VMs, as `make test` runs it, and both
# guests' counts count: some paths only a peer on another machine takes.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-all}
out=$PWD/.cache/coverage
# Not under /tmp: the VM has its own /tmp, and must see the test binaries.
base=${RDMARPC_COVERAGE_BASE:-$HOME/.cache/bazel/rdmarpc-coverage}
# No bazel-* links: they would point the usual build's at this output base.
gcov_flags=(--spawn_strategy=local --copt=--coverage --copt=-O0 --linkopt=--coverage
  --symlink_prefix=/)
bz() { bazel --output_base="$base" "$@"; }
# Not //...: that would walk the usual build's bazel-* links, which this
# output base does not know as its own.
targets=(//:all)
for d in */; do
  case "$d" in bazel-*) continue ;; esac
  [ ! -f "$d/BUILD" ] || targets+=("//${d%/}/...")
done

# Every test writes its counts under $counts (GCOV_PREFIX; libgcov adds to
# what is there): objects name their counts /proc/self/cwd/bazel-out/...,
# relative to whichever directory the test runs in.
counts=$out/counts
if [ "$mode" != --report ]; then
  tools/deps.sh
  bz build "${gcov_flags[@]}" "${targets[@]}"
  bin=$(bz info "${gcov_flags[@]}" bazel-bin)
  rm -rf "$counts"
  mkdir -p "$counts"
  if [ "$mode" != --host ]; then
    # Each RDMA test in a boot of its own, as `make test` runs them: some
    # leave the boot unusable for the tests after them (device_events_test
    # takes the link down, and Soft-RoCE then makes no new connection;
    # device_removed_test deletes the device). A boot's counts come back in
    # a directory of its own; gcov-tool adds them up afterwards.
    universe=${targets[0]}
    for t in "${targets[@]:1}"; do universe+=" + $t"; done
    rdma="attr(tags, '[\[ ]rdma[,\]]', $universe)"
    two="attr(tags, '[\[ ]rdma_two_vms[,\]]', $universe)"
    two_vm_tests=" $(bz query "kind(test, $two)" 2>/dev/null | tr '\n' ' ') "
    boots=$out/boots
    rm -rf "$boots"
    mkdir -p "$boots"
    export RDMARPC_VM_DIR=${RDMARPC_VM_DIR:-$PWD/.cache/vm}
    n=0
    for t in $(bz query "kind(test, $rdma + $two)" 2>/dev/null); do
      vms=1
      [[ $two_vm_tests != *" $t "* ]] || vms=2
      dir=$boots/$(printf '%02d' "$n")
      n=$((n + 1))
      # What `bazel test` would run, its arguments and environment included.
      if ! bz run "${gcov_flags[@]}" --script_path="$dir.sh" "$t" >"$dir.log" 2>&1; then
        echo "coverage: $t: no script to run it (bazel run --script_path; $dir.log)" >&2
        continue
      fi
      echo "coverage: $t (${dir##*/})"
      RDMARPC_VM_KEEP=$dir tools/vm/run.sh --vms "$vms" bash -c \
        '[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd  # Bazel'"'"'s test wrapper uses it
         export GCOV_PREFIX=$RDMARPC_VM_OUT GCOV_PREFIX_STRIP=3; exec bash "$0"' "$dir.sh" ||
        echo "coverage: $t failed (its counts still count)" >&2
      kept=("$dir")
      if [ "$vms" = 2 ]; then
        # run.sh keeps each guest's files under its role: added up as two
        # boots' counts are.
        kept=()
        for role in server client; do
          [ ! -d "$dir/$role" ] || mv "$dir/$role" "$dir-$role"
          kept+=("$dir-$role")
        done
        rm -rf "$dir"
      fi
      for k in "${kept[@]}"; do
        [ -n "$(find "$k" -name '*.gcda' -print -quit 2>/dev/null)" ] ||
          echo "coverage: $t left no counts (${k##*/})" >&2
      done
    done
    merged=$boots/merged
    for dir in "$boots"/[0-9]*/; do
      dir=${dir%/}
      if [ -z "$(find "$dir" -name '*.gcda' -print -quit)" ]; then
        continue  # gcov-tool refuses a directory without counts
      elif [ ! -d "$merged" ]; then
        cp -a "$dir" "$merged"
      else
        gcov-tool merge -o "$merged.next" "$merged" "$dir" >/dev/null
        rm -rf "$merged" && mv "$merged.next" "$merged"
      fi
    done
    [ ! -d "$merged" ] || cp -a "$merged/." "$counts/"
  fi
  bz test "${gcov_flags[@]}" --nocache_test_results --test_tag_filters=-rdma,-rdma_two_vms \
    --test_env=GCOV_PREFIX="$counts" --test_env=GCOV_PREFIX_STRIP=3 "${targets[@]}" \
    || echo "coverage: a host test failed (its counts still count)" >&2
  # The protoc plugin runs while Bazel builds, uninstrumented: run the
  # instrumented one over every .proto here (some are refused on purpose).
  gen=$(mktemp -d)
  for proto in $(git ls-files '*.proto'); do
    GCOV_PREFIX=$counts GCOV_PREFIX_STRIP=3 protoc -I. --plugin=protoc-gen-rdmarpc="$bin/codegen/protoc-gen-rdmarpc" \
      --rdmarpc_out="$gen" "$proto" 2>/dev/null || true
  done
  rm -rf "$gen"
fi
execroot=$(bz info "${gcov_flags[@]}" execution_root)
# gcov wants the counts beside the objects' notes.
find "$execroot/bazel-out" -name '*.gcda' -delete
(cd "$counts" && find . -name '*.gcda' -exec cp --parents {} "$execroot/" \;)
python3 tools/coverage_report.py "$execroot" "$out/uncovered.txt"
