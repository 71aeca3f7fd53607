"""``train_data_weights_schedule`` / ``mixture_block_size``: Levanter's block-deterministic mixture
(``src/levanter/data/mixture.py`` @ 9263f81e), its formula re-derived here from Levanter's code (not from ours):

- ``_normalize_weights`` (mixture.py:166-180): ``w / sum(w)``;
- ``_compute_expected_counts_per_block`` (mixture.py:138-155): ``int(w * block)`` into an int32 array, the remainder
  ``block - sum`` added at ``np.argmax`` (the first largest count);
- sources with no positive weight in any stage are not in the mixture (mixture.py:83-87);
- stage starts are data offsets of steps (``rescale_mixture_schedule_for_batch_schedule``, mixture.py:310-341;
  ``global_data_offset_by_step``, schedule.py:108-119) and multiples of the block (mixture.py:68-80).

Also: ``*_data_paths`` entries naming jsonl shards are tokenized as train_urls are, and the checks before launch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megatron.config_rules import Device
from megatron.data.batch import BatchLayout
from megatron.data.batch_schedule import BatchSchedule
from megatron.data.build import DataSplits, build_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.mixture import MixtureDataset, MixtureIndex
from megatron.data.mixture_schedule import stages_at_offsets
from megatron.data.sampler import MicroBatchIterator
from megatron.data.url_sources import materialize_urls
from megatron.errors import ConfigError, DataError
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.derived import finalize
from megatron.neox_arguments.resolved import ResolvedConfig
from megatron.neox_arguments.run_config import data_run
from megatron.tokenizer.char_level import CharLevelTokenizer
from test_blending import _corpus  # a dataset whose every token is its marker


def levanter_counts(weights: list[float], block: int) -> list[int]:
    """Levanter's counts per block over the sources it keeps (positive weight somewhere), re-derived from its code."""
    total = sum(weights)
    counts = [int(w / total * block) for w in weights]  # float -> int32 element: truncation toward zero
    largest = counts.index(max(counts))  # np.argmax: the first largest
    counts[largest] += block - sum(counts)
    return counts


def counts_in_block(index: MixtureIndex, block: int) -> list[int]:
    found = [index.locate(i)[0] for i in range(block * index.block_size, (block + 1) * index.block_size)]
    return [found.count(d) for d in range(index.num_sources)]


@pytest.mark.parametrize("weights,block", [
    ([0.7, 0.3], 2048), ([1, 1, 1], 10), ([0.5, 0.25, 0.25], 7), ([3, 0, 1], 16), ([0.1, 0.2, 0.3, 0.4], 33),
    ([1, 1, 1], 2),  # every int() is 0: the whole block goes to the first source
])
def test_each_block_holds_levanters_counts(weights: list[float], block: int) -> None:
    index = MixtureIndex([(0, weights)], block, seed=3)
    kept = [d for d, w in enumerate(weights) if w > 0]
    want = [0] * len(weights)
    for d, c in zip(kept, levanter_counts([weights[d] for d in kept], block)):
        want[d] = c
    for b in (0, 1, 5):
        assert counts_in_block(index, b) == want, b


def test_a_source_weightless_in_every_stage_never_takes_the_remainder() -> None:
    """Levanter leaves it out of its datasets, so np.argmax runs over the others (block 2, weights 1:1:1 -> 0,0,0)."""
    index = MixtureIndex([(0, [0, 1, 1, 1]), (4, [0, 1, 2, 1])], 2, seed=0)
    assert counts_in_block(index, 0) == [0, 2, 0, 0]
    assert counts_in_block(index, 2) == [0, 0, 2, 0]  # 0.25*2, 0.5*2, 0.25*2 -> 0, 1, 0; the remainder to the 1


def test_indices_into_each_source_continue_across_stages_without_gaps() -> None:
    """Levanter's base offsets (counts_after_stage): over whole blocks, source d has read exactly its samples
    0 .. n_d - 1, each once, whatever stage they came from."""
    stages = [(0, [0.7, 0.3]), (64, [0.1, 0.9]), (96, [0.5, 0.5])]
    index = MixtureIndex(stages, 16, seed=11)
    seen: dict[int, list[int]] = {0: [], 1: []}
    for i in range(160):
        d, k = index.locate(i)
        seen[d].append(k)
        if (i + 1) % 16 == 0:
            for src, got in seen.items():
                assert sorted(got) == list(range(len(got))), (i, src)
    # 4 blocks at 12:4 (11.2, 4.8 -> 11, 4; the remainder to the largest), 2 at 1:15 (1.6, 14.4 -> 1, 14 + 1),
    # 4 at 8:8
    assert [len(seen[0]), len(seen[1])] == [4 * 12 + 2 * 1 + 4 * 8, 4 * 4 + 2 * 15 + 4 * 8]
    assert list(index.samples_needed(160)) == [len(seen[0]), len(seen[1])]


