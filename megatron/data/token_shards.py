"""fms-fsdp's data: a directory of token shards per dataset, read once into a Deepy dataset.

A data path (``train_data_paths`` entry) that is a directory is read as fms-fsdp's
``StreamingDocDataset`` reads one dataset directory (``fms_fsdp/utils/dataset_utils.py`` of
foundation-model-stack/fms-fsdp at 5a296afe): every shard file below it, found by walking the tree and
sorted, whose extension names its format (``ArrowHandler``: ``.arrow`` files, one document per record
batch, its token ids in the ``tokens`` column; ``ParquetHandler``: ``.parquet`` files, a text column
tokenized with a Hugging Face tokenizer; ``auto``: both). Each document loses a leading and a
trailing token found in the drop set (``strip_tokens`` with the bos/eos ids), is skipped when shorter
than 3 tokens with its delimiters (``min_length=3``), gets ``bos`` before it when set and ``eos`` after
it. The documents are written, in file order, to one MMIDIDX dataset under ``cache_dir`` whose name
hashes the files' contents and these settings, built once by the first rank that needs it (the same
lock as ``train_urls``); the sample index then shuffles them from the seed, as for any dataset.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron.data.index_cache import build_once, file_content_key
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from megatron.errors import DataError

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "cache/shards"
MIN_LENGTH = 3
"""``get_data_loader`` builds ``StreamingDocDataset(..., min_length=3)``."""


def _legal(name: str, file_type: str) -> bool:
    """The handler's ``is_legal``: the format's name in the file's extension."""
    ext = os.path.splitext(name)[1]
    if file_type == "arrow":
        return "arrow" in ext
    if file_type == "hf_parquet":
        return "parquet" in ext
    return "arrow" in ext or "parquet" in ext


def shard_files(directory: str, file_type: str) -> list[str]:
    """Every shard file below ``directory`` (the tree walked, as ``StreamingDocDataset.setup`` does), sorted."""
    found = [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names
             if _legal(name, file_type)]
    return sorted(found)


def _arrow_documents(path: str) -> Iterator[list[int]]:
    # lazy: pyarrow, only for fms-fsdp's token shards
    import pyarrow as pa

    reader = pa.ipc.open_file(pa.memory_map(path))
    for index in range(reader.num_record_batches):
        batch = reader.get_batch(index)
        if "tokens" not in batch.schema.names:
            raise DataError(f"{path}: record batch {index} has no 'tokens' column (columns: {batch.schema.names})")
        yield batch.column("tokens").to_pylist()


def _parquet_documents(path: str, column: str, tokenizer: Any) -> Iterator[list[int]]:
    # lazy: pyarrow, only for fms-fsdp's token shards
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=[column])
    for text in table.column(column).to_pylist():
        yield list(tokenizer(str(text))["input_ids"])


def documents(path: str, column: str, tokenizer: Any) -> Iterator[list[int]]:
    if "arrow" in os.path.splitext(path)[1]:
        return _arrow_documents(path)
    if tokenizer is None:
        raise DataError(f"{path}: parquet shards hold text; give the tokenizer directory (fms-fsdp's tokenizer_path)")
    return _parquet_documents(path, column, tokenizer)


def framed(doc: Sequence[int], eos: int, bos: int | None, drop: set[int]) -> list[int] | None:
    """``ArrowHandler.get`` (a dropped first, then last token) and ``StreamingDocDataset``'s delimiters;
    None for a document it skips."""
    tokens = list(doc)
    if tokens and tokens[0] in drop:
        tokens = tokens[1:]
    if tokens and tokens[-1] in drop:
        tokens = tokens[:-1]
    if not tokens:
        return None
    if len(tokens) + (1 if bos is None else 2) < MIN_LENGTH:
        return None
    return ([bos] if bos is not None else []) + tokens + [eos]


def _load_tokenizer(directory: str | None) -> Any:
    if directory is None:
        return None
    # lazy: transformers (seconds to import), only for a shard directory's tokenizer
    from transformers import AutoTokenizer

    if not os.path.isdir(directory):
        raise DataError(f"shard_tokenizer {directory} is not a local tokenizer directory (nothing is downloaded)")
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def materialize_shards(directory: str, cache_dir: str | None, *, file_type: str = "arrow", column: str = "tokens",
                       tokenizer_dir: str | None = None, eos: int = 0, bos: int | None = None,
                       strip: Sequence[int] = (), vocab_size: int | None = None) -> str:
    """Read ``directory``'s shards once into ``cache_dir``; return the dataset prefix to read."""
    files = shard_files(directory, file_type)
    if not files:
        raise DataError(f"{directory}: no {file_type} shard files below it (fms-fsdp's file_type; "
                        f"{'.arrow' if file_type == 'arrow' else '.parquet' if file_type == 'hf_parquet' else '.arrow/.parquet'})")
    drop = {int(t) for t in strip} | {eos} | ({bos} if bos is not None else set())
    settings = {"file_type": file_type, "column": column, "tokenizer": tokenizer_dir, "eos": eos, "bos": bos,
                "drop": sorted(drop), "min_length": MIN_LENGTH}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for path in files:
        key.update(os.path.relpath(path, directory).encode())
        key.update(file_content_key(path).encode())
    name = Path(directory.rstrip("/")).name.replace("=", "_")
    prefix = str(Path(cache_dir or DEFAULT_CACHE_DIR) / f"shards_{name}_{key.hexdigest()[:20]}_text_document")

    def build() -> None:
        tokenizer = _load_tokenizer(tokenizer_dir) if file_type != "arrow" else None
        logger.info("reading %d shard files of %s into %s", len(files), directory, prefix)
        builder = MMapIndexedDatasetBuilder(prefix + ".bin", best_fitting_dtype(vocab_size or 2**31 - 1))
        try:
            written = 0
            for path in files:
                for doc in documents(path, column, tokenizer):
                    tokens = framed(doc, eos, bos, drop)
                    if tokens is None:
                        continue
                    if vocab_size is not None and max(tokens) >= vocab_size:
                        raise DataError(f"{path}: token id {max(tokens)} is beyond the model's {vocab_size} "
                                        f"embedding rows")
                    builder.add_item(np.asarray(tokens, dtype=np.int64))
                    builder.end_document()
                    written += 1
            if written == 0:
                raise DataError(f"{directory}: no document of {MIN_LENGTH} or more tokens in its shard files")
            builder.finalize(prefix + ".idx")  # published last: its existence marks a complete dataset
        except BaseException:
            builder.abort()
            raise

    build_once(prefix + ".idx", build)
    return prefix
