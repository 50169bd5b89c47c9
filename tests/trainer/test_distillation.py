"""Knowledge distillation (spec.distillation): the loss, the frozen teacher, its checks, and
what it buys: a small student distilled from a trained larger teacher validates lower than
the same student trained alone; two ranks give the losses of one."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from kubetrain.api.trainingjob import DistillationSpec, ModelDims, ParallelismSpec
from kubetrain.trainer.distill import Teacher, TokenizerMismatch, check_tokenizer
from kubetrain.trainer.loss import chunked_cross_entropy, distillation_loss
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.parallelize import parallelize_frozen
from kubetrain.trainer.prepare import DatasetIndex

VOCAB = 300


def _inputs(tokens: int = 50, dim: int = 16, teacher_dim: int = 24, seed: int = 0):  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=generator)
    weight = torch.randn(VOCAB, dim, generator=generator) * 0.3
    teacher_hidden = torch.randn(tokens, teacher_dim, generator=generator)
    teacher_weight = torch.randn(VOCAB, teacher_dim, generator=generator) * 0.3
    targets = torch.randint(0, VOCAB, (tokens,), generator=generator)
    return hidden, weight, targets, teacher_hidden, teacher_weight


def _by_hand(hidden, weight, targets, teacher_hidden, teacher_weight,  # type: ignore[no-untyped-def]
             temperature: float, alpha: float):
    """The issue's formula on the whole logits: (1 - a) CE + a T^2 KL(p_teacher || p_student)."""
    student = hidden @ weight.t()
    teacher = teacher_hidden @ teacher_weight.t()
    ce = F.cross_entropy(student, targets, reduction="sum")
    p_teacher = F.softmax(teacher / temperature, dim=-1)
    kl = (p_teacher * (p_teacher.log() - F.log_softmax(student / temperature, dim=-1))).sum()
    return (1 - alpha) * ce + alpha * temperature**2 * kl, ce, temperature**2 * kl


