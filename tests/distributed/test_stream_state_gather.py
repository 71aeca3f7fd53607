"""The streams' positions gathered across real gloo ranks (``features/stream_state.gathered_state``: torch's
``all_gather_object``), with ``stream_shards`` = the global batch, so each rank knows only its own streams: two ranks
read 3 steps (their prefetchers a micro-batch ahead), gather, and one process resumed from the gathered state at
dp 1 reads what an uninterrupted one-process reader reads next. The unit tests (``tests/unit/test_streaming.py``)
hand the other rank's positions over in one process; here they cross a process boundary as the trainer's do."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch.multiprocessing as mp

from megatron.data.batch import BatchLayout
from megatron.data.sampler import MicroBatchIterator, Prefetcher
from megatron.data.streaming import StreamingDataset, rank_streams
from megatron.tokenizer.char_level import CharLevelTokenizer

G, MICRO, SEQ, STREAMS, SAVED_AT = 8, 2, 8, 8, 3


def _corpus(tmp: Path) -> list[str]:
    rng = np.random.default_rng(11)
    texts = ["".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(rng.integers(1, 30)))) for _ in range(120)]
    (tmp / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:70]))
    (tmp / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[70:]))
    return [str(tmp / "{a,b}.jsonl")]


def _steps(ds: StreamingDataset, consumed: int, dp: int, rank: int, steps: int, ahead: int) -> list[list[bytes]]:
    """This rank's samples of ``steps`` global batches from ``consumed``, read as the trainer reads them."""
    layout = BatchLayout(micro=MICRO, gas=G // (MICRO * dp), dp=dp)
    ds.read_only(rank_streams(ds.num_streams, G, layout.per_rank, rank))
    it = Prefetcher(MicroBatchIterator(ds, consumed, layout, rank), depth=1 + ahead)
    out = []
    for _ in range(steps):
        out.append([row.numpy().tobytes() for _ in range(layout.gas) for row in next(it)["text"]])
    return out


def _rank(rank: int, out_dir: str, urls: list[str]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megatron.training.features.stream_state import gathered_state

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(out_dir, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    ds = StreamingDataset(urls, CharLevelTokenizer(), SEQ, STREAMS, 200)
    read = _steps(ds, 0, 2, rank, SAVED_AT, ahead=1)
    state = gathered_state(ds, SAVED_AT * G)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"state": state, "read": [[s.hex() for s in step] for step in read]}))
    dist.destroy_process_group()


def test_positions_gathered_over_gloo_resume_the_uninterrupted_samples_at_dp1(tmp_path: Path) -> None:
    urls = _corpus(tmp_path)
    mp.start_processes(_rank, args=(str(tmp_path), urls), nprocs=2, start_method="spawn", join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # every rank ends with the same, whole state: all 8 streams, though each rank read only 4 of them
    assert ranks[0]["state"] == ranks[1]["state"]
    assert len(ranks[0]["state"]["streams"]) == STREAMS

    whole = _steps(StreamingDataset(urls, CharLevelTokenizer(), SEQ, STREAMS, 200), 0, 1, 0, 2 * SAVED_AT, ahead=0)
    # the two ranks' slices, rank 0 first, are the uninterrupted run's first steps
    assert [bytes.fromhex(s) for s in ranks[0]["read"][0] + ranks[1]["read"][0]] == whole[0]
    for step in range(SAVED_AT):
        assert [bytes.fromhex(s) for r in ranks for s in r["read"][step]] == whole[step]

    resumed = StreamingDataset(urls, CharLevelTokenizer(), SEQ, STREAMS, 200)
    resumed.load_state(json.loads(json.dumps(ranks[0]["state"])))
    assert _steps(resumed, SAVED_AT * G, 1, 0, SAVED_AT, ahead=0) == whole[SAVED_AT:]
