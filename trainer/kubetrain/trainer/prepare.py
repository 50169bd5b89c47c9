"""Turn a text corpus into token shards for training: `kubetrain prepare INPUT... -o URI`.

Inputs are files or folders, local or on S3: plain text (one document per file),
JSONL (`.jsonl`/`.json`, one document per line, text in `--text-field`) and Parquet
(`.parquet`, the `--text-field` column). A byte-level BPE tokenizer is trained with
Hugging Face `tokenizers` unless `--tokenizer` names an existing tokenizer.json.

Output layout (what `kubetrain.trainer.data` reads; point `spec.data.train` at
`URI/train`):

    URI/tokenizer.json
    URI/train/index.json          DatasetIndex: dtype, vocab, tokenizer sha256, shards
    URI/train/tokenizer.json      the tokenizer "recorded with the shards"
    URI/train/shard-00000.bin     raw little-endian uint16 (vocab <= 65536) or uint32 tokens
    URI/validation/...            the same for the validation split
    URI/prepare-state.json        progress, so that a rerun skips finished shards

Documents are joined with an end-of-text token; every shard but the last of a
split holds exactly `shard_tokens` tokens. Every k-th document (k = 1 /
validation fraction) goes to the validation split, so the split is deterministic.
After each shard the progress file records, per split, the document and token
offset where its unwritten tokens begin, and the document count of every input
file read so far; a rerun of the same command continues from there, without
reading again the files that lie wholly before it, and writes `index.json` (the
commit marker of a split) at the end.

Torch-free: imported by `kubetrain --help`. Heavy libraries load inside functions.
"""

from __future__ import annotations

import argparse
import builtins
import hashlib
import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kubetrain.trainer.storage import (
    DIGEST,
    Storage,
    digest,
    hasher,
    open_object,
    open_storage,
)

if TYPE_CHECKING:
    import numpy as np

    from kubetrain.api.trainingjob import StorageSpec

