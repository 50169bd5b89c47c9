#!/usr/bin/env bash
# Installs promtool (Debian's `prometheus` package) for the alert-rule tests.
#
# Best effort by design: it never fails the build. Where promtool cannot be
# installed (not root, no apt), tests/chart falls back to an equivalent check
# and says so in its output.
set -u

if command -v promtool >/dev/null 2>&1; then
    echo "install-promtool: promtool already present: $(command -v promtool)"
    exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-promtool: not root or no apt-get; alert-rule tests will use their fallback check"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
if apt-get update -qq >/dev/null \
    && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; then
    echo "install-promtool: installed $(command -v promtool || echo 'prometheus (promtool not on PATH)')"
else
    echo "install-promtool: apt-get could not install prometheus; alert-rule tests will use their fallback check"
fi
exit 0
