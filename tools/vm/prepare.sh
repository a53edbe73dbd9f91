#!/usr/bin/env bash
# Prepares what the Soft-RoCE test VM boots: a stock Debian kernel and a small
# busybox initramfs holding the modules for 9p, overlayfs and rdma_rxe/rdma_cm,
# and the kernel's symbols, read in one boot of it. Idempotent: does nothing
# when $RDMARPC_VM_DIR already holds a matching image.
#
# Usage: tools/vm/prepare.sh            (RDMARPC_VM_DIR defaults to .cache/vm)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
vm_dir=${RDMARPC_VM_DIR:-$root/.cache/vm}
mkdir -p "$vm_dir"
vm_dir=$(cd "$vm_dir" && pwd)

# The modules in the order the guest loads them; modprobe resolves their deps.
# crc32_generic is not a declared dependency of rdma_rxe, but rxe computes the
# RoCEv2 ICRC through the crypto "crc32" hash and fails to send without it.
modules=(virtio_pci 9pnet_virtio 9p overlay crc32_generic rdma_rxe rdma_ucm dummy virtio_net)

stamp_inputs="$(sha256sum "$here/init.sh" "$0" | awk '{print $1}' | tr '\n' ' ')"

kernel_pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
if [ -z "$kernel_pkg" ]; then
  # Reuse whatever kernel was prepared before when apt has no lists.
  kernel_pkg=$(cat "$vm_dir/kernel_pkg" 2>/dev/null || true)
  [ -n "$kernel_pkg" ] || { echo "prepare: cannot resolve linux-image-amd64; run apt-get update" >&2; exit 1; }
fi
stamp="$kernel_pkg $stamp_inputs"
if [ -f "$vm_dir/stamp" ] && [ "$(cat "$vm_dir/stamp")" = "$stamp" ] \
   && [ -f "$vm_dir/vmlinuz" ] && [ -f "$vm_dir/initrd.cpio.gz" ]; then
  exit 0
fi

echo "prepare: building the Soft-RoCE VM image ($kernel_pkg) in $vm_dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download "$kernel_pkg" >/dev/null 2>&1) \
  || { echo "prepare: apt-get download $kernel_pkg failed" >&2; exit 1; }
dpkg-deb -x "$work"/linux-image-*.deb "$work/k"
kver=$(ls "$work/k/lib/modules")
depmod -b "$work/k" "$kver"

initrd="$work/initrd"
mkdir -p "$initrd"/{bin,dev,proc,sys,mnt,modules,newroot,lower,rw,io}
cp /bin/busybox "$initrd/bin/busybox"
cp "$here/init.sh" "$initrd/init"
chmod +x "$initrd/init"

: > "$initrd/modules/order"
declare -A seen=()
for m in "${modules[@]}"; do
  while read -r verb path args; do
    [ "$verb" = insmod ] || continue
    [ -z "${seen[$path]:-}" ] || continue
    seen[$path]=1
    name=$(basename "$path")
    cp "$path" "$initrd/modules/$name"
    echo "$name $args" >> "$initrd/modules/order"
  done < <(modprobe -d "$work/k" -S "$kver" --show-depends "$m")
done

(cd "$initrd" && find . | cpio -o -H newc --quiet | gzip -1) > "$vm_dir/initrd.cpio.gz"
cp "$work/k/boot/vmlinuz-$kver" "$vm_dir/vmlinuz"
echo "$kernel_pkg" > "$vm_dir/kernel_pkg"
# The kernel's text symbols, for naming where a stuck guest's vCPUs are
# (run.sh, show_vcpus). Debian's package holds no real System.map (that is
# in its 800 MB -dbg package), so one boot reads them; the guest boots with
# nokaslr, so every boot has these addresses. Without them a stuck boot's
# report gives bare addresses. The guest runs the command in this working
# directory, which it lacks where that is under /tmp (the guest's own): "/".
# The warning goes to stdout, as make deps hides this script's stderr.
rm -f "$vm_dir/kallsyms"
if (cd / && RDMARPC_VM=always RDMARPC_VM_DIR=$vm_dir RDMARPC_VM_KEEP=$work/syms "$here/run.sh" --timeout 300 -- \
    sh -c 'awk '"'"'$2 ~ /^[tTwW]$/ && NF == 3'"'"' /proc/kallsyms > "$RDMARPC_VM_OUT/kallsyms"') >"$work/syms.log" 2>&1 \
    && [ -s "$work/syms/kallsyms" ]; then
  cp "$work/syms/kallsyms" "$vm_dir/kallsyms"
else
  echo "prepare: warning: could not read the guest kernel's symbols (a stuck boot will be reported by address):"
  tail -n 20 "$work/syms.log"
fi
echo "$stamp" > "$vm_dir/stamp"
echo "prepare: done ($(wc -l < "$initrd/modules/order") modules)"
