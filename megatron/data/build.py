"""``build_datasets(config)``: the train/valid/test datasets a run reads, from its data keys
(:class:`~megatron.data.config.DataRun`: the data keys and the shared values, resolved once).

Sources, in order of precedence:

0. ``dataset_impl: online``: rollouts from rollout servers (``online_dataset.py``), no files.
1. ``use_dummy_dataset``: random tokens, no files.
2. ``train_urls``/``validation_urls``: raw jsonl shards tokenized once into the cache (Levanter style).
3. ``{train,valid,test}_data_paths`` (+ ``_label``/``_reward``, or ``pos_``/``neg_`` for pairwise), each
   list blended by ``*_data_weights`` or by document counts (``weight_by_num_documents``), the train list
   by ``train_data_weights_schedule`` when it is set (``megatron/data/mixture.py``); a path that
   is a directory holds fms-fsdp's token shards (``megatron/data/token_shards.py``), one that names jsonl
   shards (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``) is tokenized into the cache as train_urls are.
4. ``data_path`` (one prefix or a list), split by documents according to ``split``.

Sample counts come from the schedule: train = train_iters x G (or train_epochs whole epochs),
valid = (train_iters // eval_interval + 1) x eval_iters x G, test = eval_iters x G.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron.data.batch_schedule import BatchSchedule
from megatron.data.config import SPLITS, DataRun
from megatron.data.blendable_dataset import BlendedDataset, cached_blend_index, samples_per_dataset, weights_by_num_documents
from megatron.data.dummy_dataset import DummyDataset, DummyKind
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.index_cache import default_cache_dir
from megatron.data.mixture import MixtureDataset, MixtureIndex
from megatron.data.mixture_schedule import names_jsonl_shards, stages_at_offsets
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.online_dataset import OnlineDataset
from megatron.data.pairwise_dataset import PairwiseDataset
from megatron.data.reference_logprobs import open_reference_logprobs
from megatron.data.remote_data import localized
from megatron.data.reward_dataset import RewardDataset
from megatron.data.sft_dataset import SFTDataset
from megatron.data.streaming import StreamingDataset
from megatron.data.token_range import TokenRangeChecked
from megatron.data.token_shards import materialize_shards
from megatron.data.url_sources import materialize_urls
from megatron.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


@dataclass
class DataSplits:
    train: Any | None
    valid: Any | None
    test: Any | None
    train_samples_cap: int | None = None
    """``max_train_epochs`` x the samples of one epoch of the train split: the run stops before it
    reads past them (None: no cap)."""


# ---- pure helpers ---------------------------------------------------------------------------
def split_shares(split: str) -> list[float] | str:
    """``"949,50,1"`` (or ``"949/50/1"``) -> the three shares, or what is wrong with ``split`` (the ranks and the
    check before launch, ``data/checks.py``, read it alike)."""
    parts = [p.strip() for p in str(split).replace("/", ",").split(",") if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        return "must be comma-separated numbers like '949,50,1'"
    if not values or len(values) > 3 or any(v < 0 for v in values) or sum(values) <= 0:
        return "must be up to three non-negative numbers with a positive sum"
    return values + [0.0] * (3 - len(values))


def parse_split(split: str) -> np.ndarray:
    """``"949,50,1"`` (or ``"949/50/1"``) -> normalised train/valid/test fractions."""
    values = split_shares(split)
    if isinstance(values, str):
        raise ConfigError(f"split: {split!r} {values}")
    return np.asarray(values) / sum(values)


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Contiguous document ranges ``[lo, hi)`` for train, valid and test."""
    fractions = parse_split(split)
    bounds = np.concatenate([[0], np.round(np.cumsum(fractions) * num_documents)]).astype(np.int64)
    bounds[-1] = num_documents  # rounding never loses the last document
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(3)]


