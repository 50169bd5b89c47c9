"""Pretrained initialisation (`model.init`): a Hugging Face folder into a `Transformer`.

The inverse of export.py. Use (every rank, after `parallelize`, when there is no
checkpoint to resume from):

    spec, dims = trained_model(spec)     # config.json's dimensions and dynamics, checked
    model = Transformer(dims, max_seq_len=spec.data.seq_len, dynamics=spec.model.dynamics)
    parallel = parallelize(model, spec.parallelism, mesh, device)
    load_pretrained(parallel.module, spec.model.init, spec.storage)

The folder holds `config.json` (a Llama, Qwen2, Qwen3, Mistral or Gemma 3 config, read
and checked by pretrained_config.py and hf_families.py: which configurations load, and
the dimensions and family they give) and
the weights as safetensors: `model.safetensors`, or shards named by
`model.safetensors.index.json`. kubetrain's own exports of a model with INL
dynamics load too: config.json marks them (`kubetrain.dynamics`) and the
safetensors hold each block's dynamics tensors, read like every other tensor.

How the weights are read: a safetensors file is an 8-byte header length, a JSON
header giving each tensor's dtype, shape and byte range, then the raw bytes. Every
rank reads the headers (a few KB each, ranged reads), checks that every tensor the
model needs is there with the right shape and nothing unknown is, and then reads,
for each of its parameters, only the bytes of its own shard: FSDP2 shards dim 0,
so a rank's shard is one contiguous run of rows, fetched with one ranged read
(`Storage.read_range`: a ranged GET on S3, a seek on local disk). No file is
downloaded whole; a rank reads no other rank's rows except for the query and key
projections, where it reads the whole heads its rows fall in (at most one head
more on each side) because their rows are permuted within each head: kubetrain's
rotary embedding rotates interleaved channel pairs, transformers' the two halves
of each head (`_halves_to_interleaved`, the inverse of export's permutation; the
q/k biases and per-head norms of the families that have them are permuted alike). An
unsharded model (one process, or DDP) reads every tensor whole. Weights stored in
bf16 or fp16 are cast to the parameters' dtype (fp32 master weights).

An image-text model whose text decoder is a family's (Gemma 3 from 4B up on the hub:
Gemma3ForConditionalGeneration) loads its decoder: its tensors are read under the
family's names (`hf_families.IMAGE_TEXT`), the vision tower's are left in the folder,
and the export is the text model (Gemma3ForCausalLM).

A kubetrain state-space model's export (model_type kubetrain_ssm, ssm.py) loads the same
way into a `StateSpaceModel`: its mixer tensors keep kubetrain's names. `load_embeddings`
reads only the token embeddings and output projection of a folder, the same way: how a
`model.fromTeacher` student starts from its teacher's.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.parallel import DistributedDataParallel

from kubetrain.api.trainingjob import DynamicsSpec, ModelDims, StorageSpec
from kubetrain.trainer.architecture import LanguageModel, architecture_of
from kubetrain.trainer.export import hf_name
from kubetrain.trainer.hf_families import IMAGE_TEXT, ROTATED_ROWS, text_tensor_name
from kubetrain.trainer.model import Dynamics, Transformer
from kubetrain.trainer.pretrained_config import PretrainedConfig, PretrainedError, read_config
from kubetrain.trainer.ssm import StateSpaceModel
from kubetrain.trainer.storage import Storage, open_storage

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
READ_CONCURRENCY = 8  # ranged reads in flight per rank
_MAX_HEADER_BYTES = 100 * 1024**2  # safetensors' own limit on the JSON header
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16}
# Tensors some Llama checkpoints carry that transformers itself ignores when loading.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def pretrained_dims(uri: str, storage: StorageSpec | None) -> ModelDims:
    """The model dimensions of the Hugging Face folder at `uri` (config.json, checked)."""
    return read_config(uri, storage).dims


@dataclass(frozen=True)
class _Entry:
    """One tensor in a safetensors file: where its bytes start, its dtype and shape."""

    file: str
    start: int  # absolute byte offset of the tensor's data in the file
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


def _read_header(store: Storage, file: str) -> dict[str, _Entry]:
    """The tensors of one safetensors file, from its header (two ranged reads)."""
    where = f"{store.uri}/{file}"
    prefix = store.read_range(file, 0, 8)
    if len(prefix) < 8:
        raise PretrainedError(f"model.init: {where} is not a safetensors file (too short)")
    length = int.from_bytes(prefix, "little")
    if length > _MAX_HEADER_BYTES:
        raise PretrainedError(f"model.init: {where} is not a safetensors file "
                              f"(header of {length} bytes)")
    try:
        header = json.loads(store.read_range(file, 8, length))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PretrainedError(f"model.init: {where} has an unreadable safetensors header: "
                              f"{error}") from None
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise PretrainedError(
                f"model.init: tensor {name} in {where} has dtype {info['dtype']}: kubetrain "
                f"loads float weights ({', '.join(_DTYPES)})")
        shape = tuple(int(size) for size in info["shape"])
        begin, end = (int(offset) for offset in info["data_offsets"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise PretrainedError(f"model.init: tensor {name} in {where} has {end - begin} "
                                  f"bytes for shape {list(shape)} of {info['dtype']}")
        entries[name] = _Entry(file, 8 + length + begin, dtype, shape)
    return entries


def _tensor_entries(store: Storage) -> dict[str, _Entry]:
    """Every tensor of the folder's weights: one file, or the shards its index names."""
    if store.exists(INDEX_NAME):
        try:
            weight_map = json.loads(store.read_bytes(INDEX_NAME))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
            raise PretrainedError(f"model.init: {store.uri}/{INDEX_NAME} is not a safetensors "
                                  f"index (no weight_map): {error!r}") from None
        headers = {file: _read_header(store, file) for file in sorted(set(weight_map.values()))}
        entries = {}
        for name, file in weight_map.items():
            if name not in headers[file]:
                raise PretrainedError(f"model.init: {store.uri}/{INDEX_NAME} puts tensor "
                                      f"{name} in {file}, which does not hold it")
            entries[name] = headers[file][name]
        return entries
    if store.exists(WEIGHTS_NAME):
        return _read_header(store, WEIGHTS_NAME)
    raise PretrainedError(
        f"model.init: {store.uri} has neither {WEIGHTS_NAME} nor {INDEX_NAME}: kubetrain "
        "loads safetensors weights (convert PyTorch .bin files with save_pretrained)")


