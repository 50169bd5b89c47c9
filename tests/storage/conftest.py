"""Fixtures of the storage tests: a storage of each backend, a StorageSpec for moto."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubetrain.trainer.storage import Storage, open_storage

from kubetrain.api.trainingjob import StorageSpec


@pytest.fixture
def s3_spec(s3_endpoint: str) -> StorageSpec:
    """spec.storage pointing at the test's moto server."""
    return StorageSpec(endpoint=s3_endpoint, region="us-east-1")


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """An empty storage on local disk, then on S3 (moto over HTTP)."""
    if request.param == "local":
        return open_storage(str(tmp_path / "root"))
    bucket = request.getfixturevalue("s3_bucket")
    return open_storage(f"s3://{bucket}/root", request.getfixturevalue("s3_spec"))
