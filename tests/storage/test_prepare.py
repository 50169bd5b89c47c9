"""`kubetrain prepare`: text, JSONL and Parquet to verified token shards, resumable."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import blake3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from kubetrain.api.trainingjob import StorageSpec
from kubetrain.cli import main as kubetrain
from kubetrain.trainer.prepare import END_OF_TEXT, DatasetIndex, PreparedDataset, prepare
from kubetrain.trainer.storage import open_storage


def _stdlib_texts(count: int) -> list[str]:
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return [path.read_text() for path in sources if path.stat().st_size < 8000][:count]


def _decoded_documents(prepared: PreparedDataset, split: str) -> list[str]:
    index = prepared.train if split == "train" else prepared.validation
    assert index is not None
    store = open_storage(f"{prepared.uri}/{split}")
    tokens = np.concatenate([np.frombuffer(store.read_bytes(s.name), dtype=index.dtype)
                             for s in index.shards])
    tokenizer = Tokenizer.from_str(store.read_bytes("tokenizer.json").decode())
    text = tokenizer.decode(tokens.tolist(), skip_special_tokens=False)
    return text.split(END_OF_TEXT)[:-1]


def test_jsonl_parquet_and_text_from_s3_become_shards_that_decode_back(
        s3_bucket: str, s3_spec: StorageSpec, tmp_path: Path) -> None:
    texts = _stdlib_texts(24)
    inputs = open_storage(f"s3://{s3_bucket}/raw", s3_spec)
    inputs.write_bytes("a.jsonl", "\n".join(json.dumps({"text": t}) for t in texts[:8]).encode())
    table = pa.table({"text": texts[8:16]})
    pq.write_table(table, tmp_path / "b.parquet")
    inputs.upload_file(tmp_path / "b.parquet", "b.parquet")
    for number, text in enumerate(texts[16:]):
        inputs.write_bytes(f"c/{number:02d}.txt", text.encode())

    prepared = prepare([inputs.uri], f"s3://{s3_bucket}/out", vocab_size=512, shard_tokens=4096,
                       validation_fraction=0.25, storage=s3_spec, progress=False)

    index = prepared.train
    assert index.dtype == "uint16" and index.vocab_size == 512
    assert all(s.tokens == 4096 for s in index.shards[:-1]) and index.shards[-1].tokens <= 4096
    out = open_storage(prepared.uri, s3_spec)
    tokenizer_bytes = out.read_bytes("tokenizer.json")
    assert index.tokenizer_sha256 == hashlib.sha256(tokenizer_bytes).hexdigest()
    for shard in index.shards:
        data = out.read_bytes(f"train/{shard.name}")
        assert (len(data), f"blake3:{blake3.blake3(data).hexdigest()}") == (shard.bytes,
                                                                            shard.digest)
        assert shard.bytes == 2 * shard.tokens

    # Every 4th document (0, 4, 8...) is held out; decoding the shards gives the documents.
    local = prepare([inputs.uri], str(tmp_path / "local"), vocab_size=512, shard_tokens=4096,
                    validation_fraction=0.25, storage=s3_spec, progress=False)
    assert local.train == prepared.train
    assert _decoded_documents(local, "validation") == texts[0::4]
    assert _decoded_documents(local, "train") == [t for i, t in enumerate(texts) if i % 4]


def test_an_interrupted_run_resumes_and_writes_the_same_shards(tmp_path: Path) -> None:
    # 600 short documents: more than one encoding batch (256) before the broken line.
    text = "".join(_stdlib_texts(40))
    lines = [json.dumps({"text": text[at:at + 300]}) for at in range(0, 600 * 300, 300)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join([*lines[:400], "{not json", *lines[400:]]))
    options = {"vocab_size": 400, "shard_tokens": 2048, "validation_fraction": 0.1,
               "progress": False}
    reference = tmp_path / "reference.jsonl"
    reference.write_text("\n".join(lines))
    clean = prepare([str(reference)], str(tmp_path / "clean"), **options)
    tokenizer = clean.tokenizer_uri  # both runs must encode with the same tokenizer

    with pytest.raises(json.JSONDecodeError):
        prepare([str(corpus)], str(tmp_path / "out"), tokenizer=tokenizer, **options)
    state = json.loads((tmp_path / "out" / "prepare-state.json").read_text())
    assert len(state["splits"]["train"]["shards"]) > 0
    assert not (tmp_path / "out" / "train" / "index.json").exists()

    corpus.write_text("\n".join(lines))  # repair the input, then rerun the same command
    resumed = prepare([str(corpus)], str(tmp_path / "out"), tokenizer=tokenizer, **options)
    again = prepare([str(corpus)], str(tmp_path / "out"), tokenizer=tokenizer, **options)

    fresh = prepare([str(corpus)], str(tmp_path / "fresh"), tokenizer=tokenizer, **options)
    assert resumed.train == fresh.train == again.train
    assert resumed.validation == fresh.validation


def test_a_rerun_does_not_read_the_input_files_before_where_it_stopped(tmp_path: Path) -> None:
    text = "".join(_stdlib_texts(40))
    documents = [json.dumps({"text": text[at:at + 300]}) for at in range(0, 600 * 300, 300)]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    parts = [corpus / f"part-{number}.jsonl" for number in range(6)]
    for number, part in enumerate(parts):
        part.write_text("\n".join(documents[number * 100:(number + 1) * 100]))
    options = {"vocab_size": 400, "shard_tokens": 2048, "validation_fraction": 0.1,
               "progress": False}
    tokenizer = prepare([str(parts[0])], str(tmp_path / "tok"), **options).tokenizer_uri
    options["tokenizer"] = tokenizer
    fresh = prepare([str(corpus)], str(tmp_path / "fresh"), **options)

    intact = parts[-1].read_bytes()
    parts[-1].write_bytes(intact + b"\n{not json")
    with pytest.raises(json.JSONDecodeError):
        prepare([str(corpus)], str(tmp_path / "out"), **options)
    parts[-1].write_bytes(intact)
    # The files wholly before the first unwritten document become garbage of the same
    # size: reading any of them would fail, so the rerun must skip them.
    state = json.loads((tmp_path / "out" / "prepare-state.json").read_text())
    first = min(split["next_document"] for split in state["splits"].values())
    skipped = parts[:first // 100]
    assert len(skipped) >= 2
    for part in skipped:
        part.write_bytes(b"{" * part.stat().st_size)

    resumed = prepare([str(corpus)], str(tmp_path / "out"), **options)
    assert (resumed.train, resumed.validation) == (fresh.train, fresh.validation)
    assert _decoded_documents(resumed, "train") == _decoded_documents(fresh, "train")


def test_other_settings_on_the_same_output_are_refused(tmp_path: Path) -> None:
    corpus = tmp_path / "in.txt"
    corpus.write_text(_stdlib_texts(1)[0])
    prepare([str(corpus)], str(tmp_path / "out"), vocab_size=300, shard_tokens=512,
            validation_fraction=0, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        prepare([str(corpus)], str(tmp_path / "out"), vocab_size=300, shard_tokens=1024,
                validation_fraction=0, progress=False)


def test_the_command_line_prints_what_it_wrote(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "texts"
    corpus.mkdir()
    for number, text in enumerate(_stdlib_texts(6)):
        (corpus / f"{number}.txt").write_text(text)
    code = kubetrain(["prepare", str(corpus), "-o", str(tmp_path / "out"), "--vocab-size",
                      "300", "--shard-tokens", "1000", "--validation-fraction", "0.5",
                      "--quiet"])
    assert code == 0
    index = DatasetIndex.load(open_storage(str(tmp_path / "out" / "train")))
    assert f"{index.total_tokens:,} tokens in {len(index.shards)} shards" in capsys.readouterr().out
