"""spec.storage: the object store's endpoint and the Secret its credentials come from."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, model_validator

from kubetrain.api.base import ApiModel, problem


class SecretReference(ApiModel):
    """A Secret holding S3 credentials as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY keys."""

    name: str = Field(min_length=1, description="Secret name in the job's namespace.")


class StorageSpec(ApiModel):
    """Object storage access. Credentials always come from a Secret, never the spec."""

    endpoint: str | None = Field(
        default=None, description="S3 endpoint URL for non-AWS stores (MinIO, Ceph, R2, GCS)."
    )
    region: str | None = Field(default=None, description="S3 region.")
    credentials_secret: SecretReference | None = Field(
        default=None,
        description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and optionally "
        "AWS_SESSION_TOKEN). Omit to use the default chain: IRSA / workload identity or the "
        "node's role.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_inline_credentials(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if re.search(r"(access.?key|secret.?key|password|token|credential)s?$",
                             str(key), re.IGNORECASE) and key != "credentialsSecret":
                    raise problem(str(key), "credentials must never be written into a "
                                  "TrainingJob: store them in a Secret and reference it "
                                  "with spec.storage.credentialsSecret.name")
        return data

