#!/usr/bin/env python3
"""This machine's apt sources for one Debian release as one-line entries, for mmdebstrap.

Reads the files apt reads: /etc/apt/sources.list and /etc/apt/sources.list.d/*.list
(one-line format), /etc/apt/sources.list.d/*.sources (deb822; `Enabled: no` skipped).
Keeps the `deb` entries whose suite is SUITE, SUITE-updates or SUITE-security, with a
signed-by keyring path and arch/trusted options, and gives each as
`deb [options] URI SUITE COMPONENTS`, once. No mirror is named anywhere but in the
machine's files.

usage: apt_sources.py SUITE [APT_ETC]   (APT_ETC: /etc/apt)   exit status 1 if none is found
"""
from __future__ import annotations

import glob
import os
import sys
from collections.abc import Iterator

Entry = tuple[str, str, str, list[str], dict[str, str]]


def one_line_entries(path: str) -> Iterator[Entry]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            opts: dict[str, str] = {}
            if "[" in line and "]" in line and line.index("[") < line.index("]"):
                head, rest = line.split("[", 1)
                inside, tail = rest.split("]", 1)
                for kv in inside.split():
                    if "=" in kv:
                        k, v = kv.split("=", 1)
                        opts[k.lower()] = v
                line = head + tail
            parts = line.split()
            if len(parts) >= 3:
                yield parts[0], parts[1], parts[2], parts[3:], opts


def deb822_entries(path: str) -> Iterator[Entry]:
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    for para in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = ""
        for raw in para.splitlines():
            if raw.startswith("#"):
                continue
            if raw[:1] in (" ", "\t") and key:       # continuation line (e.g. an embedded key)
                fields[key] += "\n" + raw.strip()
                continue
            if ":" in raw:
                key, value = raw.split(":", 1)
                key = key.strip().lower()
                fields[key] = value.strip()
        if not fields or fields.get("enabled", "yes").lower() == "no":
            continue
        opts: dict[str, str] = {}
        signed_by = fields.get("signed-by", "")
        if signed_by.startswith("/") and "\n" not in signed_by:
            opts["signed-by"] = signed_by
        if "architectures" in fields:
            opts["arch"] = ",".join(fields["architectures"].split())
        if "trusted" in fields:
            opts["trusted"] = fields["trusted"]
        for typ in fields.get("types", "").split():
            for uri in fields.get("uris", "").split():
                for suite in fields.get("suites", "").split():
                    yield typ, uri, suite, fields.get("components", "").split(), opts


def source_lines(suite: str, etc: str = "/etc/apt") -> list[str]:
    """The `deb` lines of SUITE (and its -updates and -security) in this machine's apt set-up."""
    wanted = {suite, f"{suite}-updates", f"{suite}-security", f"{suite}/updates"}
    entries: list[Entry] = []
    listed = sorted(glob.glob(os.path.join(etc, "sources.list.d", "*.list")))
    for path in [os.path.join(etc, "sources.list"), *listed]:
        if os.path.isfile(path):
            entries += list(one_line_entries(path))
    for path in sorted(glob.glob(os.path.join(etc, "sources.list.d", "*.sources"))):
        entries += list(deb822_entries(path))
    lines: list[str] = []
    for typ, uri, dist, components, opts in entries:
        if typ != "deb" or dist not in wanted:
            continue
        keep = {k: v for k, v in opts.items() if k in ("signed-by", "arch", "trusted")}
        o = " ".join(f"{k}={v}" for k, v in sorted(keep.items()))
        line = f"deb {'[' + o + '] ' if o else ''}{uri} {dist} {' '.join(components or ['main'])}"
        if line not in lines:
            lines.append(line)
    return lines


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    lines = source_lines(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "/etc/apt")
    for line in lines:
        print(line)
    return 0 if lines else 1


if __name__ == "__main__":
    sys.exit(main())
