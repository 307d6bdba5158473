#!/usr/bin/env bash
# The Debian libraries Mooncake's binaries link against (RDMA verbs and netlink), even
# when they move data over TCP, and a C compiler and the Python headers for the
# scheduler's C loops (scheduler/_native.c). Installed only where missing; needs root (or
# sudo). PYTHON is the interpreter the venv is made from (the Makefile's).
set -euo pipefail
missing=()
for pair in libibverbs.so.1:libibverbs1 libnl-3.so.200:libnl-3-200 libnl-route-3.so.200:libnl-route-3-200; do
  lib=${pair%%:*}; pkg=${pair##*:}
  ldconfig -p | grep -q "$lib" || missing+=("$pkg")
done
command -v cc >/dev/null || missing+=(gcc)
# Debian's own python3 ships its headers apart (python3-dev); a pyenv or python.org build has them.
headers=$("${PYTHON:-python3}" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -f "$headers/Python.h" ] || missing+=(python3-dev)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing ${missing[*]} (Mooncake's libraries, a C compiler, Python headers)" >&2
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
