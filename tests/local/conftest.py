"""Fixtures of the `kubetrain run` tests."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

# A few hundred KB of real Python: enough text for a tiny model's loss to fall clearly.
CORPUS_FILES = 40


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small text corpus: the first standard-library modules, one document per file."""
    folder = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:CORPUS_FILES]:
        shutil.copyfile(path, folder / path.name)
    return folder
