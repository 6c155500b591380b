#!/usr/bin/env bash
# Debian libraries the CPU Mooncake wheel links against. Idempotent: does nothing when present.
set -euo pipefail
need=()
for lib in libibverbs.so.1 libnuma.so.1 libcurl.so.4; do
  if ! ldconfig -p 2>/dev/null | grep -q "$lib"; then need+=("$lib"); fi
done
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 libnuma1 libcurl4 >/dev/null
