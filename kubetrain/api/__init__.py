"""The TrainingJob API: pydantic models shared by the operator, the trainer and the CLI.

Torch-free and Kubernetes-client-free, so every side can import it cheaply.
"""

from kubetrain.api.manifest import InvalidManifest, Problem, load_documents, load_job, parse_job
from kubetrain.api.presets import PRESET_NAMES, PRESETS, Preset
from kubetrain.api.trainingjob import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    ModelDims,
    TrainingJob,
    TrainingJobSpec,
    TrainingJobStatus,
)

__all__ = [
    "API_VERSION", "GROUP", "KIND", "PLURAL", "PRESETS", "PRESET_NAMES", "VERSION",
    "InvalidManifest", "ModelDims", "Preset", "Problem", "TrainingJob", "TrainingJobSpec",
    "TrainingJobStatus", "load_documents", "load_job", "parse_job",
]
