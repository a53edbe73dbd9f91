#!/usr/bin/env bash
# Builds examples/consumer, a workspace that uses rdmarpc as @rdmarpc the way
# README.md tells a user to ("Using rdmarpc from your own workspace"), with a
# Bazel server of its own, then runs its program: a Greeter served and called
# over TCP. Fails if a label of rdmarpc's only resolves inside rdmarpc's own
# workspace, or if the README's setup is not enough.
#
# $1: rdmarpc's WORKSPACE file. A local test (no sandbox): its runfile links
# back into the checkout, where the consumer workspace lies.
set -euo pipefail
root=$(dirname "$(readlink -f "$1")")
output_base=$(mktemp -d /tmp/rdmarpc-consumer.XXXXXX)
cleanup() {
  (cd "$root/examples/consumer" && bazel --output_base="$output_base" shutdown) >/dev/null 2>&1 || true
  rm -rf "$output_base"
}
trap cleanup EXIT
cd "$root/examples/consumer"
echo "building $PWD (output base $output_base)"
bazel --output_base="$output_base" run --symlink_prefix=/ --noshow_progress //:greeter
