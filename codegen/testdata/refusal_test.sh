#!/usr/bin/env bash
# protoc-gen-rdmarpc must refuse what it cannot generate correctly, with an
# error that names the file, the service and the method.
set -uo pipefail
protoc=$1
plugin=$2
out=$(mktemp -d)
failures=0

expect_refusal() {  # proto, then strings the error must contain
  local proto=$1; shift
  local err
  if err=$("$protoc" --plugin=protoc-gen-rdmarpc="$plugin" --rdmarpc_out="${options:-}$out" \
        "codegen/testdata/$proto" 2>&1); then
    echo "FAIL: $proto was accepted${options:+ with options $options}"
    failures=$((failures + 1)); return
  fi
  for want in "$@"; do
    if [[ "$err" != *"$want"* ]]; then
      echo "FAIL: $proto: error lacks '$want': $err"; failures=$((failures + 1)); return
    fi
  done
  echo "ok: $proto refused: $err"
}

expect_refusal streaming.proto "codegen/testdata/streaming.proto:" \
  "rdmarpc.codegen_test.streaming.Streamer" "Upload" "streaming"
expect_refusal collision.proto "/rdmarpc.codegen.collide.S/M379bb" \
  "/rdmarpc.codegen.collide.S/M74848" "same method id"
expect_refusal keyword_package.proto "keyword_package.proto" "'public'" "Rename the package"
# Options (grpc's plugin takes some) would be ignored silently.
options="generate_mock_code=true:" expect_refusal names.proto \
  "protoc-gen-rdmarpc takes no options, got 'generate_mock_code=true'"

if [ -n "$(ls -A "$out")" ]; then
  echo "FAIL: refused files left output: $(find "$out" -type f)"; failures=$((failures + 1))
fi
[ "$failures" = 0 ] && echo "PASS" || { echo "$failures failure(s)"; exit 1; }
