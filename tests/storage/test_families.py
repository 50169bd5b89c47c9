"""Every model family against transformers itself: import, train, export, generate.

For each family - Llama 3.1 (rope scaling), Qwen2/2.5 (q/k/v biases), Qwen3 (q/k head
norms, wide heads), Mistral (a sliding window on every layer) and Gemma 3 (GeGLU,
1 + w norms, sqrt(dim) embeddings, norms after each branch, local layers with their own
rotary base between global ones with a stretched one, its own attention scale) - a tiny
random model built by transformers from its own config class (no downloads) is saved with
`save_pretrained` beside the corpus's tokenizer, a chat template and a generation config,
as a folder from the hub would be. Then: kubetrain's import computes transformers' logits
(fp32, within 1e-5); a job started from it trains a few steps, and transformers loads the
export as the same *ForCausalLM with no missing or unexpected key, computing the logits of
the job's checkpoint, generating greedily what `kubetrain generate` does, and carrying the
folder's tokenizer files. Configurations a family's block cannot build are refused naming
the key; the older config layout most hub folders have reads the same; and students
distil from teachers of other families, a state-space student included.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import TrainingJobSpec
from kubetrain.pod_conventions import ATTEMPT_STARTED_ENV
from kubetrain.trainer.loop import FitResult, Trainer
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.prepare import END_OF_TEXT, TOKENIZER_NAME, PreparedDataset
from kubetrain.trainer.pretrained import load_pretrained
from kubetrain.trainer.pretrained_config import PretrainedError, read_config

# Checkpoints and exports are collectives: these tests run in a one-process group.
pytestmark = pytest.mark.usefixtures("process_group")

LOGIT_TOLERANCE = 1e-5  # absolute and relative, fp32 on CPU
VOCAB = 2048  # the prepared corpus's tokenizer
SEQ = 64
WINDOW = 24  # shorter than the sequence: local layers do attend through their window
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def _configs() -> dict[str, transformers.PretrainedConfig]:
    """Each family's tiny configuration, as transformers' own config classes write it."""
    return {
        "llama": transformers.LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}),
        "qwen2": transformers.Qwen2Config(**COMMON, rope_parameters={
            "rope_type": "default", "rope_theta": 5000.0}),
        "qwen3": transformers.Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=True),
        "mistral": transformers.MistralConfig(**COMMON, head_dim=24, sliding_window=WINDOW),
        "gemma3": transformers.Gemma3TextConfig(
            **COMMON, head_dim=24, sliding_window=WINDOW, query_pre_attn_scalar=20,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 100_000.0},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 1000.0}}),
    }


FAMILIES = list(_configs())
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
           "gemma3": "Gemma3ForCausalLM"}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory,
               prepared_corpus: PreparedDataset) -> dict[str, Path]:
    """Each family's model folder, written by transformers, with the corpus's tokenizer."""
    root = tmp_path_factory.mktemp("families")
    tokenizer = Path(prepared_corpus.tokenizer_uri.removeprefix("file://")).read_bytes()
    eos = prepared_corpus.train.eos_token_id
    folders = {}
    for family, config in _configs().items():
        config.bos_token_id = config.eos_token_id = eos
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # non-trivial norms and biases, so a misplaced one would show
            for name, parameter in model.named_parameters():
                if name.endswith(("norm.weight", ".bias")):
                    parameter.uniform_(-0.5, 0.5) if family == "gemma3" or name.endswith(
                        ".bias") else parameter.uniform_(0.5, 1.5)
        folders[family] = root / family
        model.save_pretrained(folders[family])
        (folders[family] / TOKENIZER_NAME).write_bytes(tokenizer)
        (folders[family] / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END_OF_TEXT,
            "bos_token": END_OF_TEXT, "chat_template": CHAT_TEMPLATE}))
    return folders


def _job(corpus: PreparedDataset, folder: Path, model: dict[str, Any],
         **sections: Any) -> TrainingJobSpec:
    spec = {"image": "trainer", "model": model,
            "data": {"train": corpus.train_uri, "seqLen": SEQ},
            # A small step: the model moves, and still says varied things to generate.
            "optimization": {"maxSteps": 3, "warmupSteps": 0, "microBatchSize": 2,
                             "learningRate": 1e-4},
            "evaluation": {"everySteps": 0},
            "parallelism": {"precision": "fp32"},
            "checkpoint": {"uri": str(folder / "checkpoints"), "everySteps": 1000},
            "metrics": {"logEverySteps": 1}, **sections}
    return parse_job({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                      "metadata": {"name": "family"}, "spec": spec}).spec


def _fit(spec: TrainingJobSpec, log: Path) -> FitResult:
    """Train in this process, the attempt beginning now (as test_pretrained.py's tests)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ATTEMPT_STARTED_ENV, str(time.time()))
        result = Trainer(spec, metrics_log=log, serve_metrics=False).fit()
    assert result.exit_code == 0
    return result


def _tokens(length: int = 100) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_model_of_each_family_imports_with_the_same_logits(
        family: str, hf_folders: dict[str, Path]) -> None:
    folder = hf_folders[family]
    config = read_config(str(folder), None)
    assert config.dims.family == family
    model = Transformer(config.dims, max_seq_len=128)
    load_pretrained(model, str(folder), None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ours, theirs = model(_tokens()), hf(_tokens()).logits
    print(f"{family}: max |logit difference| = {(ours - theirs).abs().max().item():.3g}")
    torch.testing.assert_close(ours, theirs, rtol=LOGIT_TOLERANCE, atol=LOGIT_TOLERANCE)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_and_exports_what_transformers_loads_computes_and_generates(
        family: str, hf_folders: dict[str, Path], prepared_corpus: PreparedDataset,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kubetrain.cli import main
    from kubetrain.trainer.generate import load_model

    folder = hf_folders[family]
    result = _fit(_job(prepared_corpus, tmp_path, {"preset": "custom", "init": str(folder)}),
                  tmp_path / "log.jsonl")
    assert result.export_uri is not None
    exported = Path(result.export_uri.removeprefix("file://"))

    hf, loading = transformers.AutoModelForCausalLM.from_pretrained(
        exported, dtype=torch.float32, output_loading_info=True)
    assert type(hf).__name__ == CLASSES[family]
    assert not any(loading.values()), loading  # no missing, unexpected or mismatched keys
    trained = load_model(str(tmp_path / "checkpoints")).model
    tokens = _tokens(SEQ)
    with torch.no_grad():
        ours, theirs = trained(tokens), hf(tokens).logits
        started = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert not torch.allclose(started(tokens).logits, theirs, atol=1e-3)  # it trained
    torch.testing.assert_close(ours, theirs, rtol=LOGIT_TOLERANCE, atol=LOGIT_TOLERANCE)

    # The folder's tokenizer came through: its template, special tokens and token ids.
    for name in ("tokenizer_config.json", TOKENIZER_NAME):
        assert (exported / name).read_bytes() == (folder / name).read_bytes(), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert tokenizer.chat_template == CHAT_TEMPLATE

    # Greedy text: `kubetrain generate` from the checkpoint, transformers from the export.
    prompt = "def add(a, b):"
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "checkpoints"), "--prompt", prompt,
                 "--temperature", "0", "--max-tokens", "12"]) == 0
    ours_text = capsys.readouterr().out.removesuffix("\n")  # print's own
    inputs = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
    generated = hf.generate(**inputs, max_new_tokens=12, do_sample=False)
    theirs_text = tokenizer.decode(generated[0], skip_special_tokens=True)
    print(f"{family}: {ours_text!r}")
    assert ours_text == theirs_text
    assert len(ours_text) > len(prompt)


