"""Streaming training data (``streaming: true``): ``train_urls`` read lazily and tokenized while training.

No cache is built before the first step. The sources are read in file order, document after document:

- jsonl shards, plain, ``.gz`` or ``.zst`` (field ``text``), as ``url_sources.py`` reads them;
- ``.parquet`` and ``.arrow`` files (Arrow IPC file or stream format): column ``text`` is tokenized, or, without
  one, an integer-list column ``input_ids`` or ``tokens`` is read as is (those ids are the document);
- a directory written by Hugging Face ``datasets``' ``save_to_disk`` (its ``state.json`` lists the arrow files, read
  in that order, without the ``datasets`` package and without any download).

A text is tokenized exactly as ``materialize_urls`` tokenizes it (``tokenizer.tokenize_batch``, then the EOD id):
the same ids, byte for byte, as the offline cache.

The global order (layout independent, so a resume at any dp/tp/pp is exact): global document ``D`` (``D = 0, 1,
...``, the files' documents repeated epoch after epoch: ``D`` is document ``D mod N``, ``N`` learnt at the first
end of the data) belongs to logical stream ``D mod S`` (``S = stream_shards``). Each stream packs its documents back
to back and cuts samples of ``seq_length + 1`` tokens that share a boundary token (the offline ``packed`` cut,
``sample_index.py``); global sample ``i`` is sample ``i // S`` of stream ``i mod S``. A rank tokenizes only the
documents of the streams its samples come from.

State: per stream, the document and the token offset where its next sample starts. :meth:`StreamingDataset.
state_at` gives it at a checkpoint's consumed sample count (a sample cut ahead by the prefetcher does not move it),
:meth:`StreamingDataset.load_state` puts a rank's streams there: the resume reads on from those documents, no
earlier sample is cut again.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron.data.url_sources import expand_braces, iter_texts, open_text
from megatron.errors import DataError

STATE_FORMAT = 1
_TOKENIZE_BATCH = 256
_HISTORY = 64  # checkpointable positions kept per stream (the prefetcher reads a few micro-batches ahead)
_ID_COLUMNS = ("input_ids", "tokens")

Document = str | np.ndarray  # a text to tokenize, or token ids read as they are


# ---- the sources: documents in file order ---------------------------------------------------------------------
def _is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "state.json"))


def expand_sources(urls: Iterable[str]) -> list[str]:
    """The files and ``save_to_disk`` directories that ``urls`` name (brace patterns expanded), in order."""
    paths: list[str] = []
    for url in urls:
        for p in expand_braces(url):
            if "://" in p and not p.startswith("file://"):
                raise DataError(f"{p}: streaming reads local files (objects in a bucket are downloaded first)")
            p = p.removeprefix("file://")
            if not (os.path.isfile(p) or _is_hf_dir(p)):
                raise DataError(f"{p}: not a file or a datasets save_to_disk directory (from pattern {url!r})")
            paths.append(p)
    if not paths:
        raise DataError("train_urls expanded to no files")
    return paths


def _arrow_batches(path: str) -> Iterator[Any]:
    # lazy: pyarrow, only for arrow/parquet sources
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.endswith(".parquet"):
        yield from pq.ParquetFile(path).iter_batches(batch_size=_TOKENIZE_BATCH)
        return
    try:
        reader: Any = pa.ipc.open_file(path)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    except pa.ArrowInvalid:  # save_to_disk writes the stream format
        with pa.memory_map(path) as source:
            yield from pa.ipc.open_stream(source)


def _column_documents(path: str) -> Iterator[Document]:
    for batch in _arrow_batches(path):
        names = batch.schema.names
        if "text" in names:
            for text in batch.column("text").to_pylist():
                if not isinstance(text, str):
                    raise DataError(f"{path}: column 'text' must hold strings")
                yield text
            continue
        column = next((c for c in _ID_COLUMNS if c in names), None)
        if column is None:
            raise DataError(f"{path}: no column 'text' (tokenized) or {' / '.join(_ID_COLUMNS)} (token ids) among "
                            f"{names}")
        for ids in batch.column(column).to_pylist():
            yield np.asarray(ids, dtype=np.int64)


def _hf_files(path: str) -> list[str]:
    with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
        state = json.load(f)
    files = [os.path.join(path, entry["filename"]) for entry in state.get("_data_files", [])]
    if not files:
        raise DataError(f"{path}: state.json lists no arrow files (_data_files)")
    return files


def iter_documents(path: str) -> Iterator[Document]:
    """The documents of one source, in file order: texts, or token ids (integer-list columns)."""
    if _is_hf_dir(path):
        for file in _hf_files(path):
            yield from _column_documents(file)
    elif path.endswith((".parquet", ".arrow")):
        yield from _column_documents(path)
    else:
        yield from iter_texts(path)


def count_documents(path: str) -> int:
    """Documents of one source without decoding them: parquet's row count from its footer, arrow's from its record
    batches, jsonl's non-blank lines (a resume skips whole files by it)."""
    # lazy: pyarrow, only for arrow/parquet sources
    import pyarrow.parquet as pq

    if _is_hf_dir(path):
        return sum(count_documents(file) for file in _hf_files(path))
    if path.endswith(".parquet"):
        return int(pq.ParquetFile(path).metadata.num_rows)
    if path.endswith(".arrow"):
        return sum(batch.num_rows for batch in _arrow_batches(path))
    with open_text(path) as f:
        return sum(1 for line in f if line.strip())


