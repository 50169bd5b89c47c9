"""The trained model as a Hugging Face Llama checkpoint: safetensors, config and tokenizer.

Use (collective, every rank, at the end of training):

    uri = export_model(model, dims, spec, rank=rank)   # -> "<checkpoint uri>/export"

writes to `<spec.checkpoint.uri>/export`:

    model.safetensors        fp32 weights under transformers' LlamaForCausalLM names
    config.json              LlamaConfig (architectures: LlamaForCausalLM)
    generation_config.json
    tokenizer.json           the tokenizer the data was prepared with
    tokenizer_config.json    so AutoTokenizer loads it as a PreTrainedTokenizerFast

so that `AutoModelForCausalLM.from_pretrained(folder)` and
`AutoTokenizer.from_pretrained(folder)` load it. The weights are gathered from
FSDP2 / DDP shards with DCP's full state dict (on every rank), then rank 0 maps
the names and writes the files.

The one non-trivial mapping: kubetrain's rotary embedding rotates interleaved
channel pairs (Meta's original Llama layout) while transformers rotates the two
halves of each head, so the rows of the query and key projections are permuted
per head - the same permutation as transformers' own Llama conversion script.
`model.init` reads such a folder back (pretrained.py), inverting it exactly.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from kubetrain.api.trainingjob import ModelDims, TrainingJobSpec
from kubetrain.trainer.prepare import END_OF_TEXT, TOKENIZER_NAME
from kubetrain.trainer.storage import open_object, open_storage

EXPORT_FOLDER = "export"
# Wrappers that parallelize() may add around modules; they are not part of the names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def _interleaved_to_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder the output rows of a q/k projection from pair-interleaved to half-split."""
    rows, columns = weight.shape
    return (weight.view(heads, rows // heads // 2, 2, columns)
            .transpose(1, 2).reshape(rows, columns))


def hf_name(name: str, dims: ModelDims) -> str | None:
    """The LlamaForCausalLM name of a kubetrain parameter (wrappers' prefixes ignored).

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
        if rest in _LAYER_NAMES:
            return f"model.layers.{index}.{_LAYER_NAMES[rest]}"
    raise ValueError(f"no Hugging Face name for the model weight {name!r}")


def hf_state_dict(state: dict[str, torch.Tensor], dims: ModelDims) -> dict[str, torch.Tensor]:
    """kubetrain Transformer weights under LlamaForCausalLM's names and layout."""
    converted: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        target = hf_name(name, dims)
        if target is None:
            continue
        tensor = tensor.detach().to(torch.float32).contiguous()
        if target.endswith("self_attn.q_proj.weight"):
            tensor = _interleaved_to_halves(tensor, dims.n_heads)
        elif target.endswith("self_attn.k_proj.weight"):
            tensor = _interleaved_to_halves(tensor, dims.n_kv_heads)
        converted[target] = tensor.contiguous()
    return converted


def llama_config(dims: ModelDims, max_seq_len: int, eos_token_id: int) -> dict[str, Any]:
    """The LlamaConfig (config.json) describing a model of these dimensions."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.dim,
        "intermediate_size": dims.ffn_dim,
        "num_hidden_layers": dims.n_layers,
        "num_attention_heads": dims.n_heads,
        "num_key_value_heads": dims.n_kv_heads,
        "head_dim": dims.dim // dims.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_seq_len,
        "rms_norm_eps": dims.norm_eps,
        "rope_theta": dims.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": dims.rope_theta},
        "tie_word_embeddings": dims.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


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
    eos = Tokenizer.from_str(tokenizer_json.decode()).token_to_id(END_OF_TEXT)
    eos_id = 0 if eos is None else int(eos)
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "model.safetensors"
        save_file(hf_state_dict(state, dims), str(weights), metadata={"format": "pt"})
        target.upload_file(weights, "model.safetensors")
    files = {
        "config.json": llama_config(dims, spec.data.seq_len, eos_id),
        "generation_config.json": {"bos_token_id": eos_id, "eos_token_id": eos_id},
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "eos_token": END_OF_TEXT, "bos_token": END_OF_TEXT,
                                  "model_max_length": spec.data.seq_len},
    }
    for name, document in files.items():
        target.write_bytes(name, json.dumps(document, indent=1).encode())
    target.write_bytes(TOKENIZER_NAME, tokenizer_json)
    return target.uri
