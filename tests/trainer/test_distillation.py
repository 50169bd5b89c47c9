"""Knowledge distillation (spec.distillation): the loss, the frozen teacher, its checks, and
what it buys: a small student distilled from a trained larger teacher validates lower than
the same student trained alone; two ranks give the losses of one."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import (
    DistillationSpec,
    ModelDims,
    ParallelismSpec,
    TrainingJobSpec,
)
from kubetrain.pod_conventions import ATTEMPT_STARTED_ENV
from kubetrain.trainer import Trainer
from kubetrain.trainer.distill import Teacher, TokenizerMismatch, check_tokenizer
from kubetrain.trainer.loop import FitResult
from kubetrain.trainer.loss import chunked_cross_entropy, distillation_loss
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.parallelize import parallelize_frozen
from kubetrain.trainer.prepare import DatasetIndex
from kubetrain.trainer.pretrained_config import PretrainedError
from kubetrain.trainer.storage import open_storage

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


def test_the_chunked_loss_never_keeps_either_models_logits_for_backward() -> None:
    """What autograd saves, by size: unchunked, [tokens, vocab] logits of both models;
    in chunks of 8 tokens, nothing larger than one chunk's [8, vocab] or a weight."""
    hidden, weight, targets, teacher_hidden, teacher_weight = _inputs(tokens=64)
    hidden.requires_grad_()
    weight.requires_grad_()

    def largest_saved(chunk: int) -> int:
        sizes = [0]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = distillation_loss(hidden, weight, targets, teacher_hidden, teacher_weight,
                                     temperature=2.0, alpha=0.5, chunk=chunk).loss
        loss.backward()
        return max(sizes)

    assert largest_saved(64) >= 64 * VOCAB
    assert largest_saved(8) <= max(8 * VOCAB, weight.numel(), teacher_weight.numel())


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



# --- real training on the stdlib corpus ----------------------------------------------------

# The tiny preset's shape, trained 400 steps, teaches; a quarter-width one-layer student
# trains 100 steps alone or with it (measured: validation 6.35 alone, 6.15 distilled).
TEACHER_STEPS = 400
STUDENT_STEPS = 100
STUDENT = {"preset": "custom", "dim": 32, "nLayers": 1, "nHeads": 2, "nKvHeads": 2,
           "ffnDim": 96, "tieEmbeddings": True}


def _spec(corpus: Any, folder: Path, model: dict[str, Any], steps: int,
          **sections: Any) -> TrainingJobSpec:
    spec = {"image": "kubetrain/trainer:test", "model": model,
            "data": {"train": corpus.train_uri, "seqLen": 64},
            "optimization": {"maxSteps": steps, "microBatchSize": 8, "warmupSteps": 10,
                             "learningRate": 3e-3, "seed": 0},
            "evaluation": {"everySteps": steps, "batches": 8},
            "parallelism": {"precision": "fp32"},
            "checkpoint": {"uri": str(folder / "checkpoints"), "everySteps": 100_000,
                           "export": False},
            "metrics": {"logEverySteps": 10}, **sections}
    return parse_job({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                      "metadata": {"name": folder.name}, "spec": spec}).spec


def _fit_now(spec: TrainingJobSpec, log: Path) -> FitResult:
    """Train in this process (a group of one), its attempt beginning now: an in-process
    Trainer books its startup since the attempt began (by default, since the process did)
    into the process-wide wall-time counter, which later tests in the session read
    exactly."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ATTEMPT_STARTED_ENV, str(time.time()))
        return Trainer(spec, metrics_log=log, serve_metrics=False).fit()


def _fit(spec: TrainingJobSpec, folder: Path) -> tuple[float, list[dict[str, Any]]]:
    """Train in this process; the final validation loss and the log."""
    log = folder / "metrics.jsonl"
    result = _fit_now(spec, log)
    assert result.exit_code == 0 and result.best_val_loss is not None
    return result.best_val_loss, [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """In-process training on one CPU thread, as the launched trainers run: on a busy
    machine, OpenMP threads waiting on each other cost several times the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained_teacher(prepared_corpus: Any, tmp_path_factory: pytest.TempPathFactory,
                    one_thread: None) -> str:
    """The export (an HF Llama folder) of the tiny preset trained on the corpus."""
    folder = tmp_path_factory.mktemp("teacher")
    spec = _spec(prepared_corpus, folder, {"preset": "tiny"}, TEACHER_STEPS,
                 checkpoint={"uri": str(folder / "checkpoints"), "everySteps": 100_000})
    result = _fit_now(spec, folder / "metrics.jsonl")
    assert result.export_uri is not None
    print(f"teacher: validation loss {result.best_val_loss:.4f} after {TEACHER_STEPS} steps")
    return result.export_uri