def _halves_to_interleaved(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder a q/k projection's rows (of its weight, bias or per-head norm) from
    half-split to pair-interleaved, per head.

    The exact inverse of export's `_interleaved_to_halves`.
    """
    rows = weight.shape[0]
    return (weight.view(heads, 2, rows // heads // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


@dataclass(frozen=True)
class _Read:
    """One parameter's part to read: the rows [start, stop) of `entry` in Hugging Face order,
    then (q/k) permuted per head and cut to the shard's rows and columns."""

    name: str
    entry: _Entry
    start: int
    stop: int
    heads: int  # heads covered by [start, stop) for a q/k projection, else 0
    keep: tuple[slice, ...]  # the shard, relative to the rows read
    target: torch.Tensor  # the local tensor the result is copied into


def _model_of(model: torch.nn.Module) -> LanguageModel:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    if not isinstance(inner, Transformer | StateSpaceModel):
        raise TypeError(f"load_pretrained loads into a kubetrain Transformer or "
                        f"StateSpaceModel, not {type(inner).__name__}")
    return inner


def _dynamics_of(model: LanguageModel) -> DynamicsSpec:
    """The INL dynamics `model` was built with (disabled when its blocks have none)."""
    block = next((module for module in model.modules() if isinstance(module, Dynamics)), None)
    if block is None:
        return DynamicsSpec()
    return DynamicsSpec(enabled=True, beta_max=block.beta_max, velocity_max=block.velocity_max)


def _plan(model: torch.nn.Module, dims: ModelDims, entries: dict[str, _Entry],
          uri: str, only: frozenset[str] | None = None) -> list[_Read]:
    """What this rank reads: the shard of each parameter (of those named `only`, when
    given), checked against the files."""
    plan, expected = [], set()
    head_dim = dims.head_size
    for name, parameter in model.named_parameters():
        target = hf_name(name, dims)
        if target is None:  # a tied output projection: the embedding, loaded once
            continue
        if only is not None and target not in only:
            continue
        expected.add(target)
        entry = entries.get(target)
        if entry is None:
            continue  # reported with every other missing tensor below
        if entry.shape != tuple(parameter.shape):
            raise PretrainedError(
                f"model.init: tensor {target} in {uri}/{entry.file} has shape "
                f"{list(entry.shape)}, but the model config.json describes needs "
                f"{list(parameter.shape)}")
        if isinstance(parameter, DTensor):
            shape, offset = compute_local_shape_and_global_offset(
                parameter.shape, parameter.device_mesh, parameter.placements)
            local = parameter.to_local()
        else:
            shape, offset, local = tuple(parameter.shape), (0,) * parameter.dim(), parameter
        if math.prod(shape) == 0:
            continue  # an empty shard of an unevenly split parameter
        start, stop = offset[0], offset[0] + shape[0]
        heads = 0
        if target.endswith(ROTATED_ROWS):
            # Whole heads: the rows are permuted within each head.
            start, stop = start // head_dim * head_dim, -(-stop // head_dim) * head_dim
            heads = (stop - start) // head_dim
        keep = (slice(offset[0] - start, offset[0] - start + shape[0]),
                *(slice(o, o + s) for o, s in zip(offset[1:], shape[1:], strict=True)))
        plan.append(_Read(target, entry, start, stop, heads, keep, local))
    missing = sorted(expected - entries.keys())
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5
                                          else "")
        raise PretrainedError(f"model.init: {uri} lacks {len(missing)} tensor(s) the model "
                              f"config.json describes needs: {shown}")
    ignorable = {"lm_head.weight"} if dims.tie_embeddings else set()  # transformers ties it too
    unknown = sorted(name for name in entries.keys() - expected - ignorable
                     if not name.endswith(_DERIVED_SUFFIXES) and only is None)
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5
                                          else "")
        raise PretrainedError(f"model.init: {uri} holds tensor(s) a {dims.family} model of "
                              f"its config.json has no place for: {shown}; refusing rather "
                              "than dropping them")
    return plan


