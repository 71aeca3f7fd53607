"""The data keys: which files (or URLs, or dummy tokens) each split reads, how they are blended and
split, and how documents become samples. GPT-NeoX files them under ``NeoXArgsTraining``, the online rollout
servers' (``online_dataserver_ips``/``_ports``) under ``NeoXArgsModel``.

Declared here, beside the datasets that read them (:func:`megatron.data.build.build_datasets`); the one
argument object (``NeoXArgs``) is composed of :class:`DataArgs`. The data also reads keys declared by
their owners (``seq_length`` with the model, ``seed`` with the process keys, ``train_iters``/``eval_*``
with the loop, ``train_batch_size`` with DeepSpeed's, ``train_impl``/``reference_logps`` with the
objective): :class:`DataRun` holds the data keys (its own instance of :class:`DataArgs`) with those
values, resolved once (``RunConfig.data``), and the trainer hands ``build_datasets`` that frozen object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from megatron.config_schema import ArgGroup
from megatron.data.stream_config import StreamArgs
from megatron.objective_needs import needs_of, reads_reference_files

SPLITS = ("train", "valid", "test")
# GPT-NeoX's per-split path lists: {prefix}{split}_{kind}data_paths
PATH_KEYS: tuple[str, ...] = tuple(
    f"{prefix}{split}_{kind}data_paths"
    for split in SPLITS
    for prefix, kinds in (("", ("", "label_", "reward_")), ("pos_", ("", "label_")), ("neg_", ("", "label_")))
    for kind in kinds
)
WEIGHT_KEYS: tuple[str, ...] = tuple(f"{split}_data_weights" for split in SPLITS)


class DataArgs(StreamArgs):
    """The data keys of GPT-NeoX's ``NeoXArgsTraining`` group, with Deepy's dummy data and
    Levanter-style raw-text URLs (streamed with :class:`~megatron.data.stream_config.StreamArgs`' keys)."""

    train_batch_size_schedule: list[dict[str, int]] | None = None
    """A global batch that changes with the step: ``[{start_step: 0, global_batch: 64}, {start_step: 100,
    global_batch: 128}, ...]`` (Levanter's train_batch_size schedule); step s uses the last entry whose
    start_step <= s, the micro batch stays fixed and gradient accumulation follows, the data offset
    advances by each step's batch. train_batch_size is step 0's batch. Not with a pipeline engine."""

    data_path: str | None = None
    """Prefix of one tokenized dataset (`<prefix>.bin/.idx`) that is split into train/valid/test by
    `split`."""

    train_data_paths: list[str] | None = None
    """Prefixes of the training datasets, blended by train_data_weights."""

    train_label_data_paths: list[str] | None = None
    """Per-token labels parallel to train_data_paths (-100 masks a token from the loss)."""

    train_reward_data_paths: list[str] | None = None
    """Per-sample rewards parallel to train_data_paths (reward-model and KTO training)."""

    test_data_paths: list[str] | None = None
    """Prefixes of the test datasets."""

    test_label_data_paths: list[str] | None = None
    """Per-token labels parallel to test_data_paths."""

    test_reward_data_paths: list[str] | None = None
    """Per-sample rewards parallel to test_data_paths."""

    valid_data_paths: list[str] | None = None
    """Prefixes of the validation datasets."""

    valid_label_data_paths: list[str] | None = None
    """Per-token labels parallel to valid_data_paths."""

    valid_reward_data_paths: list[str] | None = None
    """Per-sample rewards parallel to valid_data_paths."""

    pos_train_data_paths: list[str] | None = None
    """Chosen (preferred) responses for pairwise training."""

    pos_train_label_data_paths: list[str] | None = None
    """Labels for the chosen training responses."""

    pos_valid_data_paths: list[str] | None = None
    """Chosen responses for pairwise validation."""

    pos_valid_label_data_paths: list[str] | None = None
    """Labels for the chosen validation responses."""

    pos_test_data_paths: list[str] | None = None
    """Chosen responses for pairwise testing."""

    pos_test_label_data_paths: list[str] | None = None
    """Labels for the chosen test responses."""

    neg_train_data_paths: list[str] | None = None
    """Rejected responses for pairwise training, aligned with pos_train_data_paths."""

    neg_train_label_data_paths: list[str] | None = None
    """Labels for the rejected training responses."""

    neg_valid_data_paths: list[str] | None = None
    """Rejected responses for pairwise validation."""

    neg_valid_label_data_paths: list[str] | None = None
    """Labels for the rejected validation responses."""

    neg_test_data_paths: list[str] | None = None
    """Rejected responses for pairwise testing."""

    neg_test_label_data_paths: list[str] | None = None
    """Labels for the rejected test responses."""

    train_data_weights: list[float] | None = None
    """Sampling weight of each training dataset; unset means equal weights."""

    train_data_weights_schedule: list[tuple[int, list[float]]] | None = None
    """Deepy addition (Levanter's ``train_weights`` list form): training weights that change with the step,
    ``[[0, [w1, w2, ...]], [step, [...]], ...]``, one weight per train_data_paths entry, the first entry at step
    0, steps increasing. From the data offset of each step on (its consumed samples), the train split is
    Levanter's block-deterministic mixture (megatron/data/mixture.py): every block of mixture_block_size global
    samples holds int(w x block) samples of each source (normalised weights, the remainder to the largest),
    in an order shuffled per block; each step's offset must be a multiple of the block. Not with
    train_data_weights or weight_by_num_documents."""

    mixture_block_size: int = Field(2048, ge=1, lt=65536)
    """Global samples per block of train_data_weights_schedule's mixture (Levanter's mixture_block_size): the
    sources' counts are exact in every block, and every step where the weights change must start at a multiple
    of it. Below 2^16 (Levanter packs a source and its index into 32 bits)."""

    valid_data_weights: list[float] | None = None
    """Sampling weight of each validation dataset."""

    test_data_weights: list[float] | None = None
    """Sampling weight of each test dataset."""

    weight_by_num_documents: bool = False
    """Derive blending weights from document counts instead of the *_data_weights lists."""

    weighted_sampler_alpha: float = Field(1.0, ge=0)
    """Exponent on each dataset's document share for weight_by_num_documents (GPT-NeoX's formula)."""

    data_shuffle: bool | int = True
    """Deepy addition: shuffle the documents and the samples of each epoch from the seed (GPT-NeoX's order);
    false: documents and samples in file order, epoch after epoch (the samples streaming gives with
    stream_shards 1 in the first epoch); an integer L >= 2: documents in file order, samples permuted within
    consecutive eras of L samples (Levanter's shuffle: L, EraShufflingDataset). Read by the text datasets
    (gpt2 and SFT)."""

    pack_impl: Literal["packed", "pack_until_overflow", "unpacked"] = "packed"
    """How documents fill samples: packed back to back, packed until one would overflow, or one
    document per sample."""

    dataset_impl: Literal["gpt2", "pairwise", "online"] = "gpt2"
    """Kind of dataset: plain text (gpt2), chosen/rejected pairs, or online: rollouts fetched from the
    rollout servers at online_dataserver_ips/ports whenever the rank's buffer runs empty, for train_impl:
    reinforce (megatron/data/online_dataset.py, GPT-NeoX's protocol)."""

    # ---- online rollouts (dataset_impl: online), read by megatron/data/online_dataset.py ----

    online_dataserver_ips: str | list[str] = "localhost"
    """Host of the rollout server, or one host per data-parallel rank (rank r reads entry r)."""

    online_dataserver_ports: int | list[int] = 10000
    """Port of the rollout server (the same one for every data-parallel rank), or one port per
    data-parallel rank (rank r reads entry r)."""

    reinforce_leave_one_out: bool = False
    """REINFORCE's baseline, subtracted from each rollout's reward as it arrives: the mean reward of the
    other completions of the same prompt (leave-one-out, RLOO); false: the running mean of the last 100
    prompts' mean rewards, before this one (GPT-NeoX)."""

    allow_chopped: bool = True
    """Keep pairwise samples whose text had to be cut to fit seq_length."""

    mmap_warmup: bool = False
    """Touch every page of the mmapped data at start-up so the first steps are not I/O bound."""

    split: str = "969, 30, 1"
    """Train/valid/test proportions for data_path, as comma-separated weights."""

    use_dummy_dataset: bool = False
    """Train on random tokens without any data files (smoke tests and benchmarks)."""

    dummy_data: Literal["uniform", "counter"] = "uniform"
    """Deepy addition: what use_dummy_dataset's samples hold: uniform random ids, or fms-fsdp's
    counter (sample k holds the ids k*s ... k*s+s-1 modulo dummy_data_vocab_size, and its targets are
    those same ids, as fms-fsdp's SteadyCounter yields (x, x))."""

    dummy_data_vocab_size: int | None = Field(None, ge=2)
    """Deepy addition: the dummy data's ids stay below this (fms-fsdp's vocab_size); unset: the padded
    vocabulary."""

    train_urls: list[str] | None = None
    """Raw-text shards (local paths or URLs, jsonl/jsonl.zst) tokenized on the fly for training
    (Levanter-style)."""

    validation_urls: list[str] | None = None
    """Raw-text shards for validation, as train_urls."""

    cache_dir: str | None = None
    """Where tokenized shards from train_urls/validation_urls, and datasets read from token-shard
    directories, are cached."""

    tokenize_ray_address: str | None = None
    """Deepy addition (Levanter builds its cache with Ray, trainer.ray): tokenize train_urls/validation_urls
    (and *_data_paths entries naming jsonl shards) into cache_dir on a Ray cluster instead of in the building
    process: its address (host:port printed by `ray start --head`, ray://host:10001, auto) or `local` for a
    private Ray instance on this machine. One actor per CPU of the cluster; the cached dataset is
    byte-identical to the one built without Ray. Streamed train_urls (streaming) are not cached: the ranks
    tokenize them. None: tokenized by the rank that builds the cache. Needs the ray package."""

    # ---- token-shard directories (fms-fsdp's data), Deepy additions ----

    shard_file_type: Literal["arrow", "hf_parquet", "auto"] = "arrow"
    """A data path that is a directory holds fms-fsdp's shard files: arrow (one document of token ids
    per record batch, column 'tokens'), hf_parquet (a text column tokenized with shard_tokenizer) or
    auto (both, by extension); they are read once into a dataset under cache_dir."""

    shard_column: str = "tokens"
    """Column of hf_parquet shards to read (fms-fsdp's col_name); arrow shards are read at 'tokens'."""

    shard_tokenizer: str | None = None
    """Local Hugging Face tokenizer directory that tokenizes hf_parquet shards (fms-fsdp's tokenizer_path)."""

    shard_eos_token: int = Field(0, ge=0)
    """Token appended after every document of a shard directory (fms-fsdp's eos_token)."""

    shard_bos_token: int | None = Field(None, ge=0)
    """Token put before every document of a shard directory (fms-fsdp's bos_token); unset: none."""

    shard_strip_tokens: list[int] = []
    """Ids removed from the start and end of each shard document, with shard_eos_token and
    shard_bos_token, before they are added back (fms-fsdp's strip_tokens)."""

    # ---- what the datasets ask of these keys ----

    def path_list(self, key: str) -> list[str] | None:
        """The list a per-split path key (one of :data:`PATH_KEYS`) holds; None when unset or empty."""
        if key not in PATH_KEYS:
            raise KeyError(f"{key} is not a per-split data path key")
        value = getattr(self, key)
        return list(value) if value else None

    def split_weights(self, split: str) -> list[float] | None:
        """``{split}_data_weights``: the blending weights of one split's datasets (None: equal or by
        document counts)."""
        return getattr(self, f"{split}_data_weights")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataRun:
    """Everything :func:`~megatron.data.build.build_datasets` reads: the data keys (``keys``, the
    arguments object typed as :class:`DataArgs`) and the values of keys other components declare,
    resolved once above (``neox_arguments/run_config.py``: ``RunConfig.data``)."""

    keys: DataArgs
    """The data keys: which files, how they are blended, split and packed."""
    seq_length: int
    """Tokens per sample (each holds ``seq_length + 1``), declared with the model."""
    seed: int
    """Seeds the sample order (the process keys')."""
    train_batch_size: int
    """Samples per optimizer step over all ranks (the splits are sized in global batches)."""
    batch_steps: tuple[tuple[int, int], ...]
    """``train_batch_size_schedule`` as (start_step, global_batch) pairs; (): train_batch_size every step."""
    train_iters: int | None
    """The loop's optimizer steps; None: ``train_epochs`` sizes the train split."""
    train_epochs: int | None
    """Passes over the train split instead of ``train_iters``."""
    max_train_epochs: int | None
    """The train split ends after this many passes over its files (Levanter's ``epoch``); None: no end."""
    eval_iters: int
    """Batches per evaluation (the validation and test splits are sized by it)."""
    eval_batch_size: int
    """Samples per evaluation batch over all ranks (:func:`~megatron.data.batch.eval_batch_size`)."""
    eval_interval: int
    """Steps between evaluations."""
    train_impl: str
    """The objective (its plug-in's ``needs`` say which dataset kind it reads)."""
    reference_logps: str | None
    """DPO's precomputed reference log-probs (the objective's key)."""

    @property
    def objective_dataset(self) -> str:
        """What the objective reads (its plug-in's ``needs``): ``lm``, ``pairwise`` or ``reward``."""
        return needs_of(self.train_impl).dataset

    @property
    def wants_pairs(self) -> bool:
        """Chosen/rejected pairs (DPO, reward models) rather than single texts."""
        return self.keys.dataset_impl == "pairwise" or self.objective_dataset == "pairwise"

    @property
    def reference_model(self) -> str | None:
        """DPO's ``reference_logps``: preference pairs also carry the reference log-probs written next to
        each chosen/rejected dataset as ``<prefix>_<reference_model>`` by ``generate.py`` precompute;
        None when the objective reads no such files."""
        return self.reference_logps if reads_reference_files(self.train_impl) else None
