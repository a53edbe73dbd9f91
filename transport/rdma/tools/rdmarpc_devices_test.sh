#!/usr/bin/env bash
# rdmarpc_devices in the Soft-RoCE VM: it lists the device with its active
# port and GIDs, finds the route to the VM's own address on the GID that
# carries it (the entry the listing shows), checks a named device and GID as
# a connection would, and fails with the reason and the devices for an
# address no device reaches and for a device that is not the route's. A
# name with two addresses gets a line for each; one with none says so. The
# unspecified address routes as the VM's own; a link-local one needs its
# interface.
# (tools/rdma_sh_prelude.sh comes before this.)
set -uo pipefail
tool=$1
with_own_etc_hosts=$2
ip=$RDMARPC_TEST_ADDR
check() {  # what, condition...
  local what=$1
  shift
  if ! "$@"; then
    echo "FAIL: $what"
    fail=1
  fi
}
contains() { grep -qF -- "$2" <<<"$1"; }
# Runs a command, keeping its output (shown) in $out and its status in $rc.
run() {
  out=$("$@" 2>&1)
  rc=$?
  echo "$out"
}

run "$tool"
check "a machine with an active device exits 0 (got $rc)" test "$rc" = 0
check "the listing shows an active port" contains "$out" "port 1 active"
# The index of the RoCE v2 GID that carries the address, from the listing.
gid=$(grep -oE "gid\[[0-9]+\]=::ffff:$ip RoCE v2" <<<"$out" | head -1 | sed -E 's/gid\[([0-9]+)\].*/\1/')
check "the listing shows a RoCE v2 GID for $ip" test -n "$gid"
dev=$(awk 'NR == 2 {print $1}' <<<"$out")

run "$tool" --to "rdma://$ip:7471"
check "a route to $ip exits 0 (got $rc)" test "$rc" = 0
check "the route names the device, port 1 and the GID that carries $ip" \
  contains "$out" "route to rdma://$ip:7471: device $dev port 1 gid_index $gid (::ffff:$ip, RoCE v2)"
check "the route comes with perftest's command for the same path" \
  contains "$out" "ib_read_bw -R -d $dev -i 1 $ip"

# As for a connect, the unspecified address is this host's RoCE address.
run "$tool" --to "rdma://0.0.0.0:7471"
check "a route to 0.0.0.0 exits 0 (got $rc)" test "$rc" = 0
check "the route to 0.0.0.0 is the one to $ip" \
  contains "$out" "route to rdma://0.0.0.0:7471 (address $ip:7471): device $dev port 1 gid_index $gid (::ffff:$ip, RoCE v2)"
check "its perftest command names $ip" contains "$out" "ib_read_bw -R -d $dev -i 1 $ip"

# A link-local address needs its interface, which the error names for one
# of this host's own.
read -r lldev ll <<<"$(ip -6 -o addr show scope link |
  awk '$2 != "lo" {split($4, a, "/"); print $2, a[1]; exit}')"
check "the VM has an IPv6 link-local address" test -n "$ll"
run "$tool" --to "rdma://[$ll]:7471"
check "a link-local address without its interface exits 1 (got $rc)" test "$rc" = 1
check "and says to name it, naming $lldev" \
  contains "$out" "is a link-local address, which is an address only on its interface. Name the interface, as in rdma://[$ll%$lldev]:7471"
run "$tool" --to "rdma://[$ll%$lldev]:7471"
check "with its interface it routes (got $rc)" test "$rc" = 0

run env RDMARPC_RDMA_DEVICE=$dev RDMARPC_RDMA_GID_INDEX=$gid "$tool" --to "rdma://$ip:7471"
check "the named device and GID are accepted (got $rc)" test "$rc" = 0
check "the named GID is the route's" contains "$out" "gid_index $gid ("

run env RDMARPC_RDMA_DEVICE=mlx5_9 "$tool" --to "rdma://$ip:7471"
check "a device that is not the route's exits 1 (got $rc)" test "$rc" = 1
check "the error names both devices" contains "$out" "chose device $dev"
check "the error names the device asked for" contains "$out" "asks for mlx5_9"

# TEST-NET-1: no device has a route there (none at all, or no answer to ARP).
run timeout 30 "$tool" --to "rdma://192.0.2.1:7471"
check "an address no device reaches exits 1 (got $rc)" test "$rc" = 1
check "the error says which step failed" contains "$out" "route to rdma://192.0.2.1:7471: rdma_resolve_"
check "and why" contains "$out" "no RDMA device reaches it"
check "the error lists the devices" contains "$out" "Devices: $dev port 1"

# A name with two addresses, one that no device reaches (getaddrinfo puts
# it second here, after the local one): a line for each, as a connection
# tries each; the route found is enough (exit 0), and perftest's command
# names its address. The name is in an /etc/hosts of the command's own
# (tests/with_own_etc_hosts.sh).
run timeout 60 "$with_own_etc_hosts" bash -c \
  'printf "192.0.2.1 two-addresses\n%s two-addresses\n" "$1" >"$RDMARPC_TEST_HOSTS" &&
   "$2" --to rdma://two-addresses:7471' _ "$ip" "$tool"
check "a name with one address that routes exits 0 (got $rc)" test "$rc" = 0
check "the address that does not route gets a line, with why" \
  contains "$out" "route to rdma://two-addresses:7471 (address 192.0.2.1:7471): rdma_resolve_"
check "the one that routes gets a line, with the route" contains "$out" \
  "route to rdma://two-addresses:7471 (address $ip:7471): device $dev port 1 gid_index $gid"
check "perftest's command names the address that routes" contains "$out" "ib_read_bw -R -d $dev -i 1 $ip"

# A name that resolves to nothing (names resolve from that /etc/hosts
# alone): exit 1, naming it, and how to see what it resolves to.
run timeout 60 "$with_own_etc_hosts" "$tool" --to rdma://no-such-name:7471
check "a name that does not resolve exits 1 (got $rc)" test "$rc" = 1
check "and says it cannot resolve it" contains "$out" "cannot resolve rdma://no-such-name:7471"
check "and how to see what it resolves to" contains "$out" "getent ahosts no-such-name"

run "$tool" --to "$ip"
check "an address without scheme exits 1 (got $rc)" test "$rc" = 1
check "and says what an address looks like" contains "$out" "expected tcp://host:port"

[ "$fail" = 0 ] && echo PASS
exit "$fail"