def samples_needed(global_batch: int, train_iters: int | None, eval_iters: int, eval_interval: int,
                   eval_batch: int | None = None,
                   batch_steps: tuple[tuple[int, int], ...] = ()) -> tuple[int, int, int]:
    """Samples each split must provide for the planned schedule (train from ``train_iters`` only):
    ``global_batch`` samples per step (with ``batch_steps``, the sum of each step's batch),
    ``eval_iters`` batches of ``eval_batch`` samples (None: a global batch) every ``eval_interval`` steps
    and once at the end."""
    g = global_batch
    iters = train_iters or 0
    interval = eval_interval or max(iters, 1)
    train = BatchSchedule.of(batch_steps).offset_at(iters) if batch_steps else iters * g
    eval_g = eval_batch or g
    valid = (iters // interval + 1) * eval_iters * eval_g if eval_iters else 0
    test = eval_iters * eval_g
    return train, valid, test


def _as_list(value: Any) -> list[Any] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return list(value) or None
    return [value]


def _open(prefix: str) -> MMapIndexedDataset:
    if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
        raise DataError(f"dataset {prefix}(.bin/.idx) not found; create it with `python prepare_data.py` "
                        "or tools/datasets/preprocess_data.py, or fix the path in the config")
    return MMapIndexedDataset(prefix)


def warm_up(prefixes: set[str]) -> None:
    """``mmap_warmup``: read every ``.bin`` once so its pages are in the page cache before step 1
    (the first steps otherwise wait on the disk for every sample they touch)."""
    chunk = 16 << 20
    for prefix in sorted(prefixes):
        with open(prefix + ".bin", "rb", buffering=0) as handle:
            while handle.read(chunk):
                pass
        logger.info("mmap_warmup: read %s.bin into the page cache", prefix)


# ---- one component: the files behind one weighted entry ----------------------------------------
@dataclass
class Component:
    roles: dict[str, str]  # role -> prefix: text/label/reward or chosen/rejected/chosen_label/rejected_label
    doc_range: tuple[int, int] | None = None  # None = every document

    @property
    def main(self) -> str:
        return self.roles.get("text") or self.roles["chosen"]

    def num_documents(self) -> int:
        lo, hi = self.doc_range or (0, len(_open(self.main)))
        return hi - lo


class _Builder:
    def __init__(self, config: DataRun, tokenizer: Any, rows: int) -> None:
        """``rows``: the embedding's rows (the padded vocabulary); a sample with a token id beyond them is
        refused by name (``token_range.py``)."""
        self.config = config
        self.rows = rows
        self.seq_length = config.seq_length
        self.seed = config.seed
        self.pack_impl = config.keys.pack_impl
        self.allow_chopped = config.keys.allow_chopped
        self.cache_dir = config.keys.cache_dir
        self.pad_id = int(getattr(tokenizer, "pad", 0) or 0) if tokenizer is not None else 0

    def component(self, name: str, c: Component, num_samples: int) -> Any:
        return TokenRangeChecked(self._component(name, c, num_samples), self.rows, c.roles)

    def _component(self, name: str, c: Component, num_samples: int) -> Any:
        files = {role: _open(p) for role, p in c.roles.items()}
        rng = c.doc_range or (0, len(files[("text" if "text" in files else "chosen")]))
        common: dict[str, Any] = {"seq_length": self.seq_length, "seed": self.seed, "cache_dir": self.cache_dir,
                  "pad_id": self.pad_id, "allow_chopped": self.allow_chopped}
        num_samples = max(1, int(num_samples))
        if "chosen" in files:
            references = None
            if self.config.reference_model is not None:
                references = (open_reference_logprobs(c.roles["chosen"], self.config.reference_model, self.seq_length),
                              open_reference_logprobs(c.roles["rejected"], self.config.reference_model,
                                                      self.seq_length))
            return PairwiseDataset(name, files["chosen"], files["rejected"], rng, num_samples,
                                   chosen_label=files.get("chosen_label"), rejected_label=files.get("rejected_label"),
                                   prefixes=(c.roles["chosen"], c.roles["rejected"]), references=references,
                                   **common)
        if "reward" in files:
            return RewardDataset(name, files["text"], files.get("label"), files["reward"], rng, num_samples,
                                 prefix=c.main, **common)
        if "label" in files:
            return SFTDataset(name, files["text"], files["label"], rng, num_samples, pack_impl=self.pack_impl,
                              prefix=c.main, shuffle=self.config.keys.data_shuffle, **common)
        return GPTDataset(name, files["text"], rng, num_samples, pack_impl=self.pack_impl, prefix=c.main,
                          shuffle=self.config.keys.data_shuffle, **common)

    def blend(self, name: str, comps: list[Component], weights: list[float] | None, num_samples: int) -> Any:
        if num_samples <= 0 or not comps:
            return None
        if name == "train" and self.config.keys.train_data_weights_schedule:
            return self.mixture(comps, num_samples)
        if len(comps) == 1:
            return self.component(name, comps[0], num_samples)
        if self.config.keys.weight_by_num_documents:
            w = weights_by_num_documents([c.num_documents() for c in comps], self.config.keys.weighted_sampler_alpha)
        elif weights is not None:
            if len(weights) != len(comps):
                raise ConfigError(f"{name}_data_weights has {len(weights)} entries for {len(comps)} datasets")
            w = np.asarray(weights, dtype=np.float64)
        else:
            w = np.ones(len(comps))
        cache = default_cache_dir(comps[0].main, self.cache_dir)
        index = cached_blend_index(w, num_samples, cache, name=f"{name}_blend")
        counts = samples_per_dataset(index[0], len(comps))
        parts = [self.component(f"{name}{i}", c, int(n)) for i, (c, n) in enumerate(zip(comps, counts))]
        return BlendedDataset(parts, w, num_samples, index=index)

    def mixture(self, comps: list[Component], num_samples: int) -> MixtureDataset:
        """``train_data_weights_schedule``: Levanter's block-deterministic mixture (``mixture.py``); each source is
        sized for the samples the first ``num_samples`` global samples take from it (it wraps past them)."""
        keys = self.config.keys
        stages = stages_at_offsets(keys.train_data_weights_schedule or [], BatchSchedule.of(self.config.batch_steps)
                                   if self.config.batch_steps else BatchSchedule.fixed(self.config.train_batch_size))
        index = MixtureIndex(stages, keys.mixture_block_size, self.seed)
        if len(comps) != index.num_sources:
            raise DataError(f"train_data_weights_schedule has {index.num_sources} weights per step for "
                              f"{len(comps)} train_data_paths")
        needed = index.samples_needed(num_samples)
        parts = [self.component(f"train{i}", c, int(n)) for i, (c, n) in enumerate(zip(comps, needed))]
        return MixtureDataset(parts, index, num_samples)


def _components_for_split(config: DataRun, split: str) -> list[Component] | None:
    """Explicit per-split paths (``train_data_paths``..., ``pos_train_data_paths``...)."""
    pos = config.keys.path_list(f"pos_{split}_data_paths")
    if pos:
        neg = config.keys.path_list(f"neg_{split}_data_paths") or []
        if len(neg) != len(pos):
            raise ConfigError(f"neg_{split}_data_paths must list one rejected dataset per pos_{split}_data_paths entry")
        pos_l = config.keys.path_list(f"pos_{split}_label_data_paths")
        neg_l = config.keys.path_list(f"neg_{split}_label_data_paths")
        comps = []
        for i, (p, n) in enumerate(zip(pos, neg)):
            roles = {"chosen": p, "rejected": n}
            if pos_l:
                roles["chosen_label"] = pos_l[i]
            if neg_l:
                roles["rejected_label"] = neg_l[i]
            comps.append(Component(roles))
        return comps
    paths = config.keys.path_list(f"{split}_data_paths")
    if not paths:
        return None
    labels = config.keys.path_list(f"{split}_label_data_paths")
    rewards = config.keys.path_list(f"{split}_reward_data_paths")
    for key, extra in ((f"{split}_label_data_paths", labels), (f"{split}_reward_data_paths", rewards)):
        if extra is not None and len(extra) != len(paths):
            raise ConfigError(f"{key} must have one entry per {split}_data_paths entry ({len(paths)})")
    comps = []
    for i, p in enumerate(paths):
        roles = {"text": p}
        if labels:
            roles["label"] = labels[i]
        if rewards and config.objective_dataset == "reward":
            roles["reward"] = rewards[i]
        comps.append(Component(roles))
    return comps


def _samples_per_epoch(builder: _Builder, comps: list[Component]) -> int:
    """Samples in one epoch of every training component (one epoch of each sample index)."""
    per_epoch = 0
    for c in comps:
        ds = builder.component("train", c, 1)
        per_epoch += len(ds.shuffle_idx) if hasattr(ds, "shuffle_idx") else len(ds.inner.shuffle_idx)
    return per_epoch


def _train_samples_from_epochs(builder: _Builder, comps: list[Component], epochs: int, g: int) -> int:
    """train_epochs x samples in one epoch of every training component, in whole global batches."""
    return max(g, (epochs * _samples_per_epoch(builder, comps)) // g * g)


def _read_shard_directory(c: Component, builder: _Builder, config: DataRun, vocab: int) -> Component:
    """A ``text`` path that is a directory holds fms-fsdp's token shards: read it once into a dataset."""
    path = c.roles.get("text")
    if path is None or not os.path.isdir(path):
        return c
    prefix = materialize_shards(path, builder.cache_dir, file_type=config.keys.shard_file_type, column=config.keys.shard_column,
                                tokenizer_dir=config.keys.shard_tokenizer, eos=config.keys.shard_eos_token,
                                bos=config.keys.shard_bos_token, strip=config.keys.shard_strip_tokens, vocab_size=vocab)
    return Component({**c.roles, "text": prefix}, c.doc_range)


def _read_jsonl_entry(c: Component, builder: _Builder, tokenizer: Any) -> Component:
    """A ``text`` path naming jsonl shards (``mixture.names_jsonl_shards``): tokenized once into the cache as
    ``train_urls`` are."""
    path = c.roles.get("text")
    if path is None or not names_jsonl_shards(path):
        return c
    prefix = materialize_urls([path], builder.cache_dir, tokenizer,
                              ray_address=builder.config.keys.tokenize_ray_address)
    return Component({**c.roles, "text": prefix}, c.doc_range)


def _dummy_kind(config: DataRun) -> DummyKind:
    if config.wants_pairs:
        return "pairwise"
    return "reward" if config.objective_dataset == "reward" else "lm"


def _check_matches_train_impl(config: DataRun, per_split: dict[str, list[Component] | None]) -> None:
    """The data must carry what the objective reads; say which keys to set when it does not."""
    impl = config.train_impl
    for split, comps in per_split.items():
        for c in comps or []:
            if config.wants_pairs and "chosen" not in c.roles:
                raise ConfigError(f"train_impl={impl}/dataset_impl=pairwise needs preference pairs: set "
                                  f"pos_{split}_data_paths and neg_{split}_data_paths (written by "
                                  "tools/datasets/preprocess_data_with_mask.py --mode pairwise)")
            if config.objective_dataset == "reward" and "reward" not in c.roles:
                raise ConfigError(f"train_impl={impl} needs {split}_reward_data_paths next to {split}_data_paths "
                                  "(written by tools/datasets/preprocess_data_with_mask.py --mode reward)")


def stream_count(config: DataRun) -> int:
    """``stream_shards``, or the global batch when unset (each stream then read by one data-parallel rank)."""
    return config.keys.stream_shards or config.train_batch_size


def _streamed(config: DataRun, builder: _Builder, tokenizer: Any, train_n: int, valid_n: int) -> DataSplits:
    """``streaming``: train_urls read and tokenized while training (``streaming.py``); validation_urls tokenized
    once into the cache, as without streaming (evaluations read them at positions of their own)."""
    streams = stream_count(config)
    train = StreamingDataset(config.keys.train_urls or [], tokenizer, config.seq_length, streams, max(train_n, 1),
                             checkpoint_every=config.train_batch_size // streams)
    valid = None
    if config.keys.validation_urls:
        prefix = materialize_urls(config.keys.validation_urls, builder.cache_dir, tokenizer,
                                  ray_address=config.keys.tokenize_ray_address)
        valid = builder.blend("valid", [Component({"text": prefix})], None, valid_n)
    return DataSplits(TokenRangeChecked(train, builder.rows, {"text": ",".join(train.paths)}), valid, None)


def build_datasets(config: DataRun, tokenizer: Any, padded_vocab_size: int) -> DataSplits:
    """Train/valid/test datasets; each is indexable by global sample and returns numpy dicts.

    ``tokenizer`` tokenizes ``train_urls`` and gives the pad id; ``padded_vocab_size`` bounds the
    random tokens of the dummy dataset and the token ids a sample of the files may hold.
    """
    train_n, valid_n, test_n = samples_needed(config.train_batch_size, config.train_iters, config.eval_iters,
                                              config.eval_interval, config.eval_batch_size, config.batch_steps)
    if config.keys.dataset_impl == "online":
        keys = config.keys
        online = lambda n, split: OnlineDataset(  # noqa: E731
            n, config.seq_length, split, keys.online_dataserver_ips, keys.online_dataserver_ports,
            keys.reinforce_leave_one_out) if n > 0 else None
        return DataSplits(online(max(train_n, 1), "train"), online(valid_n, "valid"), online(test_n, "test"))
    if config.keys.use_dummy_dataset:
        seq = config.seq_length
        seed, kind, pattern = config.seed, _dummy_kind(config), config.keys.dummy_data
        vocab = config.keys.dummy_data_vocab_size or padded_vocab_size
        if vocab > padded_vocab_size:
            raise ConfigError(f"dummy_data_vocab_size={vocab} exceeds the {padded_vocab_size} embedding rows")
        make = lambda n, s: DummyDataset(n, seq, vocab, seed + s, kind, pattern) if n > 0 else None  # noqa: E731
        return DataSplits(make(max(train_n, 1), 0), make(valid_n, 1), make(test_n, 2))

    config = dataclasses.replace(config, keys=localized(config.keys))  # data in object storage: its local copies
    builder = _Builder(config, tokenizer, padded_vocab_size)
    if config.keys.streaming:
        return _streamed(config, builder, tokenizer, train_n, valid_n)
    per_split: dict[str, list[Component] | None] = {}
    if config.keys.train_urls or config.keys.validation_urls:
        ray_address = config.keys.tokenize_ray_address
        for split, urls in (("train", config.keys.train_urls), ("valid", config.keys.validation_urls)):
            per_split[split] = [Component({"text": materialize_urls(urls, builder.cache_dir, tokenizer,
                                                                  ray_address=ray_address)})] if urls else None
        per_split["test"] = None
    elif any(_components_for_split(config, s) for s in SPLITS):
        per_split = {s: _components_for_split(config, s) for s in SPLITS}
    elif config.keys.data_path:
        prefixes = _as_list(config.keys.data_path) or []
        found: dict[str, list[Component]] = {s: [] for s in SPLITS}
        for prefix in prefixes:
            n = len(_open(prefix))
            for s, rng in zip(SPLITS, split_ranges(config.keys.split, n)):
                if rng[1] > rng[0]:
                    found[s].append(Component({"text": prefix}, rng))
        per_split = {**found}
    else:
        raise ConfigError("no training data: set data_path, train_data_paths, train_urls or use_dummy_dataset "
                          "(run `python prepare_data.py` to build the built-in corpus)")

    per_split = {s: [_read_shard_directory(_read_jsonl_entry(c, builder, tokenizer), builder, config, padded_vocab_size)
                     for c in comps] if comps else comps
                 for s, comps in per_split.items()}
    _check_matches_train_impl(config, per_split)
    train = per_split.get("train")
    if not config.train_iters and config.train_epochs and train:
        train_n = _train_samples_from_epochs(builder, train, config.train_epochs, config.train_batch_size)
    cap = None
    if config.max_train_epochs and train:
        # Levanter's EpochDataset (data/dataset.py:510-565@9263f81e): the data ends after this many epochs
        cap = config.max_train_epochs * _samples_per_epoch(builder, train)
        train_n = min(train_n, cap)
    if train_n > 0 and not per_split.get("train"):
        raise DataError("the train split is empty: check `split` and the data paths")
    if config.keys.mmap_warmup:
        warm_up({prefix for comps in per_split.values() for c in comps or [] for prefix in c.roles.values()})
    weights = {s: config.keys.split_weights(s) for s in SPLITS}
    datasets = {}
    for s, n in zip(SPLITS, (train_n, valid_n, test_n)):
        comps = per_split.get(s) or []
        if n > 0 and not comps and s != "train":
            logger.warning("%s split has no data; evaluation on it is skipped", s)
        datasets[s] = builder.blend(s, comps, weights[s], n)
    return DataSplits(datasets["train"], datasets["valid"], datasets["test"], train_samples_cap=cap)
