#!/usr/bin/env bash
# Builds what the VM tier boots, once, and prints the directory that holds it:
#   vmlinuz            Debian 12's current stock kernel (CONFIG_MEM_SOFT_DIRTY=y)
#   modules/<kver>/    its modules (the guest's /lib/modules; the host has none)
#   kmod/              Debian's kmod, unpacked: the guest's modprobe, and depmod here
#   initramfs.cpio.gz  static busybox, the virtio/9p/overlay modules and ./initramfs-init
# The guest's root is this host's own / (read-only over 9p, a tmpfs overlay on top), so
# nothing else is built: containerd, runc, CRIU, Slurm and the venv are the host's.
# Cached under $CEDANA_VM_DIR (default /opt/cedana-deps/vm), keyed by this script,
# initramfs-init and the kernel version: a change of any of them builds afresh.
set -euo pipefail

here=$(dirname "$(readlink -f "$0")")
cache=${CEDANA_VM_DIR:-/opt/cedana-deps/vm}
log() { printf '[vm-build] %s\n' "$*" >&2; }

need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
/bin/busybox --list 2>/dev/null | grep -qx cpio || need+=(busybox-static)
if ((${#need[@]})); then
  log "apt-get install ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  updated=1
fi

# The kernel Debian 12's linux-image-amd64 depends on now (it moves with security
# updates; older ones leave the mirror, so it is not pinned).
kernel_package() {
  apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'
}
recipe=$(cat "$0" "$here/initramfs-init" | sha256sum | cut -c1-16)
pkg=$(kernel_package || true)
if [[ -z $pkg || ! -f $cache/$pkg-$recipe/ok ]] && [[ -z ${updated:-} ]]; then
  # Unknown to this apt index, or not built yet: the index may be stale.
  apt-get update -qq
  pkg=$(kernel_package || true)
fi
[[ -n $pkg ]] || { log "apt-cache knows no linux-image-amd64 (Debian 12 sources missing?)"; exit 1; }
kver=${pkg#linux-image-}
out=$cache/$pkg-$recipe
if [[ -f $out/ok ]]; then
  echo "$out"
  exit 0
fi

log "building $out"
rm -rf "$out.tmp" && mkdir -p "$out.tmp"
work=$out.tmp
# The packages are kept: a change of the recipe alone downloads nothing. As root:
# _apt cannot write into a root-owned directory.
debs=$cache/debs
mkdir -p "$debs"
ls "$debs"/"$pkg"_*.deb >/dev/null 2>&1 || (cd "$debs" && apt-get -o APT::Sandbox::User=root download -qq "$pkg")
ls "$debs"/kmod_*.deb >/dev/null 2>&1 || (cd "$debs" && apt-get -o APT::Sandbox::User=root download -qq kmod)
dpkg-deb -x "$(ls "$debs"/"$pkg"_*.deb | tail -n1)" "$work/kernel"
dpkg-deb -x "$(ls "$debs"/kmod_*.deb | tail -n1)" "$work/kmod"
grep -q '^CONFIG_MEM_SOFT_DIRTY=y' "$work/kernel/boot/config-$kver" \
  || { log "$pkg has no CONFIG_MEM_SOFT_DIRTY=y"; exit 1; }
# kmod picks its personality from its name (its own links are absolute: the host's).
ln -s kmod "$work/kmod/bin/depmod"
ln -s kmod "$work/kmod/bin/modprobe"
"$work/kmod/bin/depmod" -b "$work/kernel" "$kver"
[[ -s $work/kernel/lib/modules/$kver/modules.dep.bin ]] || { log "depmod wrote no modules.dep.bin"; exit 1; }
mv "$work/kernel/boot/vmlinuz-$kver" "$work/vmlinuz"
mv "$work/kernel/lib/modules" "$work/modules"

# What the initramfs loads to reach the 9p root, dependencies first (modules.dep lists
# a module's dependencies in the reverse of their load order).
dep=$work/modules/$kver/modules.dep
mods=
for top in virtio_pci 9pnet_virtio 9p overlay; do
  line=$(grep -E "/$top\.ko:" "$dep") || { log "module $top missing from $pkg"; exit 1; }
  for path in $(echo "${line#*:}" | tr ' ' '\n' | tac) "${line%%:*}"; do
    m=$(basename "$path" .ko)
    [[ " $mods " == *" $m "* ]] || mods="$mods $m"
  done
done
ir=$work/initramfs
mkdir -p "$ir/bin" "$ir/mods"
cp /bin/busybox "$ir/bin/busybox"
install -m 0755 "$here/initramfs-init" "$ir/init"
for m in $mods; do
  cp "$(find "$work/modules/$kver/kernel" -name "$m.ko" -print -quit)" "$ir/mods/"
done
echo "$mods" >"$ir/mods/order"
(cd "$ir" && find . | /bin/busybox cpio -o -H newc 2>/dev/null | gzip -1) >"$work/initramfs.cpio.gz"
rm -rf "$ir" "$work/kernel"
echo "$kver" >"$work/kernel-version"
touch "$work/ok"
# Older builds and kernels are of no further use.
for old in "$cache"/linux-image-* "$debs"/linux-image-*.deb; do
  [[ $old == "$out.tmp" || $old == "$debs/${pkg}_"* ]] || rm -rf "$old"
done
mv "$work" "$out"
log "built $out ($(du -sh "$out" | cut -f1))"
echo "$out"
