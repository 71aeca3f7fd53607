"""The typed view of the data keys: where each split's files are, how samples are packed and how
many each split must provide.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs

SPLITS = ("train", "valid", "test")
# GPT-NeoX's per-split path lists: {prefix}{split}_{kind}data_paths
PATH_KEYS: tuple[str, ...] = tuple(
    f"{prefix}{split}_{kind}data_paths"
    for split in SPLITS
    for prefix, kinds in (("", ("", "label_", "reward_")), ("pos_", ("", "label_")), ("neg_", ("", "label_")))
    for kind in kinds
)
WEIGHT_KEYS: tuple[str, ...] = tuple(f"{split}_data_weights" for split in SPLITS)


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    seq_length: int
    seed: int = 1234
    train_batch_size: int
    """Global batch in samples: the sample counts are whole global batches."""
    train_iters: int | None = None
    train_epochs: int | None = None
    eval_iters: int = 100
    eval_interval: int = 1000

    data_path: str | None = None
    split: str = "969, 30, 1"
    paths: Mapping[str, list[str] | None] = field(default_factory=dict)
    """Every key of PATH_KEYS -> its list (or None)."""
    weights: Mapping[str, list[float] | None] = field(default_factory=dict)
    """``{split}_data_weights`` -> its list (or None)."""
    weight_by_num_documents: bool = False
    weighted_sampler_alpha: float = 1.0

    pack_impl: str = "packed"
    allow_chopped: bool = True
    dataset_impl: str = "gpt2"
    train_impl: str = "normal"
    use_dummy_dataset: bool = False
    train_urls: list[str] | None = None
    validation_urls: list[str] | None = None
    cache_dir: str | None = None
    mmap_warmup: bool = False
    reference_model: str | None = None
    """DPO's ``reference_logps``: preference pairs also carry the reference log-probs written next to
    each chosen/rejected dataset as ``<prefix>_<reference_model>`` by ``generate.py`` precompute."""
    """Read every data file once at start-up so the first steps are not I/O bound."""

    def path_list(self, key: str) -> list[str] | None:
        value = self.paths.get(key)
        return list(value) if value else None

    @property
    def wants_pairs(self) -> bool:
        """Chosen/rejected pairs (DPO, reward models) rather than single texts."""
        return self.dataset_impl == "pairwise" or self.objective_dataset == "pairwise"

    @property
    def objective_dataset(self) -> str:
        """What the objective reads (its plug-in's ``needs``): ``lm``, ``pairwise`` or ``reward``."""
        from megatron.training.objectives.registry import needs_of

        return needs_of(self.train_impl).dataset

    @classmethod
    def of(cls, **keys: Any) -> DataConfig:
        """From GPT-NeoX key names directly (tools and tests that have no config file): the
        per-split path and weight keys are gathered into ``paths``/``weights``; any other name must be
        a field of this class."""
        paths = {key: keys.pop(key) for key in PATH_KEYS if key in keys}
        weights = {key: keys.pop(key) for key in WEIGHT_KEYS if key in keys}
        return cls(paths=paths, weights=weights, **keys)

    @classmethod
    def from_args(cls, args: NeoXArgs) -> DataConfig:
        from megatron.training.objectives.registry import reads_reference_files

        if args.seq_length is None or args.train_batch_size is None:
            from megatron.errors import ConfigError

            raise ConfigError("seq_length and train_batch_size must be known before building datasets")
        return cls(
            seq_length=args.seq_length,
            seed=args.seed,
            train_batch_size=args.train_batch_size,
            train_iters=args.train_iters,
            train_epochs=args.train_epochs,
            eval_iters=args.eval_iters,
            eval_interval=args.eval_interval,
            data_path=args.data_path,
            split=args.split,
            paths={key: getattr(args, key) for key in PATH_KEYS},
            weights={key: getattr(args, key) for key in WEIGHT_KEYS},
            weight_by_num_documents=args.weight_by_num_documents,
            weighted_sampler_alpha=args.weighted_sampler_alpha,
            pack_impl=args.pack_impl,
            allow_chopped=args.allow_chopped,
            dataset_impl=args.dataset_impl,
            train_impl=args.train_impl,
            use_dummy_dataset=args.use_dummy_dataset,
            train_urls=args.train_urls,
            validation_urls=args.validation_urls,
            cache_dir=args.cache_dir,
            mmap_warmup=args.mmap_warmup,
            reference_model=args.reference_logps if reads_reference_files(args.train_impl) else None,
        )
