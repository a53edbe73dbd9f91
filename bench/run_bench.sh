#!/usr/bin/env bash
# rdmarpc against perftest, in one boot of the Soft-RoCE VM (or on this
# machine's RDMA device): the two figures of the RDMA transport issue and
# their ratios.
#
#   bench/run_bench.sh          (builds, then runs itself under tools/vm/run.sh)
#
# Targets: small-call RTT p50 <= 1.15 x (2 x ib_send_lat typical), busy-poll;
#          1 MiB request bandwidth >= 0.95 x ib_read_bw (1 MiB), busy-poll
#          like perftest (the default mode printed beside it); measured with
#          the 1 MiB in a protobuf bytes field and as an attachment
#          (rpc/attachment.h), which protobuf does not copy.
# Besides, the rate of medium calls (1 KiB each way, too large to go inline,
# 16 in flight) against ib_send_bw's message rate at the same frame size: a
# call is two SENDs, so the ratio is the call's SENDs per second over
# perftest's.
# The peer framework measured beside them is UCX (ucx_perftest: tag_lat, the
# eager SEND path of a whole messaging stack, and ucp_get, an RDMA READ).
# Last, gRPC beside rdmarpc's tcp:// and rdma:// (bench/grpc_bench.cc): the
# RPC framework our users know, with the same service and calls.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${RDMARPC_VM_ROLE:-}" ]; then
  tools/deps.sh --bench
  bazel build -c opt //bench:rpc_bench //bench:grpc_bench //transport/rdma:pingpong_probe
  export RDMARPC_VM_DIR=${RDMARPC_VM_DIR:-$PWD/.cache/vm}
  exec tools/vm/run.sh bench/run_bench.sh
fi
ip=$RDMARPC_TEST_ADDR
dev=$(rdma link show | awk '/state ACTIVE/ {split($2, a, "/"); print a[1]; exit}')
rounds=${RDMARPC_BENCH_ROUNDS:-3}
echo "bench: device $dev, address $ip, $rounds rounds"

# perftest sends what one small call puts on the wire: 64 B header + the
# 66 B serialized request of rpc_bench's Ping.
frame=130
# Every run is bounded: a perftest or UCX pair whose client never reaches
# its server (seen once under a loaded host) would otherwise wait forever.
# A figure that did not come costs its round, which says which one.
bounded() { timeout 120 "$@"; }
send_lat() {
  bounded ib_send_lat -d "$dev" -R -n 5000 -s $frame >/dev/null 2>&1 &
  sleep 1
  bounded ib_send_lat -d "$dev" -R -n 5000 -s $frame "$ip" 2>/dev/null | awk -v f=$frame '$1 == f {print $5}'
  wait || true
}
# perftest's "MB/sec" is 2^20 bytes per second (its format_factor is
# 0x100000), the same unit as rpc_bench's MiB/s.
# Also prints the machine's softirq time per MiB during the run (rxe's
# packet work), comparable with rpc_bench's *_softirq_ms_per_mib.
softirq_s() { awk -v hz="$(getconf CLK_TCK)" '$1 == "cpu" {print $8 / hz}' /proc/stat; }
read_bw() {
  bounded ib_read_bw -d "$dev" -R -s 1048576 -n 200 >/dev/null 2>&1 &
  sleep 1
  local before; before=$(softirq_s)
  local bw; bw=$(bounded ib_read_bw -d "$dev" -R -s 1048576 -n 200 "$ip" 2>/dev/null | awk '/^ *1048576 /{print $4}')
  echo "${bw:-none} $(awk -v a="$before" -v b="$(softirq_s)" 'BEGIN {printf "%.2f", (b - a) * 1e3 / 200}')"
  wait || true
}
# UCX over the same device and verbs (rc_verbs); on Soft-RoCE it needs the
# GID named (../shared/notes/softroce-vm.md). ucx_perftest prints one-way
# latency like perftest and MB/s of 2^20 bytes.
ucx_env=(UCX_NET_DEVICES="$dev:1")
case $dev in rxe*) ucx_env+=(UCX_TLS=rc_verbs,ud_verbs:aux,self UCX_IB_GID_INDEX=0) ;; esac
ucx() {  # test size iterations column-of-Final
  bounded env "${ucx_env[@]}" ucx_perftest -t "$1" -s "$2" -n "$3" >/dev/null 2>&1 &
  sleep 2
  bounded env "${ucx_env[@]}" ucx_perftest "$ip" -t "$1" -s "$2" -n "$3" 2>/dev/null | awk -v c="$4" '$1 == "Final:" {print $c}'
  wait || true
}
# A medium call's frame: the 64 B header and its 1027 B serialized request.
medium_frame=1091
send_rate() {  # messages per second, 16 in flight like the medium calls
  bounded ib_send_bw -d "$dev" -R -s $medium_frame -n 20000 -t 16 >/dev/null 2>&1 &
  sleep 1
  bounded ib_send_bw -d "$dev" -R -s $medium_frame -n 20000 -t 16 "$ip" 2>/dev/null |
    awk -v f=$medium_frame '$1 == f {printf "%.0f\n", $5 * 1e6}'
  wait || true
}
medium_calls() {  # callback threads
  RDMARPC_RDMA_POLL=busy timeout 300 bazel-bin/bench/rpc_bench --pings 0 --pulls 0 --workers 0 \
    --medium_calls 20000 --medium_bytes 1024 --medium_in_flight 16 --callback_threads "$1" 2>&1 |
    awk '$1 == "rpc_medium_1024b_calls_per_s" {print $2}'
}
field() { echo "$1" | awk -v k="$2" '$1 == k {print $2}'; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }

