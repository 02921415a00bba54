#!/usr/bin/env bash
# OS packages the DSec sandbox service and its tests need (Debian 12).
# Idempotent: installs only what is missing; runs apt-get update at most once.
set -euo pipefail

need=()
have_cmd() { command -v "$1" >/dev/null 2>&1; }
have_cmd crun          || need+=(crun)
have_cmd mkfs.erofs    || need+=(erofs-utils)
have_cmd debootstrap   || need+=(debootstrap)
[ -x /bin/busybox ] || have_cmd busybox || need+=(busybox-static)
have_cmd ip            || need+=(iproute2)
have_cmd unshare       || need+=(util-linux)

if [ "${#need[@]}" -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "dsec-system-deps: missing ${need[*]} and not root; the tests that need them will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
echo "dsec-system-deps: installed ${need[*]}"
