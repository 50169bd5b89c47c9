"""The trained model as a Hugging Face checkpoint of its family: safetensors, config, tokenizer.

Use (collective, every rank, at the end of training):

    uri = export_model(model, dims, spec, rank=rank)   # -> "<checkpoint uri>/export"

writes to `<spec.checkpoint.uri>/export`:

    model.safetensors        fp32 weights under the family's *ForCausalLM names
    config.json              the family's config (hf_families.py: LlamaForCausalLM,
                             Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM or
                             Gemma3ForCausalLM)
    generation_config.json
    tokenizer.json           the tokenizer the data was prepared with
    tokenizer_config.json    so AutoTokenizer loads it as a PreTrainedTokenizerFast

so that `AutoModelForCausalLM.from_pretrained(folder)` and
`AutoTokenizer.from_pretrained(folder)` load it (except a model with INL
dynamics: see the end of this docstring). When the data was prepared with the
tokenizer of the model.init folder (the same tokenizer.json), the folder's own
tokenizer files (tokenizer_config.json with its chat template and special tokens,
special_tokens_map.json, chat_template.jinja) and its generation_config.json and
token ids are carried into the export instead of the generic ones. The weights are
gathered from FSDP2 / DDP shards with DCP's full state dict (on every rank), then
rank 0 maps the names and writes the files.

The one non-trivial mapping: kubetrain's rotary embedding rotates interleaved
channel pairs (Meta's original Llama layout) while transformers rotates the two
halves of each head, so the rows of the query and key projections (and of their
biases and per-head norms, where the family has them) are permuted per head - the
same permutation as transformers' own Llama conversion script.

A model with INL dynamics (`model.dynamics.enabled`) is not a Llama, and
transformers has no class for it, so its export says so instead of passing for
one. Its config.json holds every LlamaConfig field above, except:

    "architectures": ["KubetrainDynamicsForCausalLM"],
    "model_type": "kubetrain_dynamics",
    "kubetrain": {"dynamics": {"betaMax": 2.0, "velocityMax": 10.0, "controllerWidth": 64}}

The unregistered model_type makes `AutoConfig`/`AutoModelForCausalLM.from_pretrained`
refuse the folder with an error. (With model_type "llama" transformers would load
the Llama weights, drop the dynamics tensors with only a warning, and compute
something else.) model.safetensors holds the Llama tensors under the names above
and, for each block i, the dynamics tensors (see model.Dynamics) under

    model.layers.{i}.dynamics.equilibrium            [hidden_size]  mu
    model.layers.{i}.dynamics.controller_in.weight   [controllerWidth, hidden_size]
    model.layers.{i}.dynamics.controller_in.bias     [controllerWidth]
    model.layers.{i}.dynamics.controller_out.weight  [3 * hidden_size, controllerWidth]
    model.layers.{i}.dynamics.controller_out.bias    [3 * hidden_size]

where controller_out's rows are alpha's, then beta's, then the gate's. The
dynamics act on the hidden state in kubetrain's channel order, which the q/k row
permutation does not touch. `kubetrain generate` samples from such a model's
checkpoints; the export prints that transformers cannot load it. The marker's
format is pretrained_config.py's (`dynamics_config`), shared with the reader.

`model.init` reads these folders back (pretrained.py), inverting the export
exactly, a model with dynamics included: it builds the model with
`model.dynamics` = {enabled: true, betaMax, velocityMax} from the `kubetrain`
block (a controllerWidth other than this version's is refused) and maps
`model.layers.{i}.dynamics.*` back to `layers.{i}.dynamics.*` unchanged.
`hf_name` is the one name mapping both directions use.

A state-space model (`model.architecture: ssm`, ssm.py) is not a Llama either, and is
marked the same way (`pretrained_config.ssm_config`):

    "architectures": ["KubetrainSSMForCausalLM"],
    "model_type": "kubetrain_ssm",
    "kubetrain": {"ssm": {"expand": 2, "stateSize": 64, "convWidth": 4}}

beside the LlamaConfig fields that give its dimensions (hidden_size, layers, heads -
whose size is the SSM heads' - key/value heads - the groups sharing B and C -,
intermediate_size, vocabulary; rope_theta is kept only so the dimensions read back
exactly). Its embeddings, final norm, output projection and feed-forward tensors have
the Llama names above; each block's mixer and its norm keep kubetrain's own names:

    model.layers.{i}.mixer_norm.weight    [hidden_size]
    model.layers.{i}.mixer.in_proj.weight [2·inner + 2·groups·stateSize + heads, hidden_size]
    model.layers.{i}.mixer.conv.weight    [inner + 2·groups·stateSize, 1, convWidth]
    model.layers.{i}.mixer.conv.bias, .dt_bias, .a_log (A = -exp(a_log)), .skip (D),
    model.layers.{i}.mixer.norm.weight, model.layers.{i}.mixer.out_proj.weight

(inner = expand x hidden_size). model.init and `kubetrain generate` load it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from kubetrain.api.trainingjob import DynamicsSpec, ModelDims, TrainingJobSpec
from kubetrain.trainer.hf_families import HF_FAMILIES, ROTATED_ROWS, block_name, write_config
from kubetrain.trainer.prepare import END_OF_TEXT, TOKENIZER_NAME, end_of_text
from kubetrain.trainer.pretrained_config import (
    CONFIG_NAME,
    DYNAMICS_ARCHITECTURE,
    SSM_ARCHITECTURE,
    dynamics_config,
    ssm_config,
)
from kubetrain.trainer.storage import open_object, open_storage

EXPORT_FOLDER = "export"
# Wrappers that parallelize() may add around modules; they are not part of the names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")

# The files of a model.init folder's tokenizer that its export carries (module docstring).
CARRIED_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json",
                           "chat_template.jinja", "generation_config.json")


def _interleaved_to_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder the rows of a q/k projection (its weight, bias or per-head norm) from
    pair-interleaved to half-split, per head."""
    rows = weight.shape[0]
    return (weight.view(heads, rows // heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def hf_name(name: str, dims: ModelDims) -> str | None:
    """The transformers name of a kubetrain parameter in its family's *ForCausalLM
    (wrappers' prefixes ignored); the INL dynamics' keep their own names under
    `model.layers.{i}.`.

    None for the output projection of a tied model: transformers has no tensor for it.
    """
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    if name == "tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return None if dims.tie_embeddings else "lm_head.weight"
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        if (hf := block_name(rest, dims)) is not None:
            return f"model.layers.{index}.{hf}"
        if rest.startswith(("dynamics.", "mixer.", "mixer_norm.")):
            return f"model.layers.{index}.{rest}"  # kubetrain's own; transformers has none
    raise ValueError(f"no Hugging Face name for the model weight {name!r}")


def hf_state_dict(state: dict[str, torch.Tensor], dims: ModelDims) -> dict[str, torch.Tensor]:
    """kubetrain Transformer weights under its family's transformers names and layout."""
    converted: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        target = hf_name(name, dims)
        if target is None:
            continue
        tensor = tensor.detach().to(torch.float32).contiguous()
        if target.endswith(ROTATED_ROWS):
            tensor = _interleaved_to_halves(tensor, tensor.shape[0] // dims.head_size)
        converted[target] = tensor.contiguous()
    return converted


def hf_config(dims: ModelDims, max_seq_len: int, eos_token_id: int,
              dynamics: DynamicsSpec | None = None,
              architecture: str = "transformer") -> dict[str, Any]:
    """The config.json describing a model of these dimensions as its family's (see
    hf_families.py); with dynamics, or as an SSM (`architecture` ssm), marked as
    kubetrain's own architecture (see the module docstring)."""
    config = write_config(dims, max_seq_len, eos_token_id)
    if dynamics is not None and dynamics.enabled:
        config.update(dynamics_config(dynamics))
    if architecture == "ssm":
        config.update(ssm_config())
    return config


def export_format(spec: TrainingJobSpec, dims: ModelDims) -> str:
    """What reads the job's export, in words for the run's summary."""
    if spec.model.architecture == "ssm":
        return "kubetrain SSM, model_type kubetrain_ssm, for model.init and kubetrain generate"
    if spec.model.dynamics.enabled:
        return "Llama with INL dynamics, for model.init and kubetrain generate"
    return f"Hugging Face {HF_FAMILIES[dims.family].architecture}"


def _carried_tokenizer(spec: TrainingJobSpec,
                       tokenizer_json: bytes) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The tokenizer files (`CARRIED_TOKENIZER_FILES`) and config.json token ids of the
    folder the model started from - model.init, or a fromTeacher student's teacher - when
    the data was prepared with that folder's tokenizer.json; nothing otherwise."""
    sources = [spec.model.init]
    if spec.model.from_teacher and spec.distillation is not None:
        sources.append(spec.distillation.teacher)
    for uri in sources:
        if uri is None:
            continue
        store = open_storage(uri, spec.storage)
        if not store.exists(TOKENIZER_NAME) or store.read_bytes(TOKENIZER_NAME) != tokenizer_json:
            continue
        files = {name: store.read_bytes(name) for name in CARRIED_TOKENIZER_FILES
                 if store.exists(name)}
        config = json.loads(store.read_bytes(CONFIG_NAME))
        config = {**(config.get("text_config") or {}), **config}  # an image-text model's too
        ids = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
               if config.get(key) is not None}
        return files, ids
    return {}, {}


def export_model(model: torch.nn.Module, dims: ModelDims, spec: TrainingJobSpec, *,
                 rank: int) -> str:
    """Write the model, its config and tokenizer to `<checkpoint uri>/export` (collective).

    Returns the export URI on every rank.
    """
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    state = {
        name: value for name, value in get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        ).items() if isinstance(value, torch.Tensor)
    }
    target = open_storage(spec.checkpoint.uri, spec.storage).join(EXPORT_FOLDER)
    if rank != 0:
        return target.uri
    tokenizer_uri = spec.data.tokenizer or f"{spec.data.train.rstrip('/')}/{TOKENIZER_NAME}"
    folder, key = open_object(tokenizer_uri, spec.storage)
    tokenizer_json = folder.read_bytes(key)
    try:
        eos_token, eos_id = end_of_text(Tokenizer.from_str(tokenizer_json.decode()))
    except ValueError:  # data prepared elsewhere, without a document separator
        eos_token, eos_id = END_OF_TEXT, 0
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "model.safetensors"
        save_file(hf_state_dict(state, dims), str(weights), metadata={"format": "pt"})
        target.upload_file(weights, "model.safetensors")
    carried, token_ids = _carried_tokenizer(spec, tokenizer_json)
    config = hf_config(dims, spec.data.seq_len, eos_id, spec.model.dynamics,
                       spec.model.architecture) | token_ids
    files = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": eos_id, "eos_token_id": eos_id},
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "eos_token": eos_token, "bos_token": eos_token,
                                  "model_max_length": spec.data.seq_len},
    }
    for name, document in files.items():
        if name not in carried:
            target.write_bytes(name, json.dumps(document, indent=1).encode())
    for name, data in carried.items():
        target.write_bytes(name, data)
    target.write_bytes(TOKENIZER_NAME, tokenizer_json)
    if spec.model.dynamics.enabled:
        print(f"exported a model with INL dynamics to {target.uri}: Hugging Face transformers "
              f"cannot load it (config.json says architectures {DYNAMICS_ARCHITECTURE}); "
              "model.init of another job loads it, and `kubetrain generate --checkpoint` "
              "samples from its checkpoints", flush=True)
    if spec.model.architecture == "ssm":
        print(f"exported a state-space model to {target.uri}: Hugging Face transformers "
              f"cannot load it (config.json says architectures {SSM_ARCHITECTURE}); "
              "model.init of another job loads it, and `kubetrain generate --checkpoint` "
              "samples from its checkpoints", flush=True)
    return target.uri
