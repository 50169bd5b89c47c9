#!/usr/bin/env bash
# Every Debian package `make test` needs, installed in one serial step before anything runs
# side by side (two apt-get runs at once fail on apt's lock; `make test` once lost that race).
#
#   image build: mmdebstrap, buildah (images/offline/build_images.py)
#   containers:  containerd, runc, containernetworking-plugins (tests/cluster/)
#   test tools:  prometheus (promtool: metric and alert-rule checks), chromium (the report's
#                headless check)
#
# Installs only what is missing, so a machine that has them all asks apt nothing. Every apt
# call takes a shared lock, waiting at most APT_LOCK_WAIT seconds (default 600), so that a
# concurrent `make images` never races it. A package that cannot be installed is an error
# naming it and the command that failed. Without root or apt-get it says what is missing and
# how to install it; under CI=true that fails the run, as a test tool missing there would
# otherwise turn into skipped tests.
#
# usage: debian-packages.sh [--list]   (--list: print the packages, one a line)
set -euo pipefail

PACKAGES=(mmdebstrap buildah containerd runc containernetworking-plugins prometheus chromium)
LOCK=/var/lock/kubetrain-apt.lock
WAIT=${APT_LOCK_WAIT:-600}

if [ "${1:-}" = "--list" ]; then
    printf '%s\n' "${PACKAGES[@]}"
    exit 0
fi

missing=()
for p in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    [ "$status" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "debian-packages: all ${#PACKAGES[@]} present (${PACKAGES[*]})"
    exit 0
fi

command="apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "debian-packages: missing ${missing[*]}; as root, run: apt-get update && $command" >&2
    if [ "${CI:-}" = "true" ]; then
        echo "debian-packages: CI needs them (a missing tool would skip its tests)" >&2
        exit 1
    fi
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# DPkg::Lock::Timeout waits on apt's own locks for anything outside this project (an
# unattended upgrade); flock serialises this project's own apt calls.
apt=(flock --wait "$WAIT" "$LOCK" apt-get -o "DPkg::Lock::Timeout=$WAIT" -qq)
run() {
    if ! "$@" >"$log" 2>&1; then
        echo "debian-packages: \`${*:5}\` failed; installing ${missing[*]}:" >&2
        tail -n 30 "$log" >&2
        exit 1
    fi
}
echo "debian-packages: installing ${missing[*]} (about a minute)"
start=$SECONDS
run "${apt[@]}" update
run "${apt[@]}" install -y --no-install-recommends "${missing[@]}"
for p in "${missing[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    if [ "$status" != "install ok installed" ]; then
        echo "debian-packages: $p is still not installed after \`$command\`" >&2
        exit 1
    fi
done
echo "debian-packages: installed ${missing[*]} in $((SECONDS - start)) s"