@pytest.mark.slow
def test_a_student_distilled_from_a_trained_teacher_validates_lower_than_one_trained_alone(
        prepared_corpus: Any, trained_teacher: str, tmp_path: Path) -> None:
    alone, _ = _fit(_spec(prepared_corpus, tmp_path / "alone", STUDENT, STUDENT_STEPS),
                    tmp_path / "alone")
    distillation = {"teacher": trained_teacher, "temperature": 1.0, "alpha": 0.9}
    distilled, events = _fit(_spec(prepared_corpus, tmp_path / "distilled", STUDENT,
                                   STUDENT_STEPS, distillation=distillation),
                             tmp_path / "distilled")
    print(f"validation loss after {STUDENT_STEPS} steps: distilled {distilled:.4f}, "
          f"alone {alone:.4f} (same student, seed and data)")
    assert distilled < alone - 0.05
    steps = [e for e in events if e["event"] == "step"]
    for step in steps:  # the loss the student trained on is the two terms, weighted
        assert step["loss"] == pytest.approx(0.1 * step["ce_loss"] + 0.9 * step["kd_loss"],
                                             rel=1e-5)
    assert steps[-1]["kd_loss"] < steps[0]["kd_loss"]  # it did learn from the teacher
    (start,) = [e for e in events if e["event"] == "start"]
    assert start["output_loss"] == "distillation"


# An SSM student sized from the teacher (model.fromTeacher: the tiny preset's shape, its
# embeddings), distilled with SHC's usual settings. Measured: validation 5.86 alone,
# 5.49 from the teacher's embeddings on the labels alone, 5.46 distilled.
SSM_STUDENT = {"architecture": "ssm", "fromTeacher": True}
SSM_DISTILLATION = {"temperature": 2.0, "alpha": 0.5}


@pytest.mark.slow
def test_an_ssm_student_distilled_from_the_teacher_validates_lower_than_the_same_ssm_alone(
        prepared_corpus: Any, trained_teacher: str, tmp_path: Path) -> None:
    """The same SSM (the teacher's dimensions), steps and seed: trained alone, from the
    teacher's embeddings on the labels alone (alpha 0), and distilled. Distillation beats
    both: the embeddings alone do not explain its gain."""
    alone, _ = _fit(_spec(prepared_corpus, tmp_path / "alone",
                          {"preset": "tiny", "architecture": "ssm"}, STUDENT_STEPS),
                    tmp_path / "alone")
    embeddings, _ = _fit(_spec(prepared_corpus, tmp_path / "embeddings", SSM_STUDENT,
                               STUDENT_STEPS, distillation={"teacher": trained_teacher,
                                                            "alpha": 0.0}),
                         tmp_path / "embeddings")
    distilled, events = _fit(_spec(prepared_corpus, tmp_path / "distilled", SSM_STUDENT,
                                   STUDENT_STEPS, distillation={"teacher": trained_teacher,
                                                                **SSM_DISTILLATION}),
                             tmp_path / "distilled")
    print(f"SSM student, validation loss after {STUDENT_STEPS} steps: distilled "
          f"{distilled:.4f}, alone {alone:.4f}, from the teacher's embeddings without its "
          f"predictions {embeddings:.4f} (same dimensions, seed and data)")
    assert distilled < alone - 0.1
    assert distilled < embeddings
    steps = [e for e in events if e["event"] == "step"]
    assert steps[-1]["kd_loss"] < steps[0]["kd_loss"]  # it did learn from the teacher