def test_per_window_proportions_follow_the_schedule() -> None:
    """Exactly per block; in windows of 64 inside a block of 1024, within 4 standard deviations of the
    hypergeometric draw (64 of 1024 positions, the source holding count of them)."""
    batches = BatchSchedule.fixed(64)
    stages = stages_at_offsets([(0, [0.8, 0.2]), (32, [0.3, 0.7])], batches)
    assert stages == [(0, [0.8, 0.2]), (2048, [0.3, 0.7])]
    index = MixtureIndex(stages, 1024, seed=5)
    sources = np.array([index.locate(i)[0] for i in range(4096)])
    for block in range(4):
        w = 0.8 if block < 2 else 0.3
        in_block = sources[block * 1024:(block + 1) * 1024]
        assert int(np.sum(in_block == 0)) == levanter_counts([w, 1 - w], 1024)[0]
        p, n, big = np.mean(in_block == 0), 64, 1024
        sd = np.sqrt(n * p * (1 - p) * (big - n) / (big - 1))
        for lo in range(0, 1024, 64):
            assert abs(np.sum(in_block[lo:lo + 64] == 0) - n * p) <= 4 * sd, (block, lo)
    # the order within a block is shuffled (a block is not 819 zeros then 205 ones), and differs per block and seed
    assert 0 < np.sum(sources[:512] == 1) < 205
    assert not np.array_equal(sources[:1024], sources[1024:2048])
    assert not np.array_equal(sources[:1024], [MixtureIndex(stages, 1024, seed=6).locate(i)[0] for i in range(1024)])


def test_stage_starts_are_the_steps_data_offsets_under_a_batch_schedule() -> None:
    """Levanter's global_data_offset_by_step: the samples of every earlier step (batches 2, 2, 6, 6, ...)."""
    batches = BatchSchedule.of([(0, 2), (2, 6)])
    assert stages_at_offsets([(0, [1, 0]), (4, [0, 1])], batches) == [(0, [1.0, 0.0]), (2 * 2 + 2 * 6, [0.0, 1.0])]
    with pytest.raises(DataError, match="not a multiple of the block"):
        MixtureIndex(stages_at_offsets([(0, [1, 0]), (3, [0, 1])], batches), 16, seed=0)
    with pytest.raises(DataError, match="mixture_block_size"):
        MixtureIndex([(0, [1.0])], 2**16, seed=0)


# ---- through build_datasets: real files, a jsonl entry, the sampler -----------------------------------------------


def _jsonl(path: Path, docs: int) -> str:
    path.write_text("".join(json.dumps({"text": "b" * (3 + i % 5)}) + "\n" for i in range(docs)))
    return str(path)


SCHEDULE = [[0, [0.75, 0.25]], [6, [0.25, 0.75]]]  # step 6 of 8 samples = sample 48, block 16


def _build(tmp_path: Path, **kw: Any) -> DataSplits:
    base: dict[str, Any] = dict(seq_length=8, seed=1, train_batch_size=8, train_iters=12, eval_iters=0,
                                eval_interval=100, cache_dir=str(tmp_path / "cache"), mixture_block_size=16)
    base.update(kw)
    return build_datasets(data_run(NeoXArgs(**base)), CharLevelTokenizer(), 256)


def test_a_jsonl_entry_is_tokenized_as_train_urls_are(tmp_path: Path) -> None:
    shards = _jsonl(tmp_path / "b.jsonl", 40)
    train = _build(tmp_path, train_data_paths=[_corpus(tmp_path, 1, 60), shards], train_data_weights_schedule=SCHEDULE).train
    assert isinstance(train, MixtureDataset)
    # the cache holds the same dataset train_urls would have made, and the mixture reads it as source 1
    want = MMapIndexedDataset(materialize_urls([shards], str(tmp_path / "cache"), CharLevelTokenizer()))
    assert len(want) == 40 and list(want[0]) == [ord("b")] * 3 + [CharLevelTokenizer().eod]
    source_of = {1: 0, ord("b"): 1, CharLevelTokenizer().eod: 1}
    for i in range(96):
        d, _ = train.locate(i)
        assert source_of[int(train[i]["text"][0])] == d
    firsts = [train.locate(i)[0] for i in range(96)]
    assert firsts[:48].count(0) == 3 * 12 and firsts[48:].count(0) == 3 * 4  # 12:4 per block of 16, then 4:12