# The same ping-pong as ib_send_lat, bare, with a little user code between
# round trips, and with a spin as long as that code: under an emulator the
# round trip after the code is slower than after the spin (by far more in
# the machine's slow spells), which bounds what any RPC layer can reach here.
probe=$(bazel-bin/transport/rdma/pingpong_probe --address "$ip" --size $frame)
awk -v b="$(field "$probe" probe_bare_rtt_p50_us)" -v c="$(field "$probe" probe_user_code_us)" \
    -v a="$(field "$probe" probe_rtt_after_user_code_p50_us)" \
    -v p="$(field "$probe" probe_rtt_after_spin_p50_us)" 'BEGIN {
  printf "probe: bare verbs RTT %.1f us; after %.1f us of user code %.1f us (+%.1f us that the code does not explain); after spinning as long %.1f us (+%.1f)\n", b, c, a, a - b, p, p - b;
}'

# Each round measures perftest, UCX and rdmarpc back to back, so a slow spell
# of the machine hits all three; the ratios reported are the medians over rounds.
# Within a round perftest runs right before and right after rdmarpc and counts
# with the mean of the two: the emulated machine drifts over tens of seconds
# (the same binary's round trip moved up to 2x within one boot), and a drift that
# is steady over the three runs cancels out of the ratio.
# Both figures are taken as perftest takes its own: busy-poll mode (the
# latency target's terms) with handlers inline on the I/O thread
# (SetWorkerThreads(0)). The attachment pull is also measured with the
# defaults (adaptive poll, one worker per core), what an untuned server gets:
# under Soft-RoCE, while the pollers sleep between READs the kernel's packet
# work is split between the two vCPUs (beside a spinning poller it stays on
# the other one) and runs ~3-4 % slower (bench/RESULTS.md). The small
# call's figure reuses its response message, as perftest reuses its buffers;
# the same calls with a fresh message each are printed beside it.
# Besides, each round times small calls against a bare verbs ping-pong in
# one process, in blocks that take turns (rpc_bench --interleaved_blocks):
# the spells of the emulated machine last tenths of a second, so only such
# pairs share theirs. The pollers are adaptive there (busy ones would leave
# the ping-pong no CPU), and the ping-pong is our own, not perftest.
ratios=""
raws=""
interleaved=""
medium=""
for round in $(seq 1 "$rounds"); do
  ulat=$(ucx tag_lat $frame 5000 3)
  lat_before=$(send_lat)
  ping=$(RDMARPC_RDMA_POLL=busy timeout 300 bazel-bin/bench/rpc_bench --pulls 0 --workers 0 2>&1 || true)
  lat_after=$(send_lat)
  inter=$(timeout 300 bazel-bin/bench/rpc_bench --pings 0 --pulls 0 --workers 0 \
    --interleaved_blocks 8 2>&1 || true)
  lat=$(awk -v a="$lat_before" -v b="$lat_after" 'BEGIN {print (a + b) / 2}')
  ubw=$(ucx ucp_get 1048576 200 7)
  set -- $(read_bw)
  rbw_before=$1 rsi=$2
  pull=$(RDMARPC_RDMA_POLL=busy timeout 300 bazel-bin/bench/rpc_bench --pings 0 --pulls 200 --workers 0 2>&1 || true)
  dpull=$(timeout 300 bazel-bin/bench/rpc_bench --pings 0 --pulls 200 2>&1 || true)
  set -- $(read_bw)
  rbw_after=$1
  rbw=$(awk -v a="$rbw_before" -v b="$rbw_after" 'BEGIN {print (a + b) / 2}')
  if [ "$round" = 1 ]; then echo "$ping
