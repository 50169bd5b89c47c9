"""Reading TrainingJob manifests and turning validation errors into problems a user can act on.

The one loader every entry point uses (`kubetrain validate`, `kubetrain run`, the
trainer, the operator), so a bad manifest reads the same everywhere: the field path,
what is wrong, and what to do.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kubetrain.api.trainingjob import API_VERSION, KIND, TrainingJob


class _KubernetesYamlLoader(yaml.SafeLoader):
    """YAML read as Kubernetes reads it: `3e-4` and `1e-05` are numbers.

    PyYAML follows YAML 1.1, where a float needs a dot, so `learningRate: 3e-4` (and
    what `kubectl get -o yaml` prints for small floats, e.g. `normEps: 1e-05`) would be
    strings; Kubernetes (YAML 1.2's core schema) reads them as numbers.
    """


_KubernetesYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a manifest."""

    path: str
    message: str
    hint: str = ""

    def __str__(self) -> str:
        # "spec.workers.minReplicas (4) is greater than..." reads better without a colon.
        joiner = " " if self.message.startswith("(") else ": "
        text = f"{self.path}{joiner}{self.message}" if self.path else self.message
        return f"{text} ({self.hint})" if self.hint else text


class InvalidManifest(ValueError):
    """A manifest that does not describe a valid TrainingJob."""

    def __init__(self, problems: list[Problem], source: str = "") -> None:
        self.problems = problems
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(where + "; ".join(str(p) for p in problems))


_HINTS = {
    "missing": "add this field",
    "extra_forbidden": "remove it or check its spelling; `kubectl explain trainingjob.spec` "
    "lists the fields",
    "literal_error": "use one of the listed values",
    "int_type": "write a whole number",
    "int_parsing": "write a whole number",
    "int_from_float": "write a whole number",
    "float_type": "write a number",
    "float_parsing": "write a number",
    "bool_type": "write true or false",
    "bool_parsing": "write true or false",
    "string_type": "write a string (quote it in YAML)",
    "dict_type": "write a mapping (key: value)",
    "model_type": "write a mapping (key: value)",
    "list_type": "write a list",
    "tuple_type": "write a list",
    "greater_than_equal": "raise the value",
    "greater_than": "raise the value",
    "less_than_equal": "lower the value",
    "less_than": "lower the value",
    "string_too_short": "it must not be empty",
}

_CREDENTIAL_WORDS = ("key", "secret", "password", "token", "credential")


def _path(loc: Iterable[int | str]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def problems_from(error: ValidationError) -> list[Problem]:
    """Every error in `error`, each with its manifest field path and a hint."""
    found = []
    for item in error.errors(include_url=False):
        loc = [part for part in item["loc"] if not _is_union_tag(part)]
        message = item["msg"]
        kind = item["type"]
        if kind == "field_problem":
            # Raised by a model validator about one of its fields: "field: message".
            field, _, message = message.partition(": ")
            loc = [*loc, *field.split(".")]
        elif message.startswith("Value error, "):
            message = message.removeprefix("Value error, ")
        hint = _HINTS.get(kind, "")
        if kind == "extra_forbidden" and any(
            word in str(loc[-1]).lower() for word in _CREDENTIAL_WORDS
        ):
            hint = ("credentials must never be written into a TrainingJob: store them in a "
                    "Secret and reference it with spec.storage.credentialsSecret.name")
        found.append(Problem(_path(loc), message, hint))
    return found


def _is_union_tag(part: int | str) -> bool:
    # pydantic adds the chosen union member ("int", "str", "function-after[...]") to locations.
    return isinstance(part, str) and (part in {"int", "str", "float", "bool"} or "[" in part)


def parse_job(document: Any, source: str = "") -> TrainingJob:
    """Validate one manifest document as a TrainingJob; InvalidManifest lists every problem."""
    if not isinstance(document, dict):
        raise InvalidManifest(
            [Problem("", f"expected a mapping, got {type(document).__name__}",
                     "a manifest is a YAML mapping with apiVersion, kind, metadata and spec")],
            source,
        )
    kind, api_version = document.get("kind"), document.get("apiVersion")
    if kind != KIND or api_version != API_VERSION:
        raise InvalidManifest(
            [Problem("kind", f"expected kind {KIND} in {API_VERSION}, got "
                     f"{kind!r} in {api_version!r}",
                     f"set apiVersion: {API_VERSION} and kind: {KIND}")],
            source,
        )
    try:
        return TrainingJob.model_validate(document)
    except ValidationError as error:
        raise InvalidManifest(problems_from(error), source) from None


def load_documents(path: str | Path) -> list[Any]:
    """All YAML documents in a file ('-' is standard input), skipping empty ones."""
    import sys

    text = sys.stdin.read() if str(path) == "-" else Path(path).read_text()
    try:
        return [doc for doc in yaml.load_all(text, Loader=_KubernetesYamlLoader)
                if doc is not None]
    except yaml.YAMLError as error:
        raise InvalidManifest([Problem("", f"not valid YAML: {error}")], str(path)) from None


def load_job(path: str | Path) -> TrainingJob:
    """The single TrainingJob in a manifest file."""
    documents = load_documents(path)
    jobs = [doc for doc in documents if isinstance(doc, dict) and doc.get("kind") == KIND]
    if len(jobs) != 1:
        raise InvalidManifest(
            [Problem("", f"expected exactly one TrainingJob, found {len(jobs)}")], str(path)
        )
    return parse_job(jobs[0], str(path))