@pytest.mark.slow
def test_two_ranks_distil_with_the_losses_of_one_for_the_same_global_batch(
        trained_teacher: str, tiny_job: Any, launcher: Any) -> None:
    """8 sequences per step, as 4 x 2 micro-batches on one process and 2 ranks x 2 x 2 with
    student and teacher sharded by FSDP2: the same losses, both terms, and gradient norms."""
    steps = 6

    def logged(name: str, ranks: int, micro: int) -> list[float]:
        job = tiny_job(name, model=STUDENT,
                       optimization={"maxSteps": steps, "microBatchSize": micro,
                                     "gradientAccumulationSteps": 2, "warmupSteps": 2},
                       distillation={"teacher": trained_teacher, "temperature": 2.0,
                                     "alpha": 0.5})
        events = [e for e in launcher.train(job, ranks) if e["event"] == "step"]
        assert [e["step"] for e in events] == list(range(1, steps + 1))
        return [e[key] for key in ("loss", "ce_loss", "kd_loss", "grad_norm") for e in events]

    one = logged("one-rank", 1, 4)
    two = logged("two-ranks", 2, 2)
    assert two == pytest.approx(one, rel=1e-4)
    assert min(one[:2 * steps]) > 0  # real terms, not zeros that agree by being empty


def _copy_folder(source: str, target: Path) -> Path:
    shutil.copytree(source.removeprefix("file://"), target)
    return target


@pytest.mark.slow  # its teacher is trained (the module's fixture)
def test_a_teacher_whose_tokenizer_or_vocabulary_is_not_the_datas_is_refused(
        prepared_corpus: Any, trained_teacher: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Through the trainer's own loader: a re-serialised tokenizer.json (same tokens, other
    bytes), a config.json with another vocabulary size and a teacher trained on shorter
    sequences than the data's are refused before loading."""
    from kubetrain.trainer.distill import load_teacher

    mesh: DeviceMesh = _MeshOfOne()  # type: ignore[assignment]
    other_tokenizer = _copy_folder(trained_teacher, tmp_path / "other-tokenizer")
    document = json.loads((other_tokenizer / "tokenizer.json").read_text())
    (other_tokenizer / "tokenizer.json").write_text(json.dumps(document, indent=2))
    other_vocab = _copy_folder(trained_teacher, tmp_path / "other-vocab")
    config = json.loads((other_vocab / "config.json").read_text())
    (other_vocab / "config.json").write_text(json.dumps({**config, "vocab_size": 4096}))
    short_context = _copy_folder(trained_teacher, tmp_path / "short-context")
    (short_context / "config.json").write_text(
        json.dumps({**config, "max_position_embeddings": 32}))

    index = DatasetIndex.load(open_storage(prepared_corpus.train_uri))
    for folder, expected in ((other_tokenizer, "is not the one the data was prepared with"),
                             (other_vocab, "4096 tokens"),
                             (short_context, r"seqLen \(64\) is longer than the teacher's "
                                             r"max_position_embeddings \(32\)")):
        spec = _spec(prepared_corpus, tmp_path / "student", STUDENT, 20,
                     distillation={"teacher": str(folder)})
        with pytest.raises(PretrainedError, match=expected) as refused:
            load_teacher(spec, spec.model.resolve().model_copy(update={"vocab_size": 2048}),
                         index, mesh, torch.device("cpu"))
        assert str(refused.value).startswith("spec.distillation.teacher: ")
    # The trainer refuses it as a configuration error: exit 2, which is not retried.
    from kubetrain.trainer.__main__ import EXIT_INVALID_MANIFEST, main

    job = tmp_path / "job.yaml"
    spec = _spec(prepared_corpus, tmp_path / "student", STUDENT, 20,
                 distillation={"teacher": str(other_tokenizer)})
    job.write_text(json.dumps({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                               "metadata": {"name": "student"}, "spec": spec.wire()}))
    assert main([str(job), "--metrics-log", str(tmp_path / "log.jsonl")]) == (
        EXIT_INVALID_MANIFEST)
    assert "spec.distillation.teacher: the teacher's tokenizer" in capsys.readouterr().err
    # The export itself matches: the same tokenizer bytes the data was prepared with.
    spec = _spec(prepared_corpus, tmp_path / "student", STUDENT, 20,
                 distillation={"teacher": trained_teacher})
    teacher = load_teacher(spec, spec.model.resolve().model_copy(update={"vocab_size": 2048}),
                           index, mesh, torch.device("cpu"))
    assert all(not p.requires_grad for p in teacher.module.parameters())