def tokenize(tokenizer: Any, documents: list[Document]) -> list[np.ndarray]:
    """Token ids of each document: a text as ``materialize_urls`` writes it (``tokenize_batch`` + EOD), ids as
    they are."""
    texts = [d for d in documents if isinstance(d, str)]
    encoded = iter(tokenizer.tokenize_batch(texts)) if texts else iter(())
    out = []
    for d in documents:
        if isinstance(d, str):
            out.append(np.asarray(list(next(encoded)) + [tokenizer.eod], dtype=np.int64))
        else:
            out.append(d)
    return out


def stream_documents(urls: Iterable[str], tokenizer: Any) -> Iterator[np.ndarray]:
    """Every document of ``urls`` once, in file order, tokenized."""
    for path in expand_sources(urls):
        pending: list[Document] = []
        for doc in iter_documents(path):
            pending.append(doc)
            if len(pending) == _TOKENIZE_BATCH:
                yield from tokenize(tokenizer, pending)
                pending = []
        yield from tokenize(tokenizer, pending)


class _Reader:
    """Global documents ``D = start, start + 1, ...`` (epoch after epoch), the wanted ones tokenized."""

    def __init__(self, paths: list[str], tokenizer: Any, start: int, documents: int | None) -> None:
        self.paths, self.tokenizer = paths, tokenizer
        self.documents = documents  # N, once learnt
        self.next = start
        self._raw = self._walk(start)
        self._ready: deque[tuple[int, np.ndarray | None]] = deque()

    def _walk(self, start: int) -> Iterator[tuple[int, Document]]:
        d = start
        skip = start % self.documents if self.documents else start
        while True:
            seen = 0
            for path in self.paths:
                if skip:  # a resume: whole files before the start are counted, not read
                    count = count_documents(path)
                    if skip >= count:
                        skip -= count
                        seen += count
                        continue
                for doc in iter_documents(path):
                    seen += 1
                    if skip:
                        skip -= 1
                        continue
                    yield d, doc
                    d += 1
            if seen == 0:
                raise DataError(f"the streamed sources hold no documents: {', '.join(self.paths)}")
            if self.documents is None:
                self.documents = seen
                skip = start % seen if skip else 0  # the start was past the end: it is document start mod N
            elif self.documents != seen:
                raise DataError(f"the streamed sources changed while training: {seen} documents now, "
                                f"{self.documents} in the last pass")

    def take(self, wanted: Any) -> tuple[int, np.ndarray | None]:
        """The next global document: ``(D, ids)``, ids None when ``wanted(D)`` is false (not tokenized)."""
        if not self._ready:
            batch: list[tuple[int, Document]] = []
            while len(batch) < _TOKENIZE_BATCH:
                d, doc = next(self._raw)
                batch.append((d, doc))
                if self.documents is not None and (d + 1) % self.documents == 0:
                    break  # the end of an epoch: do not read ahead into the next one
            keep = [(d, doc) for d, doc in batch if wanted(d)]
            ids = dict(zip([d for d, _ in keep], tokenize(self.tokenizer, [doc for _, doc in keep])))
            self._ready.extend((d, ids.get(d)) for d, _ in batch)
        return self._ready.popleft()


