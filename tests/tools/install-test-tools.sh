#!/usr/bin/env bash
# Installs the Debian tools some tests run: promtool (package `prometheus`) for the
# alert-rule and metric-name checks, and chromium for the HTML report's headless check.
#
# Best effort by design: it never fails the build. Where a tool cannot be installed
# (not root, no apt), the tests that need it say so: tests/chart falls back to an
# equivalent check, the report test is skipped with the command that installs it.
set -u

missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if [ ${#missing[@]} -eq 0 ]; then
    echo "install-test-tools: promtool and chromium already present"
    exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-tools: not root or no apt-get; cannot install ${missing[*]}"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
if apt-get update -qq >/dev/null \
    && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
    echo "install-test-tools: installed ${missing[*]}"
else
    echo "install-test-tools: apt-get could not install ${missing[*]}"
fi
exit 0