def _read(store: Storage, read: _Read) -> torch.Tensor:
    entry = read.entry
    length = (read.stop - read.start) * entry.row_bytes
    data = store.read_range(entry.file, entry.start + read.start * entry.row_bytes, length)
    if len(data) != length:
        raise PretrainedError(f"model.init: {store.uri}/{entry.file} ended inside tensor "
                              f"{read.name}: the file is truncated")
    log.debug("read %s rows %d:%d (%d bytes)", read.name, read.start, read.stop, length)
    rows = torch.frombuffer(bytearray(data), dtype=entry.dtype).view(
        read.stop - read.start, *entry.shape[1:])
    if read.heads:
        rows = _halves_to_interleaved(rows, read.heads)
    return rows[read.keep]


def load_pretrained(model: torch.nn.Module, uri: str, storage: StorageSpec | None) -> None:
    """Copy the weights of the Hugging Face folder at `uri` into `model`, in place.

    `model` is a kubetrain `Transformer` built with the folder's dimensions
    and INL dynamics (`trained_model(spec)`, or `pretrained_dims`), plain,
    wrapped in DDP, or already sharded with FSDP2 (DTensor parameters; activation
    checkpointing and compile wrappers are fine). Every rank
    calls it, but it is not a collective: each reads only its own shards' rows with
    ranged reads, on S3 as on local disk (see the module docstring); nothing is
    downloaded whole. Every tensor the model needs must be there with its shape, and
    no unknown one may be; PretrainedError says which otherwise.
    """
    config = read_config(uri, storage)
    transformer = _model_of(model)
    if transformer.dims != config.dims:
        raise PretrainedError(f"model.init: the model was built with {transformer.dims}, but "
                              f"{config.where} describes {config.dims}: build it with "
                              "pretrained_dims()")
    if (dynamics := _dynamics_of(transformer)) != config.dynamics:
        raise PretrainedError(f"model.init: the model was built with dynamics {dynamics!r}, "
                              f"but {config.where} describes {config.dynamics!r}: build it "
                              "with trained_model(spec)[0].model.dynamics")
    if (architecture := architecture_of(transformer)) != config.architecture:
        raise PretrainedError(f"model.init: the model was built as a {architecture}, but "
                              f"{config.where} describes a {config.architecture}: build it "
                              "with trained_model(spec)[0].model.architecture")
    _load(model, uri, storage, config)


EMBEDDING_NAMES = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def load_embeddings(model: torch.nn.Module, uri: str, storage: StorageSpec | None) -> None:
    """Copy only the token embeddings and (untied) output projection of the folder at `uri`
    into `model`, of any architecture but with the folder's dimensions: a `model.fromTeacher`
    student starting from its teacher's (spec.distillation.teacher). Read like
    `load_pretrained`: each rank its own shard's rows."""
    config = read_config(uri, storage)
    built = _model_of(model).dims
    shape = ("vocab_size", "dim", "tie_embeddings")  # all an embedding's reading depends on
    if any(getattr(built, name) != getattr(config.dims, name) for name in shape):
        raise PretrainedError(f"model.init: the model was built with {built}, but "
                              f"{config.where} describes {config.dims}")
    _load(model, uri, storage, config, EMBEDDING_NAMES)


def _load(model: torch.nn.Module, uri: str, storage: StorageSpec | None,
          config: PretrainedConfig, only: frozenset[str] | None = None) -> None:
    store = open_storage(uri, storage)
    entries = _tensor_entries(store)
    if config.image_text:  # the text decoder's tensors, under the family's own names
        layout = IMAGE_TEXT[config.dims.family]
        named = {name: text_tensor_name(name, layout) for name in entries}
        log.info("model.init: %s is an image-text model: reading its text decoder, leaving "
                 "its %d vision tensors", store.uri, sum(v is None for v in named.values()))
        entries = {new: entries[name] for name, new in named.items() if new is not None}
    plan = _plan(model, config.dims, entries, store.uri, only)
    with torch.no_grad(), ThreadPoolExecutor(READ_CONCURRENCY) as pool:
        # A bounded window of reads in flight, copied in order: memory stays a few slices.
        pending: deque[tuple[_Read, Future[torch.Tensor]]] = deque()
        for read in plan:
            pending.append((read, pool.submit(_read, store, read)))
            if len(pending) >= 2 * READ_CONCURRENCY:
                done, future = pending.popleft()
                done.target.copy_(future.result())
        for done, future in pending:
            done.target.copy_(future.result())
