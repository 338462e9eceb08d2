"""`geotrain tokenizer train` and `geotrain data prepare`: text files in, a BPE tokenizer or a prepared data set out
(geotrain/dataset.py describes the directory).

Inputs are globs of files, read by suffix: `.jsonl` (one JSON object a line, the text in a field), `.parquet` (a
text column, needs pyarrow), anything else UTF-8 text (the file is one document). Documents stream through in
batches, so a corpus larger than memory prepares in bounded memory. The output is written under a temporary name and
renamed when complete: an interrupted or failed prepare leaves no data set behind.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from geotrain.dataset import FORMAT, MANIFEST, TOKENIZER, DatasetError, dtype_for, sha256_file

# A text file is read in pieces of about this many characters, cut at line ends: no file has to fit in memory.
_TEXT_PIECE = 1 << 20
_BATCH_DOCUMENTS = 256  # documents tokenized together (tokenizers' encode_batch uses its own threads)
SHARD_TOKENS = 1 << 27  # tokens per shard file at most
# The first of these the tokenizer knows separates documents in the token stream.
_SEPARATORS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


@dataclass(frozen=True)
class Piece:
    """Text of one document, or a part of it: `first` is false for a text file's later parts."""

    text: str
    first: bool


def input_files(patterns: list[str]) -> list[Path]:
    """The files the --input globs name, in a stable order; DatasetError for a pattern that matches none."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        found = [Path(m) for m in matches if not Path(m).is_dir()]
        if not found:
            raise DatasetError(f"--input {pattern!r} matches no files")
        files.extend(found)
    return files


def read_pieces(files: list[Path], text_field: str) -> Iterator[Piece]:
    """Every document of the input files; DatasetError for a file that cannot be read as its suffix says."""
    for path in files:
        try:
            if path.suffix == ".jsonl":
                yield from _jsonl(path, text_field)
            elif path.suffix == ".parquet":
                yield from _parquet(path, text_field)
            else:
                yield from _text(path)
        except OSError as e:
            raise DatasetError(f"cannot read {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise DatasetError(f"{path} is not UTF-8 text (byte {e.start} of a piece)") from None


def _text(path: Path) -> Iterator[Piece]:
    with path.open(encoding="utf-8", newline="") as f:
        first = True
        while piece := f.read(_TEXT_PIECE):
            piece += f.readline()  # cut at a line end, not inside a word
            yield Piece(piece, first)
            first = False


def _jsonl(path: Path, text_field: str) -> Iterator[Piece]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise DatasetError(f"{path} line {number} is not JSON") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise DatasetError(f"{path} line {number} has no string field {text_field!r} (see --text-field)")
            yield Piece(record[text_field], True)


def _parquet(path: Path, text_field: str) -> Iterator[Piece]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"reading {path} needs pyarrow, which is not installed (pip install pyarrow)") from None
    try:
        table = pq.ParquetFile(path)
    except ValueError as e:  # pyarrow's ArrowInvalid for a file that is no parquet
        raise DatasetError(f"{path} is not a parquet file: {e}") from None
    columns = table.schema_arrow.names
    if text_field not in columns:
        raise DatasetError(f"{path} has no column {text_field!r} (columns: {', '.join(columns)}; see --text-field)")
    for batch in table.iter_batches(columns=[text_field], batch_size=_BATCH_DOCUMENTS):
        for value in batch.column(0).to_pylist():
            if not isinstance(value, str):
                raise DatasetError(f"{path} column {text_field!r} holds {type(value).__name__}, not text")
            yield Piece(value, True)


def load_tokenizer(path: str | Path) -> Any:
    """A `tokenizers` Tokenizer from a tokenizer.json (ours, or any Hugging Face model's); DatasetError if not one."""
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise DatasetError(f"--tokenizer {path}: no such file")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise DatasetError(f"--tokenizer {path} is not a tokenizer.json: {e}") from None


def train_tokenizer(patterns: list[str], vocab_size: int, out: str | Path, text_field: str = "text") -> int:
    """Train a byte-level BPE tokenizer of at most vocab_size tokens on the input and save it as JSON (written under
    a temporary name, then renamed); returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = input_files(patterns)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[_SEPARATORS[0]], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    seen = [0]

    def texts() -> Iterator[str]:
        for piece in read_pieces(files, text_field):
            seen[0] += len(piece.text)
            yield piece.text

    tokenizer.train_from_iterator(texts(), trainer)
    if not seen[0]:
        raise DatasetError("the input holds no text")
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tokenizer.save(str(tmp))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return tokenizer.get_vocab_size(with_added_tokens=True)


@dataclass
class PrepareResult:
    """What `data prepare` wrote."""

    directory: Path
    documents: int
    train_tokens: int
    val_tokens: int
    fingerprint: str


def prepare(
    patterns: list[str], tokenizer_path: str | Path, out: str | Path, *, text_field: str = "text",
    val_fraction: float = 0.05,
) -> PrepareResult:
    """Tokenize the input into a prepared data set at `out`: the tail documents holding about val_fraction of the
    tokens are the validation split. Nothing exists at `out` until every file is complete."""
    from geotrain.dataset import PreparedDataset

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DatasetError(f"--out {out} exists and is not an empty directory")
    if not 0 < val_fraction < 1:
        raise DatasetError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    files = input_files(patterns)
    tokenizer = load_tokenizer(tokenizer_path)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    vocab_size = max(vocab.values()) + 1 if vocab else 0
    separator = next((vocab[s] for s in _SEPARATORS if s in vocab), None)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if out.parent != Path(""):
        out.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        dtype = dtype_for(vocab_size)
        documents, ends, text_bytes = _tokenize(files, text_field, tokenizer, separator, dtype, tmp / "all.bin")
        split_at = _validation_start(ends, val_fraction)
        total = int(ends[-1])
        val_start = int(ends[split_at - 1])
        manifest = {
            "format": FORMAT,
            "dtype": dtype,
            "documents": documents,
            "separator": separator,
            "tokenizer": {"file": TOKENIZER, "sha256": sha256_file(Path(tokenizer_path)), "vocab_size": vocab_size},
            "splits": {
                "train": _write_split(tmp, "train", dtype, 0, val_start, int(sum(text_bytes[:split_at]))),
                "val": _write_split(tmp, "val", dtype, val_start, total, int(sum(text_bytes[split_at:]))),
            },
        }
        (tmp / "all.bin").unlink()
        shutil.copyfile(tokenizer_path, tmp / TOKENIZER)
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dataset = PreparedDataset.open(out)
    return PrepareResult(out, documents, len(dataset.train), len(dataset.val), dataset.fingerprint)


def _tokenize(
    files: list[Path], text_field: str, tokenizer: Any, separator: int | None, dtype: str, target: Path
) -> tuple[int, np.ndarray, np.ndarray]:
    """Tokens of every piece appended to target; returns the document count and, per piece, where its tokens end
    and how many UTF-8 bytes of text it holds (the split falls between pieces, so its bytes are exact)."""
    ends, text_bytes = array("q"), array("q")
    documents = total = 0
    with target.open("wb") as f:
        batch: list[Piece] = []

        def flush() -> None:
            nonlocal total, documents
            for piece, encoding in zip(batch, tokenizer.encode_batch([p.text for p in batch], add_special_tokens=False)):
                ids = encoding.ids
                if piece.first:
                    documents += 1
                    if separator is not None and total:
                        ids = [separator, *ids]
                f.write(np.asarray(ids, dtype=dtype).astype(np.dtype(dtype).newbyteorder("<")).tobytes())
                total += len(ids)
                ends.append(total)
                text_bytes.append(len(piece.text.encode("utf-8")))
            batch.clear()

        for piece in read_pieces(files, text_field):
            batch.append(piece)
            if len(batch) == _BATCH_DOCUMENTS:
                flush()
        flush()
    if not total:
        raise DatasetError("the input holds no text: no tokens to train on")
    return documents, np.frombuffer(ends, dtype=np.int64), np.frombuffer(text_bytes, dtype=np.int64)


def _validation_start(ends: np.ndarray, val_fraction: float) -> int:
    """The first piece of the validation split: the tail pieces that hold about val_fraction of the tokens, at
    least one, and at least one piece left for training."""
    if len(ends) < 2:
        raise DatasetError(
            "the input is one document: a validation split needs at least two (more files, or more lines of .jsonl)"
        )
    total = int(ends[-1])
    # The first piece that ends at or after the training part's target length, and not the last piece.
    first = int(np.searchsorted(ends, total * (1 - val_fraction), side="left")) + 1
    return min(max(first, 1), len(ends) - 1)


def _write_split(directory: Path, split: str, dtype: str, start: int, end: int, text_bytes: int) -> dict[str, Any]:
    """Copy tokens [start, end) of all.bin into the split's shards; their manifest entry."""
    source = np.memmap(directory / "all.bin", dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    shards = []
    for index, first in enumerate(range(start, end, SHARD_TOKENS)):
        name = f"{split}-{index:05d}.bin"
        last = min(first + SHARD_TOKENS, end)
        with (directory / name).open("wb") as f:
            for block in range(first, last, 1 << 22):
                f.write(source[block : min(block + (1 << 22), last)].tobytes())
            f.flush()
            os.fsync(f.fileno())
        shards.append({"file": name, "tokens": last - first, "sha256": sha256_file(directory / name)})
    del source
    return {"tokens": end - start, "bytes": text_bytes, "shards": shards}


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