def _tokens_read(dataset: Any, consumed: int, dp: int, steps: int) -> list[list[int]]:
    """Each step's samples over all dp ranks (rank order), as the ranks' micro-batch iterators read them."""
    layout = BatchLayout(micro=2, gas=8 // (2 * dp), dp=dp)
    its = [MicroBatchIterator(dataset, consumed, layout, r) for r in range(dp)]
    out = []
    for _ in range(steps):
        step = []
        for it in its:
            for _ in range(layout.gas):
                step += [hash(row.tobytes()) for row in next(it)["text"].numpy()]
        out.append(step)
    return out


def test_a_resume_before_the_boundary_at_another_dp_reads_the_uninterrupted_samples(tmp_path: Path) -> None:
    """dp 1 for 12 steps vs a resume after step 4 (consumed 32) at dp 2 and at dp 4: steps 5-12, across the weight
    change at step 6, are the same samples in the same order."""
    kw = dict(train_data_paths=[_corpus(tmp_path, 1, 60), _jsonl(tmp_path / "b.jsonl", 40)],
              train_data_weights_schedule=SCHEDULE)
    whole = _tokens_read(_build(tmp_path, **kw).train, 0, 1, 12)
    for dp in (2, 4):
        assert _tokens_read(_build(tmp_path, **kw).train, 32, dp, 8) == whole[4:], dp


# ---- checks before launch ----------------------------------------------------------------------------------------
BASE: dict[str, Any] = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 8, "train_iters": 10, "lr": 1e-3,
                        "tokenizer_type": "CharLevelTokenizer", "mixture_block_size": 16}


def finalized(tmp_path: Path, **values: Any) -> NeoXArgs:
    merged = {**BASE, "train_data_paths": [_corpus(tmp_path, 1, 60), _corpus(tmp_path, 2, 60)], **values}
    provenance = {key: f"cfg.yml:{line}" for line, key in enumerate(merged, start=1)}
    return finalize(ResolvedConfig(args=NeoXArgs(**merged), provenance=provenance), 2,
                    device=Device(cuda=False, fp16_supported=False)).args


def test_a_good_schedule_and_a_jsonl_entry_pass_the_checks(tmp_path: Path) -> None:
    shards = _jsonl(tmp_path / "b.jsonl", 4)
    args = finalized(tmp_path, train_data_weights_schedule=[[0, [1, 1]], [4, [1, 3]]],
                     train_data_paths=[_corpus(tmp_path, 1, 60), shards], cache_dir=str(tmp_path / "c"))
    assert args.train_data_weights_schedule == [(0, [1.0, 1.0]), (4, [1.0, 3.0])]


@pytest.mark.parametrize("values,key,words", [
    (dict(train_data_weights_schedule=[[0, [1, 1]], [3, [1, 3]]]), "mixture_block_size",
     "stage 1 starts at sample 24, not a multiple of the block of 16"),
    (dict(train_data_weights_schedule=[[2, [1, 1]]]), "train_data_weights_schedule", "starts at step 0"),
    (dict(train_data_weights_schedule=[[0, [1, 1]], [4, [1, 1]], [2, [1, 1]]]), "train_data_weights_schedule",
     "increasing order"),
    (dict(train_data_weights_schedule=[[0, [1, 1, 1]]]), "train_data_weights_schedule", "3 weights for 2"),
    (dict(train_data_weights_schedule=[[0, [0, 0]]]), "train_data_weights_schedule", "positive sum"),
    (dict(train_data_weights_schedule=[[0, [1, 1]]], train_data_weights=[1, 1]), "train_data_weights",
     "both weight train_data_paths"),
    (dict(train_data_weights_schedule=[[0, [1, 1]]], max_train_epochs=2), "max_train_epochs", "a mixture has no epochs"),
    (dict(mixture_block_size=2**16), "mixture_block_size", "65536"),
    (dict(train_data_paths=["/nowhere/s{1..2}.jsonl"], cache_dir="c"), "train_data_paths", "s1.jsonl not found"),
    (dict(train_data_paths=["x.jsonl.gz"]), "train_data_paths", "needs cache_dir"),
])
def test_bad_mixtures_are_refused_before_launch_by_name(tmp_path: Path, values: dict[str, Any], key: str,
                                                       words: str) -> None:
    with pytest.raises((ConfigError, ValueError)) as err:
        finalized(tmp_path, **values)
    message = getattr(err.value, "message", str(err.value))
    assert key in message and words in message, message
