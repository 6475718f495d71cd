#!/usr/bin/env bash
# Installs everything the shim and its tests need on a fresh Debian 12 machine:
# distribution packages, CRIU >= 4.2 built from Debian sid's source tarball,
# and containerd 1.7 (trixie) / 2.1 (sid) unpacked privately (never installed:
# they would pull a newer libc). Idempotent: reuses what is already present.
set -euo pipefail

DEPS_DIR=${CEDANA_DEPS_DIR:-/opt/cedana-deps}
mkdir -p "$DEPS_DIR"
log() { printf '[setup] %s\n' "$*" >&2; }

APT_PACKAGES=(
  containerd runc umoci skopeo busybox-static containernetworking-plugins
  iproute2 iptables util-linux e2fsprogs zstd docker-registry openssl
  slurm-wlm munge libslurm-dev mmdebstrap prometheus
  chromium
  golang-github-containerd-cgroups-dev
  libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev protobuf-compiler
  python3-protobuf libnl-3-dev libnl-route-3-dev libnet1-dev libcap-dev pkg-config
  libbsd-dev libgnutls28-dev libaio-dev libdrm-dev uuid-dev libnftables-dev
  build-essential dpkg-dev
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The distribution's containerd service must not own /run/containerd in tests.
  systemctl disable --now containerd >/dev/null 2>&1 || true
fi

# Extra suites for trixie/sid, derived from the system sources file at run time,
# pinned low so nothing upgrades by accident.
add_suite() {
  local suite=$1 file=/etc/apt/sources.list.d/cedana-$1.sources
  [[ -f $file ]] && return 1
  awk -v s="$suite" 'BEGIN{RS="";ORS="\n\n"} NR==1{print}' /etc/apt/sources.list.d/debian.sources \
    | sed -E "s/^Suites:.*/Suites: $suite/; s/^Types:.*/Types: deb deb-src/" >"$file"
  printf 'Package: *\nPin: release n=%s\nPin-Priority: 100\n' "$suite" >/etc/apt/preferences.d/cedana-$suite
  return 0
}

# CRIU >= 4.2: 4.1 cannot dump any inet socket on kernels >= 6.16 ("sockets: Can't get
# 1:16 opt"). `cedana doctor` probes the running kernel for that with a real dump.
criu_ok() { [[ -x /usr/local/sbin/criu ]] && /usr/local/sbin/criu --version 2>/dev/null | grep -qE 'Version: (4\.([2-9]|[1-9][0-9])|[5-9])'; }
need_update=0
if [[ ! -x $DEPS_DIR/containerd-1.7/usr/bin/containerd || ! -x $DEPS_DIR/containerd-2.1/usr/bin/containerd \
      || ! -d $DEPS_DIR/cri-api/usr || ! -d $DEPS_DIR/containerd-api/usr \
      || ! -x $DEPS_DIR/checkpointctl/usr/bin/checkpointctl || ! -d $DEPS_DIR/libc6-trixie/usr \
      || ! -x $DEPS_DIR/cosign/usr/bin/cosign ]] || ! criu_ok; then
  add_suite trixie && need_update=1 || true
  add_suite sid && need_update=1 || true
  ((need_update)) && apt-get update -qq || true
fi

unpack_deb() {  # suite package dest: unpack a .deb privately, never install it
  local suite=$1 pkg=$2 dest=$3
  [[ -d $dest/usr ]] && return
  log "$pkg from $suite -> $dest"
  local tmp; tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -qq -t "$suite" "$pkg" >/dev/null)
  mkdir -p "$dest"
  dpkg -x "$tmp"/"$pkg"_*.deb "$dest"
  rm -rf "$tmp"
}
# Interface definitions for scripts/gen_protos.py: containerd 1.7's protos (a
# superset of 1.6's, with runtimeoptions config_body) and CRI's api.proto.
unpack_deb trixie golang-github-containerd-containerd-dev "$DEPS_DIR/containerd-api"
unpack_deb trixie golang-github-kubernetes-cri-api-dev "$DEPS_DIR/cri-api"
unpack_deb trixie containerd "$DEPS_DIR/containerd-1.7"
unpack_deb sid containerd "$DEPS_DIR/containerd-2.1"
# The oracle of the Kubernetes checkpoint archive tests (tests/integration/test_cri_archive.py):
# trixie's build needs glibc 2.38, so it runs through trixie's own loader and libc,
# unpacked beside it (bookworm's libc stays the system's).
unpack_deb trixie checkpointctl "$DEPS_DIR/checkpointctl"
unpack_deb trixie libc6 "$DEPS_DIR/libc6-trixie"
printf '#!/bin/sh\nlib=%s\nexec "$lib/ld-linux-x86-64.so.2" --library-path "$lib" %s "$@"\n' \
  "$DEPS_DIR/libc6-trixie/usr/lib/x86_64-linux-gnu" "$DEPS_DIR/checkpointctl/usr/bin/checkpointctl" \
  >"$DEPS_DIR/checkpointctl/checkpointctl"
chmod 0755 "$DEPS_DIR/checkpointctl/checkpointctl"
# cosign (a static Go binary) for the tests that check a checkpoint's signature the way
# a user would (`cosign verify --key`); the shim signs and verifies on its own.
unpack_deb sid cosign "$DEPS_DIR/cosign"

if ! criu_ok; then
  log "building CRIU from sid's source tarball"
  src=$DEPS_DIR/criu-src
  mkdir -p "$src"
  (cd "$src" && { ls criu_4.[2-9]*.orig.tar.* >/dev/null 2>&1 || apt-get source --download-only -t sid criu >/dev/null 2>&1 || true; })
  tarball=$(ls "$src"/criu_*.orig.tar.* | sort -V | tail -n1)
  rm -rf "$src/build" && mkdir -p "$src/build"
  tar -xf "$tarball" -C "$src/build" --strip-components=1
  make -C "$src/build" -j"$(nproc)" criu >/dev/null 2>&1
  install -m 0755 "$src/build/criu/criu" /usr/local/sbin/criu
fi
criu_ok || { log "CRIU >= 4.2 missing after build"; exit 1; }
log "ready: containerd $(containerd --version | awk '{print $3}'), $("$DEPS_DIR"/containerd-1.7/usr/bin/containerd --version | awk '{print $3}'), $("$DEPS_DIR"/containerd-2.1/usr/bin/containerd --version | awk '{print $3}'); runc $(runc --version | head -1 | awk '{print $3}'); $(/usr/local/sbin/criu --version | head -1)"