# v2: shard digests are labelled "algorithm:hex" (BLAKE3 now); v1 had a bare sha256,
# still read.
INDEX_FORMAT = "kubetrain-tokens-v2"
_INDEX_V1 = "kubetrain-tokens-v1"
INDEX_NAME = "index.json"
TOKENIZER_NAME = "tokenizer.json"
STATE_NAME = "prepare-state.json"
END_OF_TEXT = "<|endoftext|>"
# What ends a document, by tokenizer: kubetrain's own, GPT-2's and Qwen's (END_OF_TEXT),
# Llama 3's, Llama 2's and Mistral's, Gemma's. The first a tokenizer has is the one used.
END_OF_TEXT_TOKENS = (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>")
SPLITS = ("train", "validation")
_ENCODE_BATCH = 256  # documents per tokenizers.encode_batch call (it parallelises inside)


@dataclass(frozen=True)
class ShardInfo:
    """One token shard: file name, token count, size in bytes and the digest of its bytes
    ("blake3:<hex>", as OCI labels digests)."""

    name: str
    tokens: int
    bytes: int
    digest: str

    @staticmethod
    def of(name: str, tokens: int, data: builtins.bytes) -> ShardInfo:
        """The entry of a shard holding `data`, digested with today's algorithm."""
        return ShardInfo(name, tokens, len(data), f"{DIGEST}:{digest(data)}")

    @staticmethod
    def from_dict(fields: dict[str, Any]) -> ShardInfo:
        """From `asdict` output, including a v1 record (a bare `sha256`)."""
        if "sha256" in fields:
            fields = {**fields, "digest": f"sha256:{fields['sha256']}"}
            del fields["sha256"]
        return ShardInfo(**fields)

    def matches(self, data: builtins.bytes) -> bool:
        """Whether `data` has this shard's size and digest."""
        algorithm, _, expected = self.digest.partition(":")
        return len(data) == self.bytes and digest(data, algorithm) == expected


@dataclass(frozen=True)
class DatasetIndex:
    """The `index.json` of one prepared split: everything a reader needs to know."""

    dtype: str
    vocab_size: int
    eos_token_id: int
    tokenizer_sha256: str
    shard_tokens: int
    shards: tuple[ShardInfo, ...]
    format: str = INDEX_FORMAT

    @property
    def total_tokens(self) -> int:
        return sum(shard.tokens for shard in self.shards)

    def to_json(self) -> bytes:
        document = {**asdict(self), "total_tokens": self.total_tokens}
        return json.dumps(document, indent=1).encode()

    @staticmethod
    def from_json(data: bytes, where: str) -> DatasetIndex:
        document = json.loads(data)
        if document.get("format") == _INDEX_V1:
            document["format"] = INDEX_FORMAT  # its shards are read by `ShardInfo.from_dict`
        if document.get("format") != INDEX_FORMAT:
            raise ValueError(f"{where}: not a kubetrain token index (format "
                             f"{document.get('format')!r}); prepare the data with "
                             "`kubetrain prepare`")
        document.pop("total_tokens", None)
        shards = tuple(ShardInfo.from_dict(shard) for shard in document.pop("shards"))
        for shard in shards:  # refused here, not on the shard's first download mid-run
            try:
                hasher(shard.digest.partition(":")[0])
            except ValueError as error:
                raise ValueError(f"{where}: {shard.name}: {error}") from None
        return DatasetIndex(shards=shards, **document)

    @staticmethod
    def load(store: Storage) -> DatasetIndex:
        """The index of the split stored at `store`."""
        try:
            data = store.read_bytes(INDEX_NAME)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{store.uri}/{INDEX_NAME} not found: this is not a prepared split (or its "
                "preparation has not finished); run `kubetrain prepare INPUT -o URI` and point "
                "spec.data.train at URI/train"
            ) from None
        return DatasetIndex.from_json(data, f"{store.uri}/{INDEX_NAME}")


@dataclass(frozen=True)
class PreparedDataset:
    """What `prepare` produced: the URIs of the splits and their indexes."""

    uri: str
    train: DatasetIndex
    validation: DatasetIndex | None

    @property
    def train_uri(self) -> str:
        return f"{self.uri}/train"

    @property
    def validation_uri(self) -> str | None:
        return f"{self.uri}/validation" if self.validation else None

    @property
    def tokenizer_uri(self) -> str:
        return f"{self.uri}/{TOKENIZER_NAME}"


def token_dtype(vocab_size: int) -> str:
    """The narrowest unsigned type that holds every token id."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


# --- reading the corpus ---------------------------------------------------------------


@dataclass(frozen=True)
class _InputFile:
    store: Storage
    key: str
    size: int

    @property
    def uri(self) -> str:
        return f"{self.store.uri}/{self.key}"


def _input_files(inputs: Sequence[str], spec: StorageSpec | None) -> list[_InputFile]:
    files = []
    for uri in inputs:
        store = open_storage(uri, spec)
        if store.exists(""):  # the URI names one file
            folder, key = open_object(uri, spec)
            size = next(obj.size for obj in folder.list(key) if obj.key == key)
            files.append(_InputFile(folder, key, size))
            continue
        found = [obj for obj in store.list() if not obj.key.rpartition("/")[2].startswith(".")]
        if not found:
            raise FileNotFoundError(f"{uri}: no input files found")
        files.extend(_InputFile(store, obj.key, obj.size) for obj in found)
    return files


def _documents_in(data: bytes, key: str, text_field: str) -> Iterator[str]:
    if key.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(io.BytesIO(data), columns=[text_field])
        yield from (text for text in table.column(text_field).to_pylist() if text)
    elif key.endswith((".jsonl", ".json")):
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if line.strip():
                record = json.loads(line)
                if text_field not in record:
                    raise ValueError(f"{key}:{number}: no {text_field!r} field; set "
                                     "--text-field to the field holding the text")
                if record[text_field]:
                    yield str(record[text_field])
    else:
        text = data.decode("utf-8", errors="replace")
        if text.strip():
            yield text


def _documents(files: list[_InputFile], text_field: str, progress: Any) -> Iterator[str]:
    for item in files:
        yield from _documents_in(item.store.read_bytes(item.key), item.key, text_field)
        progress.update(item.size)


def _numbered_documents(files: list[_InputFile], text_field: str, progress: Any,
                        state: _State, first: int) -> Iterator[tuple[int, str]]:
    """(number, text) of the documents from number `first` on.

    A file that ends before `first` and that an earlier run read to its end (its size
    and document count are in `state.file_documents`) is skipped without reading it.
    """
    number = 0
    for item in files:
        size, count = state.file_documents.get(item.uri, (-1, 0))
        if size != item.size or number + count > first:
            count = 0
            for text in _documents_in(item.store.read_bytes(item.key), item.key, text_field):
                if number + count >= first:
                    yield number + count, text
                count += 1
            state.file_documents[item.uri] = (item.size, count)
        number += count
        progress.update(item.size)


def _progress(files: list[_InputFile], description: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=sum(f.size for f in files), unit="B", unit_scale=True,
                desc=description, disable=not enabled)


# --- tokenizer ------------------------------------------------------------------------


def train_tokenizer(texts: Iterator[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (GPT-2 style) with `<|endoftext|>` as token 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def end_of_text(tokenizer: Any) -> tuple[str, int]:
    """The token that ends a document in `tokenizer`'s vocabulary, and its id: the first of
    `END_OF_TEXT_TOKENS` it has. ValueError when it has none."""
    for token in END_OF_TEXT_TOKENS:
        if (found := tokenizer.token_to_id(token)) is not None:
            return token, int(found)
    raise ValueError(f"the tokenizer has none of {', '.join(END_OF_TEXT_TOKENS)} to separate "
                     "documents")


def _eos_id(tokenizer: Any) -> int:
    return end_of_text(tokenizer)[1]


# --- writing shards --------------------------------------------------------------------


@dataclass
class _SplitProgress:
    """Where one split stands: its finished shards and where its unwritten tokens begin."""

    shards: list[ShardInfo] = field(default_factory=list)
    next_document: int = 0  # first document not wholly inside finished shards
    skip_tokens: int = 0  # tokens of that document already inside finished shards


@dataclass
class _State:
    """`prepare-state.json`: the settings, where each split stands, and the size and
    document count of each input file read to its end (so that a rerun need not read
    the files before its first unwritten document)."""

    out: Storage
    settings: dict[str, Any]
    splits: dict[str, _SplitProgress] = field(
        default_factory=lambda: {name: _SplitProgress() for name in SPLITS})
    file_documents: dict[str, tuple[int, int]] = field(default_factory=dict)

    def save(self) -> None:
        document = {"settings": self.settings,
                    "splits": {name: asdict(split) for name, split in self.splits.items()},
                    "file_documents": self.file_documents}
        self.out.write_bytes(STATE_NAME, json.dumps(document).encode())

    @staticmethod
    def load(out: Storage, settings: dict[str, Any]) -> _State | None:
        try:
            document = json.loads(out.read_bytes(STATE_NAME))
        except FileNotFoundError:
            return None
        if document["settings"] != settings:
            raise ValueError(f"{out.uri} already holds data prepared with other settings "
                             f"({document['settings']}): choose another output or delete it")
        splits = {
            name: _SplitProgress(
                shards=[ShardInfo.from_dict(shard) for shard in split.pop("shards")], **split
            )
            for name, split in document["splits"].items()
        }
        files = {name: (size, count)
                 for name, (size, count) in document.get("file_documents", {}).items()}
        return _State(out, settings, splits, files)


class _SplitWriter:
    """Buffers one split's tokens and writes a shard whenever `shard_tokens` are ready."""

    def __init__(self, store: Storage, progress: _SplitProgress, shard_tokens: int,
                 dtype: str) -> None:
        self.store = store
        self.progress = progress
        self.shard_tokens = shard_tokens
        self.dtype = dtype
        self._buffer: list[np.ndarray] = []
        self._buffered = 0

    def add(self, document: int, tokens: np.ndarray) -> bool:
        """Append a document's tokens; True when a shard was written (progress changed)."""
        state = self.progress
        if document < state.next_document:
            return False
        start = state.skip_tokens if document == state.next_document else 0
        self._buffer.append(tokens[start:])
        self._buffered += len(tokens) - start
        wrote = False
        while self._buffered >= self.shard_tokens:
            self._write(self.shard_tokens)
            # What is left in the buffer is the tail of this document.
            state.next_document = document if self._buffered else document + 1
            state.skip_tokens = len(tokens) - self._buffered if self._buffered else 0
            wrote = True
        return wrote

    def finish(self, documents: int) -> None:
        """Write the last, shorter shard once all `documents` have been added."""
        if self._buffered:
            self._write(self._buffered)
        self.progress.next_document, self.progress.skip_tokens = documents, 0

    def _write(self, count: int) -> None:
        import numpy as np

        joined = np.concatenate(self._buffer)
        data = joined[:count].astype(self.dtype).tobytes()
        rest = joined[count:]
        self._buffer, self._buffered = ([rest] if len(rest) else []), len(rest)
        name = f"shard-{len(self.progress.shards):05d}.bin"
        self.store.write_bytes(name, data)
        self.progress.shards.append(ShardInfo.of(name, count, data))


def _split_of(document: int, validation_every: int) -> str:
    return "validation" if validation_every and document % validation_every == 0 else "train"


def prepare(
    inputs: Sequence[str],
    output: str,
    *,
    tokenizer: str | None = None,
    vocab_size: int = 32_000,
    shard_tokens: int = 16 * 1024 * 1024,
    validation_fraction: float = 0.005,
    text_field: str = "text",
    storage: StorageSpec | None = None,
    progress: bool = True,
) -> PreparedDataset:
    """Tokenize `inputs` into shards under `output`; see the module docstring for the layout.

    `tokenizer` is the URI of a tokenizer.json to use instead of training one with
    `vocab_size` entries. A rerun with the same arguments continues where an
    interrupted one stopped and returns at once when everything is written.
    """
    from tokenizers import Tokenizer

    if not 0 <= validation_fraction < 1:
        raise ValueError(f"validation fraction ({validation_fraction}) must be in [0, 1)")
    if shard_tokens < 1:
        raise ValueError(f"shard tokens ({shard_tokens}) must be positive")
    out = open_storage(output, storage)
    files = _input_files(inputs, storage)
    validation_every = round(1 / validation_fraction) if validation_fraction else 0
    settings = {"inputs": list(inputs), "tokenizer": tokenizer, "vocab_size": vocab_size,
                "shard_tokens": shard_tokens, "validation_every": validation_every,
                "text_field": text_field}
    state = _State.load(out, settings)

    if state is not None:  # a rerun: keep the tokenizer the shards were written with
        tokenizer_json = out.read_bytes(TOKENIZER_NAME)
    elif tokenizer is not None:
        folder, key = open_object(tokenizer, storage)
        tokenizer_json = folder.read_bytes(key)
    else:
        with _progress(files, "training tokenizer", progress) as bar:
            trained = train_tokenizer(_documents(files, text_field, bar), vocab_size)
        tokenizer_json = trained.to_str().encode()
    tok = Tokenizer.from_str(tokenizer_json.decode())
    vocab = tok.get_vocab_size()
    dtype = token_dtype(vocab)
    eos = _eos_id(tok)
    tokenizer_hash = hashlib.sha256(tokenizer_json).hexdigest()
    if state is None:
        out.write_bytes(TOKENIZER_NAME, tokenizer_json)
        state = _State(out, settings)

    writers = {name: _SplitWriter(out.join(name), state.splits[name], shard_tokens, dtype)
               for name in SPLITS}
    if not all(out.join(name).exists(INDEX_NAME) for name in _splits_used(validation_every)):
        # A rerun tokenizes nothing before `first` and skips reading whole files before it.
        first = min(split_.next_document for split_ in state.splits.values())
        with _progress(files, "tokenizing", progress) as bar:
            batch: list[tuple[int, str]] = []
            for numbered in _numbered_documents(files, text_field, bar, state, first):
                batch.append(numbered)
                if len(batch) == _ENCODE_BATCH:
                    _encode(tok, batch, writers, eos, validation_every, state)
                    batch = []
            _encode(tok, batch, writers, eos, validation_every, state)
        documents = sum(state.file_documents[item.uri][1] for item in files)
        for name in _splits_used(validation_every):
            writers[name].finish(documents)
            state.save()
            split = out.join(name)
            split.write_bytes(TOKENIZER_NAME, tokenizer_json)
            index = DatasetIndex(dtype=dtype, vocab_size=vocab, eos_token_id=eos,
                                 tokenizer_sha256=tokenizer_hash, shard_tokens=shard_tokens,
                                 shards=tuple(state.splits[name].shards))
            split.write_bytes(INDEX_NAME, index.to_json())  # last: commits the split
    train = DatasetIndex.load(out.join("train"))
    validation = DatasetIndex.load(out.join("validation")) if validation_every else None
    return PreparedDataset(out.uri, train, validation)


def _splits_used(validation_every: int) -> tuple[str, ...]:
    return SPLITS if validation_every else ("train",)


def _encode(tok: Any, batch: list[tuple[int, str]], writers: dict[str, _SplitWriter], eos: int,
            validation_every: int, state: _State) -> None:
    import numpy as np

    if not batch:
        return
    encodings = tok.encode_batch([text for _, text in batch], add_special_tokens=False)
    wrote = False
    for (number, _), encoding in zip(batch, encodings, strict=True):
        tokens = np.array([*encoding.ids, eos], dtype=np.int64)
        wrote |= writers[_split_of(number, validation_every)].add(number, tokens)
    if wrote:
        state.save()


# --- command line ---------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text, JSONL or Parquet files or folders (local paths or s3://)")
    parser.add_argument("-o", "--output", required=True,
                        help="where the shards go: s3://bucket/prefix or a local folder")
    parser.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    parser.add_argument("--vocab-size", type=int, default=32_000,
                        help="vocabulary of the trained tokenizer (default 32000)")
    parser.add_argument("--shard-tokens", type=int, default=16 * 1024 * 1024,
                        help="tokens per shard (default 16Mi)")
    parser.add_argument("--validation-fraction", type=float, default=0.005,
                        help="fraction of documents held out for validation (default 0.005)")
    parser.add_argument("--text-field", default="text",
                        help="JSONL field / Parquet column holding the text (default text)")
    parser.add_argument("--endpoint", help="S3 endpoint URL for non-AWS stores")
    parser.add_argument("--region", help="S3 region")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from kubetrain.api.trainingjob import StorageSpec

    spec = StorageSpec(endpoint=args.endpoint, region=args.region)
    prepared = prepare(
        args.inputs, args.output, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        shard_tokens=args.shard_tokens, validation_fraction=args.validation_fraction,
        text_field=args.text_field, storage=spec, progress=not args.quiet,
    )
    print(f"train: {prepared.train_uri} ({prepared.train.total_tokens:,} tokens in "
          f"{len(prepared.train.shards)} shards)")
    if prepared.validation is not None:
        print(f"validation: {prepared.validation_uri} ({prepared.validation.total_tokens:,} "
              "tokens)")
    print(f"tokenizer: {prepared.tokenizer_uri} (vocabulary {prepared.train.vocab_size})")
    return 0