$pull" | grep "^counters" || true; fi
  trtt=$(field "$ping" transport_rtt_p50_us)
  rtt=$(field "$ping" rpc_small_rtt_p50_us)
  frtt=$(field "$ping" rpc_small_fresh_response_rtt_p50_us)
  tbw=$(field "$pull" transport_pull_1mib_mib_per_s)
  bw=$(field "$pull" rpc_pull_1mib_mib_per_s)
  abw=$(field "$pull" rpc_pull_attachment_1mib_mib_per_s)
  dabw=$(field "$dpull" rpc_pull_attachment_1mib_mib_per_s)
  missing=""
  for f in ulat:"$ulat" lat_before:"$lat_before" lat_after:"$lat_after" ucp_get:"$ubw" \
           ib_read_bw_before:"$rbw_before" ib_read_bw_after:"$rbw_after" frame_rtt:"$trtt" \
           call_rtt:"$rtt" fresh_response_call_rtt:"$frtt" transport_pull:"$tbw" call_pull:"$bw" attachment_pull:"$abw" default_mode_attachment_pull:"$dabw"; do
    # Not a plain number: no figure came, or one that means none (perftest
    # has printed "inf" for its latency; rpc_bench prints -1).
    [[ ${f#*:} =~ ^[0-9]+(\.[0-9]+)?$ ]] || missing="$missing ${f%%:*}"
  done
  if [ -n "$missing" ]; then
    echo "round $round: skipped, no figure from:$missing"
    # rpc_bench's own words (a failed call's status), if any; not its figures.
    echo "$ping
$pull
$dpull" | grep -v -E '^[a-z0-9_]+ -?[0-9.]+$|^counters |RDMA device' | sed "s/^/round $round: /" || true
    continue
  fi
  echo "round $round: softirq ms per MiB (Soft-RoCE's packet work): ib_read_bw $rsi," \
       "transport pull $(field "$pull" transport_pull_softirq_ms_per_mib)," \
       "call pull $(field "$pull" rpc_pull_softirq_ms_per_mib)," \
       "attachment pull $(field "$pull" rpc_attachment_pull_softirq_ms_per_mib)," \
       "attachment pull in the default mode $(field "$dpull" rpc_attachment_pull_softirq_ms_per_mib)"
  line=$(awk -v lat="$lat" -v lb="$lat_before" -v la="$lat_after" -v ulat="$ulat" \
             -v rbw="$rbw" -v rb="$rbw_before" -v ra="$rbw_after" -v ubw="$ubw" \
             -v trtt="$trtt" -v rtt="$rtt" -v frtt="$frtt" -v tbw="$tbw" -v bw="$bw" -v abw="$abw" -v dabw="$dabw" \
             -v r="$round" 'BEGIN {
    printf "round %d: ib_send_lat %.2f us one-way (%.2f before, %.2f after),", r, lat, lb, la;
    printf " UCX tag_lat %.2f, frame RTT %.1f us, call RTT %.1f us (%.1f with a fresh response message);",
           ulat, trtt, rtt, frtt;
    printf " ib_read_bw %.1f MiB/s (%.1f before, %.1f after),", rbw, rb, ra;
    printf " UCX ucp_get %.1f, transport pull %.1f, call pull %.1f, attachment pull %.1f (%.1f in the default mode)",
           ubw, tbw, bw, abw, dabw;
    printf " | %.3f %.3f %.3f %.3f %.3f %.3f %.3f %.3f %.3f %.3f %.3f %.3f", ulat / lat, trtt / (2 * lat),
           rtt / (2 * lat), rtt / (2 * ulat), ubw / rbw, tbw / rbw, bw / rbw, bw / ubw,
           abw / rbw, abw / ubw, frtt / (2 * lat), dabw / rbw;
  }')
  echo "${line% | *}"
  ibare=$(field "$inter" interleaved_bare_verbs_rtt_p50_us)
  icall=$(field "$inter" interleaved_rpc_small_rtt_p50_us)
  iratio=$(field "$inter" interleaved_rpc_small_over_bare_verbs)
  if [ -n "$iratio" ]; then
    echo "round $round: interleaved in one process: bare verbs RTT $ibare us, call RTT $icall us," \
         "call / bare $iratio"
    interleaved="$interleaved $iratio"
  else
    echo "round $round: no interleaved figure: $(echo "$inter" | grep -v '^rdmarpc\[' | tail -2)"
  fi
  srate=$(send_rate)
  mrate=$(medium_calls 0)
  mrate_pool=$(medium_calls 2)
  if [ -n "$srate" ] && [ -n "$mrate" ] && [ -n "$mrate_pool" ] && [ "${mrate%%.*}" -gt 0 ]; then
    mratio=$(awk -v m="$mrate" -v s="$srate" 'BEGIN {printf "%.3f", 2 * m / s}')
    echo "round $round: ib_send_bw $srate messages/s of $medium_frame B; medium calls $mrate/s" \
         "with inline callbacks ($mrate_pool/s on 2 callback threads); call SENDs / ib_send_bw $mratio"
    medium="$medium $mratio"
  else
    echo "round $round: no medium-call figure (ib_send_bw '$srate', calls '$mrate' / '$mrate_pool')"
  fi
  ratios="$ratios
${line##* | }"
  raws="$raws
$lat_before $lat_after $ulat $trtt $rtt $rbw_before $rbw_after $ubw $tbw $bw $abw $frtt $dabw"
done
if [ -z "${raws//[[:space:]]/}" ]; then
  echo "bench: no round gave every figure (see the skipped rounds above); no ratios" >&2
  exit 1
fi
# Medians per column over the rounds.
med() { echo "$ratios" | awk -v c="$1" 'NF {print $c}' | median; }
awk -v ul="$(med 1)" -v t="$(med 2)" -v s="$(med 3)" -v su="$(med 4)" -v ub="$(med 5)" \
    -v tb="$(med 6)" -v b="$(med 7)" -v bu="$(med 8)" -v ab="$(med 9)" -v abu="$(med 10)" \
    -v sf="$(med 11)" -v dab="$(med 12)" 'BEGIN {
  printf "ratio UCX tag_lat RTT / (2 x ib_send_lat) = %.2f (median; the peer framework)\n", ul;
  printf "ratio transport frame RTT / (2 x ib_send_lat) = %.2f (median)\n", t;
  printf "ratio small-call RTT / (2 x ib_send_lat) = %.2f (median; target <= 1.15)\n", s;
  printf "ratio small-call RTT / UCX tag_lat RTT = %.2f (median)\n", su;
  printf "ratio small-call RTT with a fresh response message / (2 x ib_send_lat) = %.2f (median)\n", sf;
  printf "ratio UCX ucp_get 1 MiB / ib_read_bw = %.2f (median; the peer framework)\n", ub;
  printf "ratio 1 MiB transport pull / ib_read_bw = %.2f (median)\n", tb;
  printf "ratio 1 MiB call pull / ib_read_bw = %.2f (median; target >= 0.95)\n", b;
  printf "ratio 1 MiB call pull / UCX ucp_get = %.2f (median)\n", bu;
  printf "ratio 1 MiB attachment call pull / ib_read_bw = %.2f (median; target >= 0.95)\n", ab;
  printf "ratio 1 MiB attachment call pull / UCX ucp_get = %.2f (median)\n", abu;
  printf "ratio 1 MiB attachment call pull in the default mode (adaptive poll, workers) / ib_read_bw = %.2f (median)\n", dab;
}'
if [ -n "${medium// /}" ]; then
  echo "ratio medium-call SENDs per second (1 KiB each way, 16 in flight, inline callbacks) /" \
       "ib_send_bw messages per second = $(echo "$medium" | median) (median)"
fi
if [ -n "${interleaved// /}" ]; then
  echo "ratio small-call RTT / bare verbs RTT, interleaved in one process (adaptive poll)" \
       "= $(echo "$interleaved" | median) (median; the target is 1.15 where the ping-pong is as fast as 2 x ib_send_lat)"
fi
# The best each reached over the boot: the emulated machine flips between
# fast and slow spells (ib_send_lat 11.6 and 20 us one-way within one boot),
# and a spell can favour one side of a round. Each tool's best is what it does
# undisturbed, so a gap between bests is the code's, not the spell's. perftest
# counts with its round's mean of before and after, so that every figure is
# the best of as many samples as there were rounds.
echo "$raws" | awk 'NF {
  lat = min(lat, ($1 + $2) / 2); ul = min(ul, $3); t = min(t, $4); s = min(s, $5);
  rb = max(rb, ($6 + $7) / 2); ub = max(ub, $8); tb = max(tb, $9); b = max(b, $10); ab = max(ab, $11);
  sf = min(sf, $12); dab = max(dab, $13);
}
function min(a, b) { return a == "" || b < a ? b : a }
function max(a, b) { return a == "" || b > a ? b : a }
END {
  printf "best of the boot: ib_send_lat %.2f us one-way, UCX tag_lat %.2f, frame RTT %.1f us, call RTT %.1f us (%.1f with a fresh response message);", lat, ul, t, s, sf;
  printf " ib_read_bw %.1f MiB/s, UCX ucp_get %.1f, transport pull %.1f, call pull %.1f, attachment pull %.1f\n", rb, ub, tb, b, ab;
  printf "ratio best small-call RTT / (2 x best ib_send_lat) = %.2f (UCX tag_lat %.2f, frame %.2f)\n", s / (2 * lat), ul / lat, t / (2 * lat);
  printf "ratio best 1 MiB call pull / best ib_read_bw = %.2f (attachment %.2f, in the default mode %.2f, transport %.2f, UCX ucp_get %.2f)\n", b / rb, ab / rb, dab / rb, tb / rb, ub / rb;
}'

# gRPC (HTTP/2 over TCP) beside rdmarpc over tcp:// and over rdma://, the
# same service in one process, in blocks that take turns (grpc_bench.cc says
# how): blocking calls one at a time, then 8 at once from 8 threads, then 8
# at once asynchronously from one thread; adaptive pollers.
grpc=$(timeout 600 bazel-bin/bench/grpc_bench --rounds 8 2>&1 || true)
g() { field "$grpc" "$1"; }
if [ -n "$(g rdmarpc_rdma_pull_over_grpc)" ]; then
  echo "gRPC beside rdmarpc: small-call RTT gRPC $(g grpc_small_rtt_p50_us) us," \
       "rdmarpc tcp:// $(g rdmarpc_tcp_small_rtt_p50_us) us, rdma:// $(g rdmarpc_rdma_small_rtt_p50_us) us;" \
       "1 MiB pull gRPC $(g grpc_pull_1mib_mib_per_s) MiB/s, rdmarpc tcp://" \
       "$(g rdmarpc_tcp_pull_1mib_mib_per_s), rdma:// $(g rdmarpc_rdma_pull_1mib_mib_per_s)"
  echo "ratio small-call RTT rdmarpc rdma:// / gRPC = $(g rdmarpc_rdma_small_rtt_over_grpc)" \
       "(median over rounds in turns; tcp:// $(g rdmarpc_tcp_small_rtt_over_grpc); below 1 is faster)"
  echo "ratio 1 MiB pull rdmarpc rdma:// / gRPC = $(g rdmarpc_rdma_pull_over_grpc)" \
       "(tcp:// $(g rdmarpc_tcp_pull_over_grpc); above 1 is faster)"
  echo "$(g in_flight) blocking callers at once: small calls/s gRPC $(g grpc_small_in_flight_calls_per_s)," \
       "rdmarpc tcp:// $(g rdmarpc_tcp_small_in_flight_calls_per_s), rdma:// $(g rdmarpc_rdma_small_in_flight_calls_per_s);" \
       "1 MiB pulls gRPC $(g grpc_pull_in_flight_mib_per_s) MiB/s, rdmarpc tcp://" \
       "$(g rdmarpc_tcp_pull_in_flight_mib_per_s), rdma:// $(g rdmarpc_rdma_pull_in_flight_mib_per_s)"
  echo "ratio small calls/s in flight rdmarpc rdma:// / gRPC = $(g rdmarpc_rdma_small_in_flight_over_grpc)" \
       "(tcp:// $(g rdmarpc_tcp_small_in_flight_over_grpc)); 1 MiB pulls in flight" \
       "$(g rdmarpc_rdma_pull_in_flight_over_grpc) (tcp:// $(g rdmarpc_tcp_pull_in_flight_over_grpc)); above 1 is faster"
  echo "$(g in_flight) asynchronous calls at once: small calls/s gRPC $(g grpc_small_async_calls_per_s)," \
       "rdmarpc tcp:// $(g rdmarpc_tcp_small_async_calls_per_s), rdma:// $(g rdmarpc_rdma_small_async_calls_per_s);" \
       "1 MiB pulls gRPC $(g grpc_pull_async_mib_per_s) MiB/s, rdmarpc tcp://" \
       "$(g rdmarpc_tcp_pull_async_mib_per_s), rdma:// $(g rdmarpc_rdma_pull_async_mib_per_s)"
  echo "ratio small calls/s async rdmarpc rdma:// / gRPC = $(g rdmarpc_rdma_small_async_over_grpc)" \
       "(tcp:// $(g rdmarpc_tcp_small_async_over_grpc)); 1 MiB pulls async" \
       "$(g rdmarpc_rdma_pull_async_over_grpc) (tcp:// $(g rdmarpc_tcp_pull_async_over_grpc)); above 1 is faster"
else
  echo "no gRPC figure: $(echo "$grpc" | grep -v '^rdmarpc\[' | tail -2)"
fi
