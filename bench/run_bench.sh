#!/usr/bin/env bash
# rdmarpc against perftest, in one boot of the Soft-RoCE VM (or on this
# machine's RDMA device): the two figures of the RDMA transport issue and
# their ratios.
#
#   bench/run_bench.sh          (builds, then runs itself under tools/vm/run.sh)
#
# Targets: small-call RTT p50 <= 1.15 x (2 x ib_send_lat typical), busy-poll;
#          1 MiB request bandwidth >= 0.95 x ib_read_bw (1 MiB), default mode.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${RDMARPC_VM_ROLE:-}" ]; then
  bazel build -c opt //bench:rpc_bench //transport/rdma:pingpong_probe
  export RDMARPC_VM_DIR=${RDMARPC_VM_DIR:-$PWD/.cache/vm}
  exec tools/vm/run.sh bench/run_bench.sh
fi
ip=$RDMARPC_TEST_ADDR
dev=$(rdma link show | awk '/state ACTIVE/ {split($2, a, "/"); print a[1]; exit}')
echo "bench: device $dev, address $ip"

# perftest sends what one small call puts on the wire: 64 B header + the
# 66 B serialized request of rpc_bench's Ping.
frame=130
ib_send_lat -d "$dev" -R -n 5000 -s $frame >/dev/null 2>&1 &
sleep 1
send_lat=$(ib_send_lat -d "$dev" -R -n 5000 -s $frame "$ip" 2>/dev/null | awk -v f=$frame '$1 == f {print $5}')
wait
ib_read_bw -d "$dev" -R -s 1048576 -n 200 >/dev/null 2>&1 &
sleep 1
read_bw=$(ib_read_bw -d "$dev" -R -s 1048576 -n 200 "$ip" 2>/dev/null | awk '/^ *1048576 /{print $4}')
wait
echo "perftest: ib_send_lat $frame B typical ${send_lat} us one-way; ib_read_bw 1 MiB ${read_bw} MB/s"

# The same ping-pong as ib_send_lat, bare and with a little user code between
# round trips: under an emulator the second is much slower than the code
# alone explains, which bounds what any RPC layer can reach here.
probe=$(bazel-bin/transport/rdma/pingpong_probe --address "$ip" --size $frame)
echo "$probe"

# Latency in busy-poll mode (the target's terms); bandwidth in the default
# adaptive mode: with two cores, spinning pollers would take the CPU that the
# kernel's READ processing and the protobuf copies need.
out=$(RDMARPC_RDMA_POLL=busy bazel-bin/bench/rpc_bench --pulls 0 2>&1)
out="$out
$(bazel-bin/bench/rpc_bench --pings 0 --pulls 200 2>&1)"
echo "$out" | grep -v "RDMA device"
rtt=$(echo "$out" | awk '/^rpc_small_rtt_p50_us/{print $2}')
trtt=$(echo "$out" | awk '/^transport_rtt_p50_us/{print $2}')
bw=$(echo "$out" | awk '/^rpc_pull_1mib_mib_per_s/{print $2}')
p_bare=$(echo "$probe" | awk '/^probe_bare_rtt_p50_us/{print $2}')
p_code=$(echo "$probe" | awk '/^probe_user_code_us/{print $2}')
p_after=$(echo "$probe" | awk '/^probe_rtt_after_user_code_p50_us/{print $2}')
awk -v b="$p_bare" -v c="$p_code" -v a="$p_after" 'BEGIN {
  printf "probe: bare verbs RTT %.1f us; after %.1f us of user code %.1f us: +%.1f us that the code does not explain\n", b, c, a, a - b;
}'
awk -v rtt="$rtt" -v trtt="$trtt" -v lat="$send_lat" -v bw="$bw" -v rbw="$read_bw" 'BEGIN {
  r1 = rtt / (2 * lat); r2 = (bw * 1048576 / 1e6) / rbw;
  printf "ratio transport frame RTT / (2 x ib_send_lat) = %.2f\n", trtt / (2 * lat);
  printf "ratio small-call RTT / (2 x ib_send_lat) = %.2f (target <= 1.15)\n", r1;
  printf "ratio 1 MiB pull bandwidth / ib_read_bw  = %.2f (target >= 0.95)\n", r2;
}'
