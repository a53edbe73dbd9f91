#!/usr/bin/env bash
# The main job (`make demo`, examples/echo_demo) run with small counts in the
# Soft-RoCE VM: it must name the device each end uses, find the service
# SERVING through the health service, time every kind of call, and its
# counters must show small calls by SEND into the SRQ and the 1 MiB ones by
# READ. --poll reaches the transports through the runtime's options: busy
# callers take their own completions, event ones never do. A server on
# 0.0.0.0 is reached at the address it gives.
# Speed is not checked here (bench/run_bench.sh measures it).
# (tools/rdma_sh_prelude.sh comes before this.)
set -euo pipefail
demo=$1
unset RDMARPC_RDMA_POLL
run() {  # poll mode, then the flags that differ
  run_or_fail "echo_demo --poll $1" "$demo" --small_calls 200 --large_calls 4 \
    --attachment_calls 4 --poll "$@"
}

busy=$(run busy) || exit 1
echo "$busy"
for who in server "channel rdma://"; do
  echo "$busy" | grep -q "^rdmarpc\[$who.*\]: RDMA device .* port [0-9]* gid_index [0-9]*" || {
    echo "FAIL: no line naming the device, port and GID the $who uses"
    fail=1
  }
done
for kind in small large attach; do
  echo "$busy" | grep -qE "^$kind +[0-9]+ calls of +[0-9]+ bytes: p50 [0-9.]+ us" || {
    echo "FAIL: no latency line for the $kind calls"
    fail=1
  }
done
# 200 small calls send request and response in place, into the SRQ; 4 large
# and 4 attachment calls each READ a 1 MiB request and response.
expect "SENDs written in place" "$(counter "in place " "$busy")" -ge 400
expect "SRQ slots consumed" "$(counter srq_consumed= "$busy")" -ge 400
expect "READs" "$(counter reads= "$busy")" -ge 16
expect "bytes READ" "$(counter bytes_read= "$busy")" -ge $((16 << 20))
expect "server calls of Say" \
  "$(echo "$busy" | sed -nE 's|^server calls: /rdmarpc.examples.Echo/Say ([0-9]+)$|\1|p')" -eq 208
expect "connect attempts before the first call" \
  "$(echo "$busy" | sed -nE 's|^channel connected to rdma://[^ ]+ in [0-9.]+ ms \(connect attempts: ([0-9]+)\)$|\1|p')" -eq 1
echo "$busy" | grep -qE "^health of rdmarpc.examples.Echo at rdma://[^ ]+: SERVING$" || {
  echo "FAIL: no line saying the health service answered SERVING"
  fail=1
}
expect "server calls of Health/Check" \
  "$(echo "$busy" | sed -nE 's|^server calls: /rdmarpc.health.v1.Health/Check ([0-9]+)$|\1|p')" -eq 1
expect "busy mode's caller completions" "$(counter caller_completions= "$busy")" -gt 0

# Also: a kind of call counted 0 is left out, the others still timed; and a
# server on the unspecified address is reached over RDMA at the address it
# gives.
event=$(run event --large_calls 0 --address rdma://0.0.0.0:0) || exit 1
echo "$event" | grep -qE "^channel connected to rdma://0\.0\.0\.0:[0-9]+ in " || {
  echo "FAIL: the client did not connect to the server on 0.0.0.0"
  fail=1
}
expect "SRQ slots consumed on 0.0.0.0" "$(counter srq_consumed= "$event")" -ge 400
expect "event mode's caller completions" "$(counter caller_completions= "$event")" -eq 0
expect "event mode's poller sleeps" "$(counter poller_sleeps= "$event")" -gt 0
echo "$event" | grep -qE "^large +no calls$" || {
  echo "FAIL: --large_calls 0 did not leave the large calls out"
  fail=1
}
echo "$event" | grep -qE "^attach +4 calls of +[0-9]+ bytes: p50 [0-9.]+ us" || {
  echo "FAIL: no latency line for the attachment calls after --large_calls 0"
  fail=1
}

if bad=$("$demo" --small_calls -1 2>&1); then
  echo "FAIL: --small_calls -1 was taken"
  fail=1
elif ! echo "$bad" | grep -q "a count of calls"; then
  echo "FAIL: --small_calls -1 refused without saying why: $bad"
  fail=1
fi
if bad=$("$demo" --small_calls 1 --poll sometimes 2>&1); then
  echo "FAIL: --poll sometimes was taken"
  fail=1
elif ! echo "$bad" | grep -q "not adaptive, busy or event"; then
  echo "FAIL: --poll sometimes refused without saying why: $bad"
  fail=1
fi
[ "$fail" = 0 ] && echo "PASS: device named, health SERVING, every kind of call timed, small calls by SEND into the SRQ, large by READ, --poll obeyed, 0.0.0.0 reached"
exit $fail