def test_a_kubetrain_export_with_inl_dynamics_teaches_with_its_dynamics(
        prepared_corpus: Any, tmp_path: Path) -> None:
    """A teacher exported with model.dynamics (not the default bounds, every controller
    tensor non-trivial) is built with the folder's dynamics, so load_pretrained accepts it;
    it predicts what the exported model predicts, and the student's loss distils those
    predictions."""
    from kubetrain.trainer.distill import load_teacher
    from kubetrain.trainer.export import export_model

    dynamics = {"enabled": True, "betaMax": 3.0, "velocityMax": 5.0}
    source = _spec(prepared_corpus, tmp_path / "teacher", {**STUDENT, "nLayers": 2,
                   "tieEmbeddings": False, "vocabSize": 2048, "dynamics": dynamics}, 20)
    torch.manual_seed(0)
    exported = Transformer(source.model.resolve(), max_seq_len=64,
                           dynamics=source.model.dynamics)
    with torch.no_grad():  # mu and the controller's biases start as constants
        for name, parameter in exported.named_parameters():
            if ".dynamics." in name:
                parameter.uniform_(-0.5, 0.5)
    uri = export_model(exported, exported.dims, source, rank=0)

    spec = _spec(prepared_corpus, tmp_path / "student", STUDENT, 20,
                 distillation={"teacher": uri, "temperature": 2.0, "alpha": 0.5})
    index = DatasetIndex.load(open_storage(prepared_corpus.train_uri))
    mesh: DeviceMesh = _MeshOfOne()  # type: ignore[assignment]
    student_dims = spec.model.resolve().model_copy(update={"vocab_size": 2048})
    teacher = load_teacher(spec, student_dims, index, mesh, torch.device("cpu"))
    assert teacher.module.has_dynamics
    block = teacher.module.layers[0].dynamics
    assert block is not None and (block.beta_max, block.velocity_max) == (3.0, 5.0)

    torch.manual_seed(1)
    student = Transformer(student_dims, max_seq_len=64)
    tokens = torch.randint(0, 2048, (2, 65))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        teacher_logits = exported.eval()(inputs).flatten(0, 1)
        torch.testing.assert_close(teacher.module(inputs).flatten(0, 1), teacher_logits)
        student_logits = student(inputs).flatten(0, 1)
        student.output_loss = teacher.student_loss(student.output_loss)
        teacher.teach(inputs)
        loss = student(inputs, targets)
        ce, kd = teacher.terms()
    expected_kd = 4.0 * F.kl_div(F.log_softmax(student_logits / 2, dim=-1),
                                 F.log_softmax(teacher_logits / 2, dim=-1),
                                 reduction="sum", log_target=True)
    torch.testing.assert_close(kd, expected_kd, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(loss, 0.5 * ce + 0.5 * kd)
    assert float(kd) > 0


def test_the_two_terms_reach_prometheus_the_metrics_log_and_the_progress_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kubetrain.trainer.metrics import REGISTRY, Reporter, StepReport

    spec = parse_job({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                      "metadata": {"name": "reported"},
                      "spec": {"image": "x", "data": {"train": "s3://d/train"},
                               "checkpoint": {"uri": str(tmp_path / "checkpoints")},
                               "distillation": {"teacher": "s3://models/teacher"}}}).spec
    reporter = Reporter(spec, enabled=True, metrics_log=tmp_path / "log.jsonl",
                        job_name="reported", serve=False)
    try:
        reporter.logged(StepReport(step=3, epoch=0.1, loss=4.25, learning_rate=1e-3,
                                   grad_norm=0.5, tokens_per_second=100.0, mfu=0.0,
                                   step_time=0.1, data_wait_ratio=0.0, ce_loss=6.5,
                                   kd_loss=2.0), torch.device("cpu"))
    finally:
        reporter.close()
    assert REGISTRY.get_sample_value("kubetrain_ce_loss") == 6.5
    assert REGISTRY.get_sample_value("kubetrain_kd_loss") == 2.0
    (event,) = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert (event["loss"], event["ce_loss"], event["kd_loss"]) == (4.25, 6.5, 2.0)
    assert "loss 4.2500 | ce 6.5000 | kd 2.0000 | lr" in capsys.readouterr().out

    # The next job, without a teacher, exports neither term: no 0, no stale value.
    plain = spec.model_copy(update={"distillation": None})
    Reporter(plain, enabled=True, metrics_log=tmp_path / "plain.jsonl", job_name="plain",
             serve=False).close()
    assert REGISTRY.get_sample_value("kubetrain_ce_loss") is None
    assert REGISTRY.get_sample_value("kubetrain_kd_loss") is None
