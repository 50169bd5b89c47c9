"""Sample text from a trained checkpoint: `kubetrain generate --checkpoint URI --prompt TEXT`.

`--checkpoint` is a job's checkpoint URI (its newest committed checkpoint is
used) or one checkpoint folder (`.../step-00000600`), local or on S3. The
checkpoint's manifest records the model's dimensions and the job spec that
trained it, which names the tokenizer (`spec.data.tokenizer`, or the one
recorded with the training shards), and whether the model has INL dynamics.
Only the model weights are read, through the same verified loading the trainer
resumes with; the text is sampled token by token with a temperature and top-k,
on the CPU or the first GPU.

A transformer recomputes its whole context (up to max_seq_len tokens) for every token it
samples. A state-space model (`model.architecture: ssm`) samples in recurrent mode: the
prompt goes through the parallel scan once (`prefill`), then each token is one
`step` from a fixed-size state, so a token costs the same however long the context is
(bench/generate.py measures both).

Torch-free at import: `kubetrain --help` imports this module.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kubetrain.api.trainingjob import StorageSpec, TrainingJobSpec
    from kubetrain.trainer.architecture import LanguageModel


@dataclass
class LoadedModel:
    """A model ready to sample from, with its tokenizer and where it came from."""

    model: LanguageModel
    tokenizer: Any
    step: int
    uri: str


def _checkpoint_manifest(uri: str, storage: StorageSpec | None) -> tuple[str, dict[str, Any]]:
    """The URI and manifest of the checkpoint `uri` names: itself or the newest under it."""
    from kubetrain.trainer.checkpoint import MANIFEST_NAME, latest_checkpoint
    from kubetrain.trainer.storage import open_storage

    latest = latest_checkpoint(uri, storage)
    folder = latest.uri if latest is not None else uri
    try:
        manifest: dict[str, Any] = json.loads(open_storage(folder, storage).read_bytes(
            MANIFEST_NAME))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no committed checkpoint at {uri}: pass a job's spec.checkpoint.uri or one of "
            "its step-NNNNNNNN folders (an export/ folder is for Hugging Face transformers)"
        ) from None
    return folder, manifest


def _tokenizer_uri(spec: TrainingJobSpec) -> str:
    from kubetrain.trainer.prepare import TOKENIZER_NAME

    return spec.data.tokenizer or f"{spec.data.train.rstrip('/')}/{TOKENIZER_NAME}"


def load_model(uri: str, storage: StorageSpec | None = None,
               device: str = "cpu") -> LoadedModel:
    """The model of the checkpoint `uri` names, on `device`, in eval mode, and its tokenizer."""
    from tokenizers import Tokenizer

    from kubetrain.api.trainingjob import ModelDims, TrainingJobSpec
    from kubetrain.trainer.architecture import build_model
    from kubetrain.trainer.checkpoint import Checkpointer, ModelWeights
    from kubetrain.trainer.storage import open_object

    folder, manifest = _checkpoint_manifest(uri, storage)
    trained = TrainingJobSpec.model_validate(manifest["config"])
    if storage is not None:  # the caller's endpoint wins over the recorded one
        trained = trained.model_copy(update={"storage": storage})
    spec = trained.model_copy(update={"checkpoint": trained.checkpoint.model_copy(
        update={"uri": folder, "resume_from": None})})
    dims = ModelDims(**manifest["model"])
    model = build_model(spec.model.architecture, dims, max_seq_len=spec.data.seq_len,
                        dynamics=spec.model.dynamics)
    step = Checkpointer(spec, rank=0, world_size=1, model_dims=dims).load_latest(
        {"model": ModelWeights(model)})
    if step is None:
        raise FileNotFoundError(f"no committed checkpoint at {uri}")
    store, key = open_object(_tokenizer_uri(spec), spec.storage)
    tokenizer = Tokenizer.from_str(store.read_bytes(key).decode())
    return LoadedModel(model.to(device).eval(), tokenizer, step, folder)


def sample(model: LanguageModel, prompt: list[int], *, max_tokens: int, temperature: float,
           top_k: int | None, generator: torch.Generator | None = None,
           stop_token: int | None = None) -> list[int]:
    """Continue `prompt` by up to `max_tokens` tokens; temperature 0 picks the likeliest token.
    A state-space model samples in recurrent mode (see the module docstring)."""
    import torch

    from kubetrain.trainer.ssm import LayerState, StateSpaceModel

    device = next(model.parameters()).device
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    produced: list[int] = []
    states: list[LayerState] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            if not isinstance(model, StateSpaceModel):
                logits = model(tokens[:, -model.max_seq_len:])[0, -1].float()
            elif not states:
                prefilled, states = model.prefill(tokens)
                logits = prefilled[0, -1].float()
            else:
                stepped, states = model.step(tokens[:, -1], states)
                logits = stepped[0].float()
            if temperature == 0:
                choice = int(torch.argmax(logits))
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.numel():
                    cutoff = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < cutoff, float("-inf"))
                probabilities = torch.softmax(logits, dim=-1)
                choice = int(torch.multinomial(probabilities.cpu(), 1, generator=generator))
            if choice == stop_token:
                break
            produced.append(choice)
            tokens = torch.cat([tokens, torch.tensor([[choice]], device=device)], dim=1)
    return produced


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="URI",
                        help="a job's checkpoint URI (the newest checkpoint is used) or one "
                        "checkpoint folder; a path, file:// or s3://")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-tokens", type=int, default=200,
                        help="most tokens to generate (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature; 0 always takes the likeliest token "
                        "(default 0.8)")
    parser.add_argument("--top-k", type=int, default=50,
                        help="sample among the k likeliest tokens; 0 for all (default 50)")
    parser.add_argument("--seed", type=int, help="random seed, for repeatable samples")
    parser.add_argument("--endpoint", help="S3 endpoint URL for non-AWS stores")
    parser.add_argument("--region", help="S3 region")


def run(args: argparse.Namespace) -> int:
    import warnings

    import torch

    from kubetrain.api.trainingjob import StorageSpec
    from kubetrain.trainer.prepare import end_of_text

    if args.max_tokens < 1 or args.temperature < 0 or args.top_k < 0:
        print("kubetrain generate: --max-tokens must be at least 1, --temperature and --top-k "
              "at least 0", file=sys.stderr)
        return 2
    storage = StorageSpec(endpoint=args.endpoint, region=args.region) if (
        args.endpoint or args.region) else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Loading without a process group is intended here; DCP warns about it on every call.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    try:
        loaded = load_model(args.checkpoint, storage, device)
    except (FileNotFoundError, ValueError) as error:
        print(f"kubetrain generate: {error}", file=sys.stderr)
        return 1
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    _, stop = end_of_text(loaded.tokenizer)
    # An empty prompt starts a new document, as after the end-of-text separator in training.
    prompt = loaded.tokenizer.encode(args.prompt, add_special_tokens=False).ids or [stop]
    produced = sample(loaded.model, prompt, max_tokens=args.max_tokens,
                      temperature=args.temperature, top_k=args.top_k or None,
                      generator=generator, stop_token=stop)
    print(f"# {loaded.uri} (step {loaded.step})", file=sys.stderr)
    # Decoded together: a byte-level token may complete a character the prompt began.
    print(loaded.tokenizer.decode(prompt + produced, skip_special_tokens=True))
    return 0
