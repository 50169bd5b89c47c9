#!/usr/bin/env python3
"""This machine's effective pip configuration as one pip.conf for the RUN steps of image
builds, and the local paths it names, to mount read-only at the same paths in the build.

usage: pip_build_config.py OUT_PIP_CONF   (prints the paths; env PIP: the pip to ask,
                                           default `pip`, else `python3 -m pip`)

Asks pip itself, so nothing is hard-coded: `pip config list` reports every value of the
config files that `pip config debug` shows (global, user, site, $PIP_CONFIG_FILE) and of
the PIP_* environment variables (its ":env:" keys, which win over every file), merged the
way pip merges them. They are written as [global] plus the per-command sections. The
paths: the CA bundle and client certificate (`cert`, `client-cert`), find-links folders,
and file:// indexes (for a PEP 503 index at .../simple its parent folder, whose files the
index pages link to as ../../files/...). Proxies named in the configuration pass through
as values; buildah passes the http(s)_proxy environment variables through by itself.
"""
from __future__ import annotations

import ast
import configparser
import os
import shlex
import shutil
import subprocess
import sys
from urllib.parse import unquote, urlparse

PATH_KEYS = ("cert", "client-cert")
LINK_KEYS = ("find-links", "index-url", "extra-index-url")


def pip_command() -> list[str]:
    if os.environ.get("PIP"):
        return shlex.split(os.environ["PIP"])
    return ["pip"] if shutil.which("pip") else [sys.executable, "-m", "pip"]


def effective_config(pip: list[str]) -> dict[str, dict[str, str]]:
    listed = subprocess.run([*pip, "config", "list"], capture_output=True, text=True, check=True)
    out = listed.stdout
    sections: dict[str, dict[str, str]] = {}
    env: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if not sep or "." not in key:
            continue
        section, name = key.split(".", 1)
        value = ast.literal_eval(value) if value[:1] in "'\"" else value
        (env if section == ":env:" else sections.setdefault(section, {}))[name] = value
    # environment variables override every file, in every section
    sections.setdefault("global", {}).update(env)
    for section, values in sections.items():
        if section != "global":
            for name in env:
                values.pop(name, None)
    return sections


def local_paths(sections: dict[str, dict[str, str]]) -> list[str]:
    paths: list[str] = []
    for values in sections.values():
        for key, value in values.items():
            if key in PATH_KEYS and os.path.exists(value):
                paths.append(value)
                continue
            if key not in LINK_KEYS:
                continue
            for item in value.split():
                if item.startswith("file:"):
                    path = unquote(urlparse(item).path)
                else:
                    path = item if item.startswith("/") else ""
                if not path or not os.path.exists(path):
                    continue
                path = path.rstrip("/") or "/"
                if key != "find-links" and os.path.basename(path) == "simple":
                    path = os.path.dirname(path)
                paths.append(path)
    # drop duplicates and paths inside another one
    result: list[str] = []
    for p in sorted(set(paths), key=len):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in result):
            result.append(p)
    return sorted(result)


def write_pip_conf(out: str) -> list[str]:
    """Write the effective pip configuration to OUT; return the local paths it names."""
    sections = effective_config(pip_command())
    parser = configparser.RawConfigParser()
    for section, values in sorted(sections.items(), key=lambda kv: kv[0] != "global"):
        if values:
            parser[section] = values
    with open(out, "w") as f:
        f.write("# written by pip_build_config.py from this machine's `pip config list`;"
                " mounted as /etc/pip.conf\n")
        parser.write(f)
    return local_paths(sections)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    for p in write_pip_conf(sys.argv[1]):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
