"""Knowledge distillation: the frozen teacher, its tokenizer check, and the student's loss with it.

Use (what the trainer does when the spec has `distillation`):

    teacher = load_teacher(spec, student_dims, train_index, mesh, device)   # collective
    model.output_loss = teacher.student_loss(model.output_loss)
    ...for each micro-batch:
    teacher.teach(inputs)                  # the teacher's no-grad forward
    loss = model(inputs, targets)          # (1 - alpha) CE + alpha T^2 KL, chunked (loss.py)
    ce, kd = teacher.terms()               # the two summed terms of that loss, detached

The teacher is a Hugging Face Llama folder or a kubetrain export, with INL dynamics
or without (its config.json says: `pretrained_config.teacher_config`), read by
pretrained.py into a kubetrain `Transformer` and placed by `parallelize_frozen`:
no gradients, eval mode, weights in the job's compute dtype, FSDP2-sharded like the
student under strategy fsdp, no optimizer state (it is not in the checkpoint either:
a resume reads it again from its URI). Its forward stops at the final norm; the
student's loss applies the teacher's output weight chunk by chunk with the student's
(loss.py's `distillation_loss`), so neither model's whole logits are ever held.

A student forward with no teacher pass before it (evaluation) computes the plain
cross-entropy with the implementation the trainer chose: validation losses stay
comparable with a job trained without a teacher.

The teacher must predict over the student's tokens: its vocabulary (config.json's
vocab_size) must be the student's, and when its folder has a tokenizer.json (a
kubetrain export always does: the exact bytes the data was prepared with), that
file's sha256 must be the one the prepared data's index records. This module owns
the teacher and the glue; the loss arithmetic lives in loss.py.
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from kubetrain.api.trainingjob import DistillationSpec, ModelDims, StorageSpec, TrainingJobSpec
from kubetrain.trainer.architecture import LanguageModel, build_model
from kubetrain.trainer.loss import DistillationLosses, OutputLoss, distillation_loss
from kubetrain.trainer.parallelize import parallelize_frozen
from kubetrain.trainer.prepare import TOKENIZER_NAME, DatasetIndex
from kubetrain.trainer.pretrained_config import (
    TEACHER_FIELD,
    PretrainedError,
    teacher_config,
    teacher_error,
)
from kubetrain.trainer.storage import open_storage


class TokenizerMismatch(PretrainedError):
    """The teacher predicts over other tokens than the data's (a configuration error: the
    trainer exits 2 and the job is not retried)."""


def teacher_tokenizer_sha256(uri: str, storage: StorageSpec | None) -> str | None:
    """sha256 of the teacher folder's tokenizer.json, as `kubetrain prepare` records it for
    the data (DatasetIndex.tokenizer_sha256); None when the folder has no tokenizer.json."""
    folder = open_storage(uri, storage)
    if not folder.exists(TOKENIZER_NAME):
        return None
    return hashlib.sha256(folder.read_bytes(TOKENIZER_NAME)).hexdigest()


def check_tokenizer(uri: str, teacher_vocab: int, teacher_sha256: str | None, *,
                    student_vocab: int, vocab_source: str, data: DatasetIndex,
                    data_uri: str) -> None:
    """Refuse a teacher whose vocabulary or tokenizer differs from the student's data's.

    `vocab_source` says where the student's vocabulary comes from (the data's tokenizer,
    or spec.model.vocabSize). Without a tokenizer.json in the teacher's folder only the
    vocabulary sizes can be compared.
    """
    if teacher_vocab != student_vocab:
        raise TokenizerMismatch(
            f"{TEACHER_FIELD}: the teacher's vocabulary ({teacher_vocab} tokens, vocab_size in "
            f"{uri}/config.json) is not the student's ({student_vocab} tokens, from "
            f"{vocab_source}): distillation compares the two models' predictions token by "
            "token, so both need the same tokenizer; use a teacher trained on data prepared "
            "with this tokenizer")
    if teacher_sha256 is not None and teacher_sha256 != data.tokenizer_sha256:
        raise TokenizerMismatch(
            f"{TEACHER_FIELD}: the teacher's tokenizer ({uri}/{TOKENIZER_NAME}, sha256 "
            f"{teacher_sha256[:16]}...) is not the one the data was prepared with ({data_uri}, "
            f"sha256 {data.tokenizer_sha256[:16]}...), although both have {teacher_vocab} "
            "tokens: the same ids would mean different text. Prepare the data with the "
            f"teacher's tokenizer (`kubetrain prepare INPUT -o URI --tokenizer "
            f"{uri}/{TOKENIZER_NAME}`) or use a teacher trained on this data's tokenizer")


class Teacher:
    """The frozen teacher of one job, and the student loss that distils it."""

    def __init__(self, module: LanguageModel, spec: DistillationSpec) -> None:
        self.module = module
        self.spec = spec
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._last: DistillationLosses | None = None

    def teach(self, tokens: torch.Tensor) -> None:
        """The teacher's pass over `tokens` [batch, seq] (collective under FSDP2): its final
        hidden states and its output weight, kept for the next student forward."""
        with torch.no_grad():
            hidden = self.module(tokens, final_hidden=True)
            if isinstance(self.module, FSDPModule):
                # The root's parameters (embedding, norm, output) stay gathered after a
                # forward, awaiting a backward that never comes: shard them again.
                self.module.reshard()
            weight = self.module.output.weight
            weight = weight.full_tensor() if isinstance(weight, DTensor) else weight.detach()
        self._pending = (hidden.flatten(0, 1), weight)

    def student_loss(self, plain: OutputLoss) -> OutputLoss:
        """The student's output loss: distillation after `teach`, else `plain` (evaluation)."""

        def loss(hidden: torch.Tensor, weight: torch.Tensor,
                 targets: torch.Tensor) -> torch.Tensor:
            if self._pending is None:
                return plain(hidden, weight, targets)
            teacher_hidden, teacher_weight = self._pending
            self._pending = None  # one teacher pass serves one student forward
            self._last = distillation_loss(hidden, weight, targets, teacher_hidden,
                                           teacher_weight, temperature=self.spec.temperature,
                                           alpha=self.spec.alpha)
            return self._last.loss

        return OutputLoss("distillation", loss)

    def terms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy and T^2 x KL of the last distilled forward, summed over its tokens."""
        assert self._last is not None, "terms() before a distilled forward"
        return self._last.ce, self._last.kd


def load_teacher(spec: TrainingJobSpec, student_dims: ModelDims, data: DatasetIndex,
                 mesh: DeviceMesh, device: torch.device) -> Teacher:
    """Check, build, shard and load the teacher `spec.distillation` names (collective)."""
    from kubetrain.trainer.pretrained import load_pretrained

    distillation = spec.distillation
    assert distillation is not None, "load_teacher needs spec.distillation"
    uri = distillation.teacher
    config = teacher_config(spec)
    dims = config.dims
    source = ("spec.model.vocabSize" if spec.model.vocab_size is not None
              else "the data's tokenizer")
    check_tokenizer(uri, dims.vocab_size, teacher_tokenizer_sha256(uri, spec.storage),
                    student_vocab=student_dims.vocab_size, vocab_source=source, data=data,
                    data_uri=spec.data.train)
    # A kubetrain export with INL dynamics (or an SSM) is built as its folder says, as
    # model.init's is.
    model = build_model(config.architecture, dims, max_seq_len=spec.data.seq_len,
                        dynamics=config.dynamics)
    module = parallelize_frozen(model, spec.parallelism, mesh, device)
    try:
        load_pretrained(module, uri, spec.storage)
    except PretrainedError as error:
        raise teacher_error(error) from None
    return Teacher(module, distillation)
