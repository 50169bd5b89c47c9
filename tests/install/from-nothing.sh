#!/usr/bin/env bash
# Proof from nothing: puts this machine back to fresh for kubetrain, then runs the README's
# two commands from a clean clone, as a new user and CI on a new machine would.
#
#   sudo bash tests/install/from-nothing.sh [REPO]     (REPO: what to clone; default: this one)
#
# 1. Back to fresh: purges the Debian packages `make test` installs
#    (tests/install/debian-packages.sh --list) and the dependencies only they needed, the
#    image cache (images/offline's, $KUBETRAIN_IMAGE_CACHE or ~/.cache/kubetrain/images),
#    pip's and uv's caches, and an empty /run/netns. The clone is new, so it has no .venv or
#    .venv-lowest.
# 2. In a clean clone: `CI=true make test`, then `make demo`, each timed.
#
# Everything goes to a log (its path is printed first); the end says each step's wall time
# and result, and the tail of its output. The clone is removed after a pass and kept after a
# failure. This changes the machine (it removes packages other projects may use): run it on a
# machine meant for this project, as root.
set -uo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
repo=${1:-$here}
if [ "$(id -u)" != "0" ]; then
    echo "from-nothing: needs root (it purges Debian packages)" >&2
    exit 2
fi
log=$(mktemp --tmpdir kubetrain-from-nothing.XXXXXX.log)
echo "from-nothing: log in $log"
say() { echo "from-nothing: $*" | tee -a "$log"; }

say "back to fresh"
mapfile -t packages < <(bash "$here/tests/install/debian-packages.sh" --list)
installed=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" && installed+=("$p")
done
export DEBIAN_FRONTEND=noninteractive
if [ ${#installed[@]} -gt 0 ]; then
    say "purging ${installed[*]}"
    apt-get purge -y -qq "${installed[@]}" >>"$log" 2>&1 || { say "apt-get purge failed"; exit 1; }
fi
apt-get autoremove --purge -y -qq >>"$log" 2>&1 || { say "apt-get autoremove failed"; exit 1; }
cache=${KUBETRAIN_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubetrain/images}
rm -rf "$cache" "${XDG_CACHE_HOME:-$HOME/.cache}/pip" "${XDG_CACHE_HOME:-$HOME/.cache}/uv"
if [ -d /run/netns ] && [ -z "$(ls -A /run/netns)" ]; then
    umount /run/netns 2>/dev/null
    rmdir /run/netns
fi
for tool in buildah containerd runc promtool chromium mmdebstrap; do
    if command -v "$tool" >/dev/null; then say "$tool is still installed"; exit 1; fi
done

clone=$(mktemp -d --tmpdir kubetrain-clone.XXXXXX)
git clone -q "$repo" "$clone" || { say "git clone $repo failed"; exit 1; }
say "clean clone of $(git -C "$clone" rev-parse --short HEAD) in $clone"

status=0
step() {
    local name=$1; shift
    local start=$SECONDS rc
    say "$name: started $(date -u +%H:%M:%S)"
    (cd "$clone" && "$@") >>"$log" 2>&1
    rc=$?
    results+=("$name: exit $rc after $((SECONDS - start)) s")
    say "$name: exit $rc after $((SECONDS - start)) s"
    [ $rc -eq 0 ] || status=1
    return $rc
}
results=()
step "CI=true make test" env CI=true make test && step "make demo" make demo

# Every test's time (tests/suite_budget.py), for choosing what to cut next.
cp "$clone/.pytest_cache/v/kubetrain/suite-times" "${log%.log}.times.json" 2>/dev/null \
    && say "every test's time in ${log%.log}.times.json"

echo "----- the last 25 lines of the output -----"
tail -n 25 "$log"
echo "----- results -----"
printf '%s\n' "${results[@]}"
if [ $status -eq 0 ]; then
    rm -rf "$clone"
    say "passed"
else
    say "FAILED (clone kept in $clone)"
fi
exit $status