@pytest.mark.parametrize(("temperature", "alpha"), [(1.0, 0.5), (2.0, 0.7), (4.0, 1.0)])
def test_the_loss_is_the_formula_computed_by_hand(temperature: float, alpha: float) -> None:
    inputs = _inputs()
    losses = distillation_loss(*inputs, temperature=temperature, alpha=alpha)
    loss, ce, kd = _by_hand(*inputs, temperature=temperature, alpha=alpha)
    torch.testing.assert_close(losses.loss, loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(losses.ce, ce, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(losses.kd, kd, rtol=1e-5, atol=1e-4)
    assert float(kd) > 0  # two different models: the KL term is not trivially zero


def test_the_temperature_scales_the_kl_term_by_its_square() -> None:
    """At T the term is T^2 x KL of the softened distributions: the same KL (through
    F.kl_div) divided by T, then by the T^2 scaling, gives the raw KL back."""
    hidden, weight, targets, teacher_hidden, teacher_weight = _inputs()
    temperature = 3.0
    kd = distillation_loss(hidden, weight, targets, teacher_hidden, teacher_weight,
                           temperature=temperature, alpha=1.0).kd
    kl = F.kl_div(F.log_softmax(hidden @ weight.t() / temperature, dim=-1),
                  F.softmax(teacher_hidden @ teacher_weight.t() / temperature, dim=-1),
                  reduction="sum")
    torch.testing.assert_close(kd / temperature**2, kl, rtol=1e-5, atol=1e-5)


def test_alpha_zero_is_plain_cross_entropy_with_its_gradients() -> None:
    hidden, weight, targets, teacher_hidden, teacher_weight = _inputs()
    student = hidden.clone().requires_grad_()
    distilled = distillation_loss(student, weight, targets, teacher_hidden, teacher_weight,
                                  temperature=2.0, alpha=0.0).loss
    distilled.backward()
    plain_hidden = hidden.clone().requires_grad_()
    plain = chunked_cross_entropy(plain_hidden, weight, targets)
    plain.backward()
    torch.testing.assert_close(distilled, plain)
    torch.testing.assert_close(student.grad, plain_hidden.grad)


def test_gradients_reach_only_the_student() -> None:
    hidden, weight, targets, teacher_hidden, teacher_weight = (
        t.requires_grad_() if t.is_floating_point() else t for t in _inputs())
    distillation_loss(hidden, weight, targets, teacher_hidden, teacher_weight,
                      temperature=2.0, alpha=0.5).loss.backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    assert weight.grad is not None and weight.grad.abs().sum() > 0
    assert teacher_hidden.grad is None and teacher_weight.grad is None


@pytest.mark.parametrize("chunk", [1, 7, 50])
def test_chunked_equals_unchunked_loss_and_gradients_in_fp32(chunk: int) -> None:
    def run(chunk_tokens: int):  # type: ignore[no-untyped-def]
        hidden, weight, targets, teacher_hidden, teacher_weight = _inputs()
        hidden.requires_grad_()
        weight.requires_grad_()
        with torch.enable_grad():
            losses = distillation_loss(hidden, weight, targets, teacher_hidden, teacher_weight,
                                       temperature=2.0, alpha=0.5, chunk=chunk_tokens)
        losses.loss.backward()
        return losses, hidden.grad, weight.grad

    whole, hidden_grad, weight_grad = run(10_000)
    chunked, chunked_hidden_grad, chunked_weight_grad = run(chunk)
    for actual, expected in ((chunked.loss, whole.loss), (chunked.ce, whole.ce),
                             (chunked.kd, whole.kd), (chunked_hidden_grad, hidden_grad),
                             (chunked_weight_grad, weight_grad)):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


# --- the teacher and its checks ---------------------------------------------------------

TEACHER_DIMS = ModelDims(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB,
                         ffn_dim=64, tie_embeddings=False, rope_theta=10000.0)
STUDENT_DIMS = TEACHER_DIMS.model_copy(update={"dim": 16, "n_layers": 1, "ffn_dim": 32})


def _index(vocab: int = VOCAB, sha256: str = "a" * 64) -> DatasetIndex:
    return DatasetIndex(dtype="uint16", vocab_size=vocab, eos_token_id=0,
                        tokenizer_sha256=sha256, shard_tokens=1024, shards=())


def test_a_teacher_with_another_vocabulary_is_refused_naming_both_sizes() -> None:
    with pytest.raises(TokenizerMismatch) as refused:
        check_tokenizer("s3://models/teacher", 32_000, None, student_vocab=2048,
                        vocab_source="the data's tokenizer", data=_index(2048),
                        data_uri="s3://data/train")
    message = str(refused.value)
    assert message.startswith("spec.distillation.teacher: ")
    assert "32000 tokens" in message and "2048 tokens" in message
    assert "s3://models/teacher/config.json" in message


def test_a_teacher_with_another_tokenizer_of_the_same_size_is_refused_naming_both_hashes(
        ) -> None:
    teacher_sha = hashlib.sha256(b"another tokenizer").hexdigest()
    data_sha = hashlib.sha256(b"the data's tokenizer").hexdigest()
    with pytest.raises(TokenizerMismatch) as refused:
        check_tokenizer("s3://models/teacher", VOCAB, teacher_sha, student_vocab=VOCAB,
                        vocab_source="the data's tokenizer", data=_index(sha256=data_sha),
                        data_uri="s3://data/train")
    message = str(refused.value)
    assert teacher_sha[:16] in message and data_sha[:16] in message
    assert "s3://models/teacher/tokenizer.json" in message and "s3://data/train" in message
    assert "--tokenizer s3://models/teacher/tokenizer.json" in message  # what to do


def test_a_matching_teacher_passes_and_one_without_tokenizer_json_is_checked_by_size() -> None:
    data_sha = hashlib.sha256(b"the data's tokenizer").hexdigest()
    for teacher_sha in (data_sha, None):
        check_tokenizer("s3://models/teacher", VOCAB, teacher_sha, student_vocab=VOCAB,
                        vocab_source="the data's tokenizer", data=_index(sha256=data_sha),
                        data_uri="s3://data/train")


class _MeshOfOne:
    """A DeviceMesh of one process, as far as parallelize_frozen looks at it."""

    def size(self) -> int:
        return 1


def _teacher() -> Teacher:
    torch.manual_seed(0)
    mesh: DeviceMesh = _MeshOfOne()  # type: ignore[assignment]
    module = parallelize_frozen(Transformer(TEACHER_DIMS, max_seq_len=16),
                                ParallelismSpec(precision="fp32"), mesh, torch.device("cpu"))
    return Teacher(module, DistillationSpec(teacher="unused", temperature=2.0, alpha=0.5))


def test_the_teacher_is_frozen_in_eval_mode_and_only_the_student_is_optimised() -> None:
    teacher = _teacher()
    assert not teacher.module.training
    assert all(not p.requires_grad for p in teacher.module.parameters())
    torch.manual_seed(1)
    student = Transformer(STUDENT_DIMS, max_seq_len=16)
    student.output_loss = teacher.student_loss(student.output_loss)
    optimizer = torch.optim.AdamW(student.parameters())
    tokens = torch.randint(0, VOCAB, (2, 17))
    teacher.teach(tokens[:, :-1])
    student(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    assert all(p.grad is None for p in teacher.module.parameters())
    teacher_ids = {id(p) for p in teacher.module.parameters()}
    optimised = [p for group in optimizer.param_groups for p in group["params"]]
    assert optimised and not teacher_ids & {id(p) for p in optimised}
    assert not teacher_ids & {id(p) for p in optimizer.state}  # no optimizer state either
    assert all(student_p.grad is not None for student_p in student.parameters())


def test_the_student_loss_distils_after_a_teacher_pass_and_is_plain_cross_entropy_without(
        ) -> None:
    teacher = _teacher()
    torch.manual_seed(1)
    student = Transformer(STUDENT_DIMS, max_seq_len=16)
    tokens = torch.randint(0, VOCAB, (2, 17))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        plain = student(inputs, targets)
        teacher_logits = teacher.module(inputs).flatten(0, 1)
        student_logits = student(inputs).flatten(0, 1)
        student.output_loss = teacher.student_loss(student.output_loss)
        teacher.teach(inputs)
        distilled = student(inputs, targets)
        ce, kd = teacher.terms()
        evaluated = student(inputs, targets)  # no teacher pass before it: the labels alone
    expected_kd = 4.0 * F.kl_div(F.log_softmax(student_logits / 2, dim=-1),
                                 F.log_softmax(teacher_logits / 2, dim=-1),
                                 reduction="sum", log_target=True)
    torch.testing.assert_close(ce, plain)
    torch.testing.assert_close(kd, expected_kd, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(distilled, 0.5 * plain + 0.5 * expected_kd, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(evaluated, plain)