def _edited(folder: Path, to: Path, **changes: Any) -> Path:
    shutil.copytree(folder, to)
    config = json.loads((to / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (to / "config.json").write_text(json.dumps(config))
    return to


@pytest.mark.parametrize(("family", "changes", "message"), [
    ("qwen3", {"use_sliding_window": True},
     "has use_sliding_window: true: kubetrain builds qwen3's attention over the whole sequence"),
    ("qwen3", {"attention_bias": True},
     "has attention_bias: true: in kubetrain's qwen3 block none of the projections"),
    ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "has rope_parameters with rope_type 'yarn': kubetrain builds qwen2's rotary embeddings "
     "as rope_type default, unscaled"),
    ("mistral", {"sliding_window": 0}, "needs sliding_window as a positive integer or null"),
    ("gemma3", {"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
     "kubetrain builds gemma3's local and global layers as every Nth layer global"),
    ("gemma3", {"hidden_activation": "gelu"},
     "has hidden_activation 'gelu': kubetrain's gemma3 feed-forward is GeGLU"),
    ("gemma3", {"final_logit_softcapping": 30.0},
     "has final_logit_softcapping 30.0: kubetrain's gemma3 has no logit soft-capping"),
    ("gemma3", {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}},
     "kubetrain scales only the global layers' rotary frequencies"),
    ("llama", {"sliding_window": None, "layer_types": ["sliding_attention"] * 3},
     "kubetrain's llama layers all attend over the whole sequence"),
])
def test_what_a_familys_block_does_not_have_is_refused_naming_the_key(
        family: str, changes: dict[str, Any], message: str, hf_folders: dict[str, Path],
        tmp_path: Path) -> None:
    folder = _edited(hf_folders[family], tmp_path / "model", **changes)
    with pytest.raises(PretrainedError) as refused:
        read_config(str(folder), None)
    assert str(refused.value).startswith(f"model.init: config.json at file://{folder} ")
    assert message in str(refused.value)


def test_the_older_config_layout_of_hub_folders_reads_the_same_dimensions(
        hf_folders: dict[str, Path], tmp_path: Path) -> None:
    """transformers 4 wrote rope_theta and rope_scaling, and Gemma 3's local base and its
    every-Nth-layer pattern, where transformers 5 writes rope_parameters and layer_types."""
    gemma = _edited(hf_folders["gemma3"], tmp_path / "gemma3", rope_parameters=None,
                    layer_types=None, rope_theta=100_000.0, rope_local_base_freq=1000.0,
                    rope_scaling={"rope_type": "linear", "factor": 4.0},
                    sliding_window_pattern=2)
    llama = _edited(hf_folders["llama"], tmp_path / "llama", rope_parameters=None,
                    rope_theta=500_000.0, rope_scaling={
                        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    for family, older in (("gemma3", gemma), ("llama", llama)):
        assert read_config(str(older), None).dims == read_config(
            str(hf_folders[family]), None).dims, family


def test_a_gemma3_image_text_folder_imports_its_text_decoder_with_the_same_logits(
        tmp_path: Path) -> None:
    """Gemma 3 from 4B up is an image-text model on the hub (Gemma3ForConditionalGeneration,
    text_config, tensors under language_model.*): model.init reads the text decoder and
    leaves the vision tower."""
    text = {key: value for key, value in COMMON.items() if key != "max_position_embeddings"}
    config = transformers.Gemma3Config(
        text_config={**text, "head_dim": 24, "sliding_window": WINDOW,
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
        mm_tokens_per_image=4)
    torch.manual_seed(1)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path / "gemma3")
    read = read_config(str(tmp_path / "gemma3"), None)
    assert (read.image_text, read.dims.family, read.dims.sliding_window) == (True, "gemma3",
                                                                              WINDOW)
    model = Transformer(read.dims, max_seq_len=128)
    load_pretrained(model, str(tmp_path / "gemma3"), None)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "gemma3",
                                                                 dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens()), hf(input_ids=_tokens()).logits,
                                   rtol=LOGIT_TOLERANCE, atol=LOGIT_TOLERANCE)


def test_students_distil_from_teachers_of_other_families_and_an_ssm_from_any(
        hf_folders: dict[str, Path], prepared_corpus: PreparedDataset, tmp_path: Path) -> None:
    """A Qwen3 student from a Gemma 3 teacher, and a state-space student sized from that
    teacher (model.fromTeacher), each a few steps: the distillation term is there, and each
    export says what it is."""
    teacher = {"teacher": str(hf_folders["gemma3"]), "temperature": 2.0, "alpha": 0.5}
    students = {"qwen3": {"preset": "custom", "init": str(hf_folders["qwen3"])},
                "ssm": {"architecture": "ssm", "fromTeacher": True}}
    for name, model in students.items():
        log = tmp_path / name / "log.jsonl"
        result = _fit(_job(prepared_corpus, tmp_path / name, model, distillation=teacher), log)
        events = [json.loads(line) for line in log.read_text().splitlines()]
        steps = [event for event in events if event["event"] == "step"]
        assert steps and all(step["kd_loss"] > 0 for step in steps), name
        assert result.export_uri is not None
        config = json.loads(Path(result.export_uri.removeprefix("file://"), "config.json")
                            .read_text())
        assert config["model_type"] == {"qwen3": "qwen3", "ssm": "kubetrain_ssm"}[name]
