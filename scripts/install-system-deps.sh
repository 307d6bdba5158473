#!/usr/bin/env bash
# The Debian libraries Mooncake's binaries link against (RDMA verbs and netlink), even
# when they move data over TCP, and a C compiler for the scheduler's C loops
# (scheduler/_native.c). Installed only where missing; needs root (or sudo).
set -euo pipefail
missing=()
for pair in libibverbs.so.1:libibverbs1 libnl-3.so.200:libnl-3-200 libnl-route-3.so.200:libnl-route-3-200; do
  lib=${pair%%:*}; pkg=${pair##*:}
  ldconfig -p | grep -q "$lib" || missing+=("$pkg")
done
command -v cc >/dev/null || missing+=(gcc)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing ${missing[*]} (Mooncake's libraries, a C compiler)" >&2
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
