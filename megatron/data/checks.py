"""Before-launch checks of the data keys (``megatron/data/config.py``): one source of training data,
weights and label files that match their paths, a cache for raw-text URLs. Registered with every other
check (``megatron/config_rules.py``); the checks that open the files are in
``megatron/neox_arguments/file_checks.py``.
"""

from __future__ import annotations

from megatron import object_store
from megatron.config_rules import RuleContext, describe, rule
from megatron.data.config import PATH_KEYS, SPLITS
from megatron.errors import DeepyError
from megatron.object_store import is_remote
from megatron.objective_needs import reads_reference_files


@rule
def one_data_source(ctx: RuleContext) -> list[str]:
    split_keys = [f"{split}_data_paths" for split in SPLITS if ctx.get(f"{split}_data_paths")]
    problems = []
    if ctx.get("data_path") and split_keys:
        shown = ", ".join(ctx.show(key) for key in split_keys)
        problems.append(
            f"{ctx.show('data_path')} and {shown} both name data: data_path is split by `split`, the "
            f"*_data_paths lists are used as given; keep one way"
        )
    if ctx.get("train_urls") and (ctx.get("data_path") or split_keys):
        problems.append(
            f"{ctx.show('train_urls')} and tokenized data paths are both set: train from raw text "
            f"(train_urls) or from .bin/.idx files (data_path / *_data_paths), not both"
        )
    if split_keys and not ctx.get("train_data_paths"):
        problems.append(f"{', '.join(ctx.show(k) for k in split_keys)} without train_data_paths: add train_data_paths")
    # pairwise (DPO) data comes as pos_/neg_ lists; an online dataset is served, not read from disk
    has_data = any(ctx.get(key) for key in ("data_path", "train_data_paths", "train_urls", "pos_train_data_paths"))
    if not has_data and not ctx.get("use_dummy_dataset") and ctx.get("dataset_impl") != "online":
        problems.append(
            "no training data: set data_path, train_data_paths (pos_/neg_train_data_paths for pairwise "
            "data) or train_urls (or use_dummy_dataset: true for random tokens)"
        )
    if bool(ctx.get("pos_train_data_paths")) != bool(ctx.get("neg_train_data_paths")):
        given = "pos_train_data_paths" if ctx.get("pos_train_data_paths") else "neg_train_data_paths"
        problems.append(f"{ctx.show(given)} without its pair: pairwise data needs both pos_ and neg_ lists")
    return problems


@rule
def weights_match_paths(ctx: RuleContext) -> list[str]:
    problems = []
    for split in SPLITS:
        paths, weights = ctx.get(f"{split}_data_paths"), ctx.get(f"{split}_data_weights")
        if weights is None:
            continue
        if paths is None:
            problems.append(f"{ctx.show(f'{split}_data_weights')} without {split}_data_paths to weight")
        elif len(weights) != len(paths):
            problems.append(
                f"{split}_data_weights has {len(weights)} entries ({describe(ctx.source(f'{split}_data_weights'))}) "
                f"but {split}_data_paths has {len(paths)} ({describe(ctx.source(f'{split}_data_paths'))}): "
                f"give one weight per path"
            )
    return problems


@rule
def labels_match_paths(ctx: RuleContext) -> list[str]:
    problems = []
    for prefix in ("", "pos_", "neg_"):
        for split in SPLITS:
            label_key = f"{prefix}{split}_label_data_paths"
            data_key = f"{prefix}{split}_data_paths"
            labels, paths = ctx.get(label_key), ctx.get(data_key)
            if labels is None:
                continue
            if paths is None or len(labels) != len(paths):
                count = 0 if paths is None else len(paths)
                problems.append(
                    f"{label_key} has {len(labels)} entries ({describe(ctx.source(label_key))}) but "
                    f"{data_key} has {count}: give one label file per data file"
                )
    return problems


@rule
def pairs_and_rewards_match_paths(ctx: RuleContext) -> list[str]:
    """One rejected dataset per chosen one, and one reward file per data file (``build._components_for_split``
    pairs them by position)."""
    problems = []
    for split in SPLITS:
        for key, other in ((f"neg_{split}_data_paths", f"pos_{split}_data_paths"),
                           (f"{split}_reward_data_paths", f"{split}_data_paths")):
            given, paths = ctx.get(key), ctx.get(other)
            if given is None or (paths is None and key.startswith("neg_")):
                continue
            count = 0 if paths is None else len(paths)
            if len(given) != count:
                problems.append(f"{key} has {len(given)} entries ({describe(ctx.source(key))}) but {other} has "
                                f"{count}: they are read in pairs, one per entry")
    return problems


