#!/usr/bin/env python3
"""This machine's effective pip configuration as one pip.conf for the RUN steps of image
builds, and the local paths it names, to mount read-only at the same paths in the build.

usage: pip_build_config.py OUT_PIP_CONF   (prints the paths; env PIP: the pip to ask,
                                           default `pip`, else `python3 -m pip`)

Asks pip itself, so nothing is hard-coded: `pip config list` reports every value of the
config files that `pip config debug` shows (global, user, site, $PIP_CONFIG_FILE) and of
the PIP_* environment variables (its ":env:" keys, which win over every file), merged the
way pip merges them. They are written as [global] plus the per-command sections.

The paths: every value of every key, split on whitespace, that is an absolute path or a
file:// URL: a constraint or requirements file, the CA bundle, find-links folders, file://
indexes (for a PEP 503 index at .../simple its parent folder, whose files the index pages
link to as ../../files/...), and whatever key pip adds next. Found by their form, not from
a list of keys, so no key is missed. A path that does not exist on this machine is an
error naming the key (PipConfigError), where pip inside the build would fail or silently
differ from pip here. Proxies named in the configuration pass through as values; buildah
passes the http(s)_proxy environment variables through by itself.
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

# Keys whose value is an index URL: a file:// index at .../simple links to ../../files/...
INDEX_KEYS = ("index-url", "extra-index-url")


class PipConfigError(ValueError):
    """The pip configuration names a path that does not exist; the message says which."""


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
    # PIP_CONFIG_FILE's values are listed with the rest: the build needs no pointer to it
    env.pop("config-file", None)
    # environment variables override every file, in every section
    sections.setdefault("global", {}).update(env)
    for section, values in sections.items():
        if section != "global":
            for name in env:
                values.pop(name, None)
    return sections


def _named_path(item: str) -> str | None:
    """The local path that one configuration value names, or None for a non-path value."""
    if item.startswith("file:"):
        return unquote(urlparse(item).path) or None
    return item if item.startswith("/") else None


def local_paths(sections: dict[str, dict[str, str]]) -> list[str]:
    """Every local file or folder the configuration names, outermost first, deduplicated.

    Raises PipConfigError for a named path that does not exist.
    """
    paths: list[str] = []
    missing: list[str] = []
    for section, values in sections.items():
        for key, value in values.items():
            for item in str(value).split():
                path = _named_path(item)
                if path is None:
                    continue
                if not os.path.exists(path):
                    missing.append(f"{section}.{key} = {item}")
                    continue
                path = path.rstrip("/") or "/"
                if key in INDEX_KEYS and os.path.basename(path) == "simple":
                    path = os.path.dirname(path)
                paths.append(path)
    if missing:
        raise PipConfigError(
            "this machine's pip configuration names paths that do not exist, so the image "
            "build cannot mount them: " + "; ".join(missing) + ". Create them, or remove the "
            "keys (`pip config debug` shows which file sets each; `pip config unset KEY`)")
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
    try:
        paths = write_pip_conf(sys.argv[1])
    except PipConfigError as error:
        print(f"pip_build_config: {error}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