# ---- one logical stream --------------------------------------------------------------------------------------
@dataclass
class _Stream:
    index: int
    next_sample: int  # k of the sample the next cut gives
    doc: int  # D where that sample starts
    offset: int  # its first token within document D
    pending: deque[tuple[int, np.ndarray]] = field(default_factory=deque)  # (D, ids) from ``doc`` on
    history: OrderedDict[int, tuple[int, int]] = field(default_factory=OrderedDict)  # k -> (D, offset)


class StreamingDataset:
    """The train split streamed from ``urls``: ``ds[i]`` is global sample ``i`` (``{"text": int64[L + 1]}``).

    Each stream is read forward only: a rank asks for its samples in increasing order (the sampler does); asking
    for a sample a stream has passed is an error. ``len`` is the planned sample count; indices past it go on
    (``wraps``: the documents repeat epoch after epoch).
    """

    wraps = True

    def __init__(self, urls: Iterable[str], tokenizer: Any, seq_length: int, num_streams: int,
                 num_samples: int, checkpoint_every: int = 1) -> None:
        """``checkpoint_every``: samples of a stream between two positions a checkpoint can be at (the global batch
        over ``num_streams``): only those positions are remembered for :meth:`state_at`."""
        if num_streams < 1 or seq_length < 1:
            raise DataError(f"stream_shards ({num_streams}) and seq_length ({seq_length}) must be positive")
        self.paths = expand_sources(urls)
        self.tokenizer = tokenizer
        self.seq_length, self.num_streams, self.num_samples = int(seq_length), int(num_streams), int(num_samples)
        self.checkpoint_every = max(1, int(checkpoint_every))
        self.documents: int | None = None
        self._streams = {s: _Stream(s, 0, s, 0) for s in range(self.num_streams)}
        self._owned: set[int] = set(range(self.num_streams))
        self._reader: _Reader | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.num_samples

    # ---- which streams this rank reads ----
    def read_only(self, streams: Iterable[int]) -> None:
        """Tokenize only the documents of ``streams`` (this rank's); call before the first sample."""
        self._owned = {int(s) % self.num_streams for s in streams}

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        i = int(i)
        if i < 0:
            raise IndexError(f"negative sample index {i}")
        s, k = i % self.num_streams, i // self.num_streams
        with self._lock:
            stream = self._streams[s]
            if s not in self._owned:
                self._owned.add(s)
                self._reader = None  # restart the reader where the streams now read need it
            if k < stream.next_sample:
                raise DataError(f"streamed sample {i} (sample {k} of stream {s}) was requested after sample "
                                f"{stream.next_sample - 1} of that stream: a stream is read forward only")
            while stream.next_sample < k:
                self._cut(stream)
            return {"text": self._cut(stream)}

    # ---- packing ----
    def _fill(self, stream: _Stream, need: int) -> None:
        """Documents into ``stream.pending`` until it holds ``need`` tokens from ``stream.offset`` on."""
        have = sum(len(ids) for _, ids in stream.pending) - stream.offset
        while have < need:
            ids = self._next_document(stream)
            stream.pending.append(ids)
            have += len(ids[1])

    def _next_document(self, stream: _Stream) -> tuple[int, np.ndarray]:
        last = stream.pending[-1][0] if stream.pending else stream.doc - self.num_streams
        want = last + self.num_streams
        if self._reader is None or self._reader.next > want:
            start = min(self._wanted_next(s) for s in self._owned)
            self._reader = _Reader(self.paths, self.tokenizer, start, self.documents)
        reader = self._reader
        while True:
            d, ids = reader.take(self._wanted)
            reader.next = d + 1
            self.documents = reader.documents
            if ids is None:
                continue
            owner = self._streams[d % self.num_streams]
            if d == want and owner is stream:
                return d, ids
            if owner is not stream and d == self._wanted_next(owner.index):
                owner.pending.append((d, ids))

    def _wanted_next(self, s: int) -> int:
        stream = self._streams[s]
        return stream.pending[-1][0] + self.num_streams if stream.pending else stream.doc

    def _wanted(self, d: int) -> bool:
        s = d % self.num_streams
        return s in self._owned and d >= self._wanted_next(s)

    def _cut(self, stream: _Stream) -> np.ndarray:
        """The stream's next sample (``seq_length + 1`` tokens); the stream moves on ``seq_length``."""
        length = self.seq_length
        self._fill(stream, length + 1)
        parts, need, offset = [], length + 1, stream.offset
        for _, ids in stream.pending:
            piece = ids[offset:offset + need]
            parts.append(piece)
            need -= len(piece)
            offset = 0
            if need == 0:
                break
        sample = np.concatenate(parts).astype(np.int64, copy=False)
        # advance by seq_length: the last token is the next sample's first (the shared boundary)
        move = length + stream.offset
        while stream.pending and move >= len(stream.pending[0][1]):
            move -= len(stream.pending[0][1])
            stream.pending.popleft()
        stream.doc = stream.pending[0][0]  # never empty: it held seq_length + 1 tokens from the offset
        stream.offset = move
        stream.next_sample += 1
        if stream.next_sample % self.checkpoint_every == 0:
            stream.history[stream.next_sample] = (stream.doc, stream.offset)
            while len(stream.history) > _HISTORY:
                stream.history.popitem(last=False)
        return sample

    # ---- checkpoint state ----
    def local_state(self, consumed_samples: int) -> dict[int, tuple[int, int]]:
        """The positions this rank knows of the streams at global sample ``consumed_samples`` (a multiple of the
        stream count): stream -> (document, offset) where its sample ``consumed_samples // S`` starts."""
        k = int(consumed_samples) // self.num_streams
        with self._lock:
            out = {}
            for s, stream in self._streams.items():
                if k == 0:
                    out[s] = (s, 0)
                elif k in stream.history:
                    out[s] = stream.history[k]
            return out

    def state_at(self, consumed_samples: int, local: Iterable[dict[int, tuple[int, int]]] | None = None,
                 documents: Iterable[int | None] = ()) -> dict[str, Any]:
        """The streams' state at ``consumed_samples`` for the checkpoint, from this rank's positions and those
        gathered from the other ranks (``local``, each one's :meth:`local_state`; ``documents``: their N)."""
        merged: dict[int, tuple[int, int]] = {}
        for part in [self.local_state(consumed_samples), *(local or [])]:
            merged.update({int(s): (int(d), int(o)) for s, (d, o) in part.items()})
        missing = [s for s in range(self.num_streams) if s not in merged]
        if missing:
            raise DataError(f"no rank knows where streams {missing[:8]} are at sample {consumed_samples}")
        known = [n for n in [self.documents, *documents] if n is not None]
        return {"format": STATE_FORMAT, "consumed_samples": int(consumed_samples), "stream_shards": self.num_streams,
                "seq_length": self.seq_length, "documents": known[0] if known else None,
                "streams": [list(merged[s]) for s in range(self.num_streams)]}

    def load_state(self, state: dict[str, Any] | None) -> None:
        """Put the streams where ``state`` (:meth:`state_at`, from the checkpoint) says; None: the start."""
        if not state:
            return
        if int(state.get("format", 0)) != STATE_FORMAT:
            raise DataError(f"the checkpoint's stream state has format {state.get('format')}, expected {STATE_FORMAT}")
        for key, mine in (("stream_shards", self.num_streams), ("seq_length", self.seq_length)):
            if int(state[key]) != mine:
                raise DataError(f"the checkpoint's stream was cut with {key} {state[key]}, this run has {mine}: "
                                f"resume with {key}: {state[key]} (the global order depends on it)")
        k = int(state["consumed_samples"]) // self.num_streams
        with self._lock:
            self.documents = state.get("documents")
            for s, (d, off) in enumerate(state["streams"]):
                self._streams[s] = _Stream(s, k, int(d), int(off))
                if k % self.checkpoint_every == 0:
                    self._streams[s].history[k] = (int(d), int(off))
            self._reader = None


def rank_streams(num_streams: int, global_batch: int, per_rank: int, dp_rank: int) -> list[int]:
    """The streams data-parallel rank ``dp_rank`` reads: its contiguous ``per_rank`` samples of each global batch
    (``sampler.py``), modulo the stream count (which divides the global batch)."""
    first = dp_rank * per_rank
    return sorted({(first + j) % num_streams for j in range(per_rank)}) if global_batch else []


def iterate_samples(urls: Iterable[str], tokenizer: Any, seq_length: int, num_streams: int = 1, count: int = 1,
                    start: int = 0) -> Iterator[np.ndarray]:
    """Global samples ``start .. start + count - 1`` of the streamed order, without a training run."""
    ds = StreamingDataset(urls, tokenizer, seq_length, num_streams, start + count)
    for i in range(start, start + count):
        yield ds[i]["text"]