@rule
def urls_need_cache(ctx: RuleContext) -> list[str]:
    # streamed train_urls are tokenized while training, into no cache (megatron/data/streaming.py)
    urls = [key for key in ("train_urls", "validation_urls")
            if ctx.get(key) and not (key == "train_urls" and ctx.get("streaming"))]
    if not urls or ctx.get("cache_dir"):
        return []
    return [f"{ctx.show(urls[0])} needs cache_dir: the tokenized shards are written there"]


@rule
def split_is_three_shares(ctx: RuleContext) -> list[str]:
    """``split`` as the ranks read it (``build.split_shares``) when they cut the train, validation and test sets from
    ``data_path``."""
    if ctx.get("use_dummy_dataset") or not ctx.get("data_path"):
        return []
    # lazy: numpy, once data files are checked (deepy.py --help and config errors come first)
    from megatron.data.build import split_shares

    problem = split_shares(str(ctx.get("split")))
    return [f"{ctx.show('split')} {problem}"] if isinstance(problem, str) else []


@rule
def data_in_object_storage_exists(ctx: RuleContext) -> list[str]:
    """A data path in a bucket (``megatron/data/remote_data.py``): its scheme known, its bucket reachable with the
    standard credentials, and the objects there (a dataset prefix's ``.bin``/``.idx``, a shard, a directory); the
    ranks download it into the cache. One listing or ``HEAD`` per path; nothing is downloaded here."""
    # lazy: numpy, once data files are checked (deepy.py --help and config errors come first)
    from megatron.data.remote_data import URL_KEYS, describe_objects

    problems: list[str] = []
    for key in _remote_data_keys(ctx):
        value = ctx.get(key)
        for path in value if isinstance(value, list) else [value]:
            if not object_store.is_remote(str(path)):
                continue
            if object_store.scheme_of(str(path)) in object_store.READ_ONLY_SCHEMES:  # not a bucket: a download
                problems.append(f"{ctx.show(key)}: {path} would be downloaded; Deepy reads data from local paths and "
                                "object storage (s3://, gs://, ...) only - copy the files here and give their path")
                break
            try:
                object_store.check_url(key, str(path), describe(ctx.source(key)), write=False)
                describe_objects(str(path), patterns=key in URL_KEYS)
            except DeepyError as err:
                problems.append(f"{ctx.show(key)}: {err.message}" if not isinstance(err, object_store.StoreError)
                                else err.message)
                break
    return problems


def _remote_data_keys(ctx: RuleContext) -> list[str]:
    """The data keys with a path in object storage."""
    found = []
    for key in ("data_path", *PATH_KEYS, "train_urls", "validation_urls"):
        value = ctx.get(key)
        if any(is_remote(str(path)) for path in (value if isinstance(value, list) else [value] if value else [])):
            found.append(key)
    return found


@rule
def reference_logps_beside_local_data(ctx: RuleContext) -> list[str]:
    """DPO's reference log-probs are files beside each dataset (``<prefix>_<model>.bin/.idx``, written there by
    ``generate.py`` precompute); a dataset in object storage is read from a downloaded copy, and nothing writes
    them into the bucket or reads them from it."""
    remote = _remote_data_keys(ctx)
    if not remote:
        return []
    problems = []
    if ctx.get("text_gen_type") == "precompute":
        problems.append(f"{ctx.show('text_gen_type')} writes reference log-probs beside each dataset, and "
                        f"{ctx.show(remote[0])} is in object storage: copy the data to a local path to score it")
    elif ctx.get("reference_logps") and reads_reference_files(str(ctx.get("train_impl"))):
        problems.append(f"{ctx.show('reference_logps')} reads reference log-probs beside each dataset, and "
                        f"{ctx.show(remote[0])} is in object storage, where none are read: give the data (with its "
                        f"<prefix>_{ctx.get('reference_logps')}.bin/.idx) as a local path")
    return problems
