"""Rules that look at files and at what the run will read, before anything is launched.

Registered with :func:`megatron.config_rules.rule` like every other rule, so their problems
come in the same one message with ``file:line``. A file that is not visible from the machine
deepy.py runs on is an error for a launch on this machine, and only a warning when the ranks run on
other machines (node-local disks): the ranks check it again when they open it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import cast

from megatron.checkpointing import resume_checks
from megatron.checkpointing.discovery import resume_point
from megatron.config_rules import RuleContext, describe, rule
from megatron.data.batch_schedule import schedule_pairs
from megatron.data.config import PATH_KEYS, SPLITS
from megatron.data.mixture_schedule import names_jsonl_shards
from megatron.engine.lr_config import schedule_problems
from megatron.errors import ConversionError, DeepyError
from megatron.launcher.checks import runs_on_this_machine
from megatron.model.config import GPTConfig
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.honesty import FILLED_IN_KEYS, USER_SETTABLE_FILLED_IN
from megatron.object_store import is_remote
from megatron.tokenizer import build_tokenizer
from megatron.tokenizer.config import TokenizerArgs
from megatron.training.hf_save_config import HFSaveArgs


def _prefixes(ctx: RuleContext) -> Iterator[tuple[str, str]]:
    """(key, prefix) for every tokenized dataset on a file system the config names (those in object storage are
    ``megatron/data/checks.py``'s ``data_in_object_storage_exists``)."""
    data_path = ctx.get("data_path")
    if data_path:
        for prefix in data_path if isinstance(data_path, list) else [data_path]:
            if not is_remote(str(prefix)):
                yield "data_path", str(prefix)
    for key in PATH_KEYS:
        for prefix in ctx.get(key) or []:
            if not is_remote(str(prefix)):
                yield key, str(prefix)


def _missing_or_bad(prefix: str, shard_file_type: str = "arrow") -> str | None:
    # lazy: numpy, once data files are checked (deepy.py --help and config errors come first)
    from megatron.data.indexed_dataset import MMapIndexedDataset

    if os.path.isdir(prefix):  # fms-fsdp's token shards, read into a dataset at start-up
        # lazy: numpy, once data files are checked (deepy.py --help and config errors come first)
        from megatron.data.token_shards import shard_files

        return None if shard_files(prefix, shard_file_type) else f"no {shard_file_type} shard files below the directory"
    if names_jsonl_shards(prefix):  # raw jsonl shards, tokenized into cache_dir at start-up
        # lazy: numpy, once data files are checked (deepy.py --help and config errors come first)
        from megatron.data.url_sources import expand_braces

        absent = [p for p in expand_braces(prefix) if not os.path.isfile(p)]
        return f"shard {absent[0]} not found" if absent else None
    missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
    if missing:
        return f"{' and '.join(missing)} not found"
    try:
        MMapIndexedDataset(prefix)  # checks the header and that .bin and .idx agree
    except DeepyError as err:
        return err.message
    return None


def _not_here(ctx: RuleContext, what: str, problem: str) -> list[str]:
    """An error for a launch on this machine; a warning when the ranks run elsewhere."""
    if runs_on_this_machine(ctx):
        return [problem]
    ctx.warnings.append(f"{what} is not readable from this machine ({problem}); the ranks run on "
                        f"other machines and check it again when they open it")
    return []


def _written_by_preprocess(prefix: str) -> list[str]:
    """The datasets ``preprocess_data.py --output-prefix <prefix>`` wrote (``<prefix>_text_document``, one
    per ``--jsonl-keys`` key)."""
    found = sorted(str(p)[: -len(".idx")] for p in Path(prefix).parent.glob(f"{Path(prefix).name}_*_document.idx"))
    return [f for f in found if Path(f + ".bin").exists()]


@rule
def data_files_are_datasets(ctx: RuleContext) -> list[str]:
    if ctx.get("use_dummy_dataset"):
        return []
    problems: list[str] = []
    for key, prefix in _prefixes(ctx):
        bad = _missing_or_bad(prefix, str(ctx.get("shard_file_type")))
        if bad is None:
            continue
        fix = ("build it with `python prepare_data.py` or tools/datasets/preprocess_data.py, or fix the path"
               if "not found" in bad else "rebuild it with tools/datasets/preprocess_data.py")
        written = _written_by_preprocess(prefix) if "not found" in bad else []
        if written:
            # preprocess_data.py appends _<json key>_document to --output-prefix, as GPT-NeoX's does
            fix = (f"tools/datasets/preprocess_data.py names its output <output-prefix>_<key>_document: did you mean "
                   f"{key}={' or '.join(written)}?")
        problems += _not_here(ctx, f"{key}: {prefix}", f"{key} ({describe(ctx.source(key))}): dataset {prefix}: {bad}; {fix}")
    for key in ("train_urls", "validation_urls"):
        for url in ctx.get(key) or []:
            local = "://" not in str(url) or str(url).startswith("file://")
            path = str(url).removeprefix("file://")
            if local and not any(ch in path for ch in "{*?[") and not os.path.exists(path):
                problems += _not_here(ctx, f"{key}: {url}", f"{key} ({describe(ctx.source(key))}): {path} not found")
    return problems


@rule
def token_ids_fit_the_vocabulary(ctx: RuleContext) -> list[str]:
    """Every token id of the datasets on this machine is below the vocabulary (data tokenized with another
    tokenizer crashed a rank with an IndexError, or read zero embeddings under tensor parallelism): the
    tokenizer's, or the model's embedding rows where the config gives them (``padded_vocab_size``: fms-fsdp's
    model variants, whose ``src_vocab_size`` bounds the token data it trains on without a tokenizer). Up to
    ``SCAN_BUDGET_BYTES`` of token data are read; the ranks check every sample anyway."""
    if ctx.get("use_dummy_dataset"):
        return []
    # lazy: numpy, once data files are checked (deepy.py --help and config errors come first)
    from megatron.data.indexed_dataset import data_file_path
    from megatron.data.token_range import SCAN_BUDGET_BYTES, cannot_exceed, largest_token

    # a directory holds fms-fsdp's token shards, read into a dataset on the ranks (which check each sample)
    datasets = [(key, prefix) for key, prefix in _prefixes(ctx)
                if "reward" not in key and not os.path.isdir(prefix) and not names_jsonl_shards(prefix)
                and _missing_or_bad(prefix) is None]
    if not datasets:
        return []
    rows = ctx.get("padded_vocab_size") if ctx.given("padded_vocab_size") else None
    if rows is not None:  # the model's rows are the config's: the ranks refuse ids at or beyond them
        vocab = int(rows)
        bound = f"the model has {vocab} embedding rows ({ctx.show('padded_vocab_size')})"
        fix = "the data holds ids the model has no row for; give data tokenized for this model, or more rows"
    else:
        try:
            vocab = build_tokenizer(cast(TokenizerArgs, ctx.args)).vocab_size
        except Exception:  # noqa: BLE001 - tokenizer_loads reports it
            return []
        bound = f"{ctx.show('tokenizer_type')} has {vocab} tokens"
        fix = ("the data was tokenized with another tokenizer; rebuild it with this tokenizer, or set the tokenizer "
               "it was built with")
    problems: list[str] = []
    budget = SCAN_BUDGET_BYTES
    for key, prefix in datasets:
        if cannot_exceed(prefix, vocab):
            continue
        size = os.path.getsize(data_file_path(prefix))
        if size > budget:
            ctx.skipped.append(f"token ids of {prefix} ({size / 2**30:.1f} GiB) against the vocabulary: the ranks "
                               "check each sample as they read it")
            continue
        budget -= size
        found = largest_token(prefix)
        if found is not None and found.value >= vocab:
            problems.append(f"{key} ({describe(ctx.source(key))}): dataset {prefix} holds token id {found.value} "
                            f"(sequence {found.sequence}), but {bound}: {fix}")
    return problems


@rule
def splits_hold_a_sample(ctx: RuleContext) -> list[str]:
    """Each split of ``data_path`` that the run reads (train for ``train_iters``, validation and test for
    ``eval_iters``) holds at least one packed sample of ``seq_length + 1`` tokens; otherwise every rank stops
    at start-up ("the dataset yields no samples"). A split with no document at all is skipped with a warning
    by the ranks, so it is not refused here."""
    # lazy: numpy, once data files are checked (deepy.py --help and config errors come first)
    from megatron.data.build import samples_needed, split_ranges
    from megatron.data.indexed_dataset import MMapIndexedDataset

    data_path, seq = ctx.get("data_path"), ctx.get("seq_length")
    if ctx.get("use_dummy_dataset") or not data_path or not seq or ctx.get("pack_impl") != "packed" \
            or ctx.get("train_batch_size") is None or any(ctx.get(key) for key in PATH_KEYS):
        return []
    try:
        args = cast(NeoXArgs, ctx.args)
        needed = dict(zip(SPLITS, samples_needed(int(args.train_batch_size or 0), args.train_iters, args.eval_iters,
                                                 args.eval_interval, None,
                                                 schedule_pairs(args.train_batch_size_schedule))))
    except (TypeError, ValueError):
        return []
    problems: list[str] = []
    for prefix in data_path if isinstance(data_path, list) else [data_path]:
        if is_remote(str(prefix)) or _missing_or_bad(str(prefix)) is not None:
            continue  # data_files_are_datasets says what is wrong with it (the ranks check a bucket's)
        sizes = MMapIndexedDataset(str(prefix)).sizes
        try:
            ranges = split_ranges(str(ctx.get("split")), len(sizes))
        except DeepyError:
            return []  # the split's own rule reports it
        for name, (lo, hi) in zip(SPLITS, ranges):
            tokens = int(sizes[lo:hi].sum())
            if needed[name] > 0 and hi > lo and (tokens - 1) // int(seq) < 1:
                problems.append(
                    f"{ctx.show('split')}: the {name} split of {prefix} (documents {lo}-{hi - 1}) holds {tokens} tokens, "
                    f"fewer than one sample of {ctx.show('seq_length')} + 1; give that split a larger share, or "
                    f"use a shorter seq_length")
    return problems


@rule
def tokenizer_loads(ctx: RuleContext) -> list[str]:
    """The tokenizer files exist and are what ``tokenizer_type`` reads (built here, as the ranks will)."""
    kind = ctx.get("tokenizer_type")
    files = [ctx.get(k) for k in ("vocab_file", "merge_file") if ctx.get(k)]
    absent = [f for f in files if not os.path.isfile(str(f))]
    if absent:
        where = ", ".join(f"{k} at {describe(ctx.source(k))}" for k in ("vocab_file", "merge_file") if ctx.get(k) in absent)
        return _not_here(ctx, f"tokenizer file {absent[0]}",
                         f"tokenizer file(s) {', '.join(map(str, absent))} not found ({where})")
    try:
        # the arguments object itself (composed of TokenizerArgs): a tokenizer plug-in reads its own keys too
        build_tokenizer(cast(TokenizerArgs, ctx.args))
    except DeepyError as err:
        return [f"tokenizer_type={kind} ({describe(ctx.source('tokenizer_type'))}): {err.message}"]
    except Exception as err:  # noqa: BLE001 - each tokenizer library raises its own types
        return [
            f"tokenizer_type={kind} ({describe(ctx.source('tokenizer_type'))}) cannot read "
            f"vocab_file={ctx.get('vocab_file')!r}: {type(err).__name__}: {str(err)[:300]}; check that the "
            f"file is what {kind} reads (tokenizer.json, vocab.json + merges.txt, a SentencePiece model, ...)"
        ]
    return []


@rule
def dummy_tokens_fit_the_embedding(ctx: RuleContext) -> list[str]:
    """``dummy_data_vocab_size`` bounds the random tokens of the dummy dataset, which index the embedding: at most
    its rows, the tokenizer's vocabulary padded as the ranks pad it (or ``padded_vocab_size``)."""
    drawn = ctx.get("dummy_data_vocab_size")
    if not ctx.get("use_dummy_dataset") or drawn is None:
        return []
    rows = ctx.get("padded_vocab_size")
    if rows is None:
        try:
            tokenizer = cast(TokenizerArgs, ctx.args)
            rows = tokenizer.padded(build_tokenizer(tokenizer).vocab_size, ctx.tp)
        except Exception:  # noqa: BLE001 - tokenizer_loads reports a tokenizer that cannot be built here
            return []
    if drawn <= rows:
        return []
    return [f"{ctx.show('dummy_data_vocab_size')} exceeds the {rows} embedding rows ({ctx.show('tokenizer_type')}, "
            f"padded for model_parallel_size {ctx.tp}): use at most {rows}, or leave it out to draw from all of them"]


@rule
def hf_saves_can_be_written(ctx: RuleContext) -> list[str]:
    """``hf_save_path``: rank 0 builds the writer of the HF model directories before the first step
    (``interop/hf_save_writer.HFModelWriter``: the ``transformers`` class of the model, the tokenizer's files);
    built here the same way, so a model without a ``transformers`` class (ALiBi, T5 biases, ...) is refused before
    launch. Layouts the saves cannot run in are ``hf_save_layouts``' (``training/hf_save_config.py``)."""
    if ctx.get("hf_save_path") is None or ctx.tp > 1 or str(ctx.get("train_impl")) == "rm":
        return []
    # lazy: torch and DeepSpeed, only for HF saves (the dry run runs without them)
    from megatron.interop.hf_save_writer import HFModelWriter
    from megatron.training.hf_saves import save_dtype

    args = cast(NeoXArgs, ctx.args)
    try:
        rows = cast(TokenizerArgs, args).padded(build_tokenizer(cast(TokenizerArgs, args)).vocab_size, ctx.tp)
        config = cast(GPTConfig, args).for_tokenizer(rows)
        config.check_architecture()
    except Exception:  # noqa: BLE001 - the tokenizer's and the model's own rules say what is wrong
        return []
    try:
        HFModelWriter(config, cast(TokenizerArgs, args), save_dtype(cast(HFSaveArgs, args), args.precision),
                      args.lora_scale if args.lora_enabled else None)
    except ConversionError as err:
        return [f"{ctx.show('hf_save_path')}: {err.message.partition(': ')[2]}"]
    return []


@rule
def filled_in_keys_left_alone(ctx: RuleContext) -> list[str]:
    """Keys Deepy fills in itself (rank, do_train, ...) are not settings; the layout ones are compared
    with what Deepy computes in ``derive_layout``."""
    compared = {"world_size", "global_num_gpus", "is_pipe_parallel"}
    return [
        f"{ctx.show(key)}: {key} is filled in by Deepy ({FILLED_IN_KEYS[key]}); remove it from the config"
        for key in FILLED_IN_KEYS
        if key not in compared | USER_SETTABLE_FILLED_IN and ctx.given(key) and ctx.source(key) != "derived"
        and not (key == "config_files")
    ]


@rule
def dpo_reference_logps_exist(ctx: RuleContext) -> list[str]:
    """``reference_logps: NAME`` reads ``<prefix>_NAME`` next to every chosen/rejected dataset; a
    precompute run (``text_gen_type: precompute``) is the one that writes them, recording the ``seq_length``
    it scored them at, which must cover what this run reads (``megatron/data/reference_logprobs.py``)."""
    name = ctx.get("reference_logps")
    if not name or ctx.get("train_impl") != "dpo" or ctx.get("text_gen_type") == "precompute":
        return []
    # lazy: numpy, once data files are checked (deepy.py --help and config errors come first)
    from megatron.data.indexed_dataset import reference_logprobs_prefix

    problems: list[str] = []
    for key, prefix in _prefixes(ctx):
        if not key.startswith(("pos_", "neg_")) or "label" in key:
            continue
        reference = reference_logprobs_prefix(prefix, str(name))
        bad = _missing_or_bad(reference)
        if bad is not None:
            problems += _not_here(ctx, f"reference log-probs {reference}",
                                  f"{ctx.show('reference_logps')}: reference log-probs of {key} {prefix}: {bad}; write "
                                  f"them with `python deepy.py generate.py CONFIGS text_gen_type=precompute "
                                  f"precompute_model_name={name} load=<reference checkpoint>`")
            continue
        if _missing_or_bad(prefix) is None and ctx.get("seq_length"):
            # lazy: numpy, once data files are checked (deepy.py --help and config errors come first)
            from megatron.data.indexed_dataset import MMapIndexedDataset
            from megatron.data.reference_logprobs import context_problem

            longest = int(MMapIndexedDataset(prefix).sizes.max(initial=0))
            problem = context_problem(reference, longest, int(ctx.get("seq_length")))
            if problem is not None:
                problems.append(f"{ctx.show('reference_logps')} with {ctx.show('seq_length')}: reference log-probs "
                                f"{reference}: {problem}")
    return problems


@rule
def full_weights_start_has_no_adapters(ctx: RuleContext) -> list[str]:
    """A run without adapters (``lora_r: 0``) that starts from a checkpoint with LoRA adapters (``initialize_from``,
    or ``load`` with ``finetune``) would load them into a model that has no place for them ("Unexpected key(s)"
    on every rank). Refused here, naming the two ways on: keep training adapters (the checkpoint's lora_r), or
    merge them into the weights first (export merged, import back)."""
    if int(ctx.get("lora_r") or 0) > 0:
        return []
    if ctx.get("initialize_from"):
        key, iteration = "initialize_from", None
    elif ctx.get("load") and ctx.get("finetune"):
        key, iteration = "load", ctx.get("iteration")
    else:
        return []

    found = resume_point(Path(str(ctx.get(key))), iteration)
    if found is None:
        return []
    ckpt, meta = found
    saved = meta.get("args") or {}
    rank = int(saved.get("lora_r") or 0)
    if rank == 0:
        return []
    source = ctx.get(key)
    return [f"{ctx.show(key)}: {ckpt.name} holds LoRA adapters (lora_r {rank}, lora_alpha {saved.get('lora_alpha')}, "
            f"lora_target_modules {saved.get('lora_target_modules')}) and {ctx.show('lora_r')} trains every weight "
            f"without adapters. To go on training adapters, set lora_r: {rank} (and the same lora_alpha and "
            "lora_target_modules); to train every weight, merge the adapters into them first: "
            f"`python tools/ckpts/convert_neox_to_hf.py {source} MERGED_HF` (merges by default), then "
            f"`python tools/ckpts/convert_hf_to_neox.py MERGED_HF MERGED`, and train with MERGED/deepy_model.yml "
            "(the model's keys as written there) and initialize_from: MERGED"]


@rule
def checkpoint_fits_the_config(ctx: RuleContext) -> list[str]:
    """What the run starts from (``load``, ``initialize_from``, a restart's own checkpoint in ``save``) against the
    config, from the arguments the checkpoint recorded: ``megatron/checkpointing/resume_checks.py``. Only for a
    launch (``deepy.py`` names the script); a checkpoint not visible from here is checked by the ranks."""
    if ctx.entry_point is None:
        return []
    paths = [(key, str(ctx.get(key))) for key in ("load", "initialize_from", "save") if ctx.get(key)]
    remote = [(key, path) for key, path in paths if is_remote(path)]
    if remote:
        key, path = remote[0]
        ctx.skipped.append(f"what the run starts from: {key} {path} is in object storage (the ranks check it once "
                           "downloaded)")
        return []
    unseen = [(key, path) for key, path in paths if not os.path.exists(path)]
    if unseen and not runs_on_this_machine(ctx):
        key, path = unseen[0]
        ctx.skipped.append(f"what the run starts from: {key} {path} is not on this machine (the ranks check it)")
        return []
    problems = resume_checks.start_problems(ctx)
    start = resume_checks.planned_start(ctx)
    if start is not None:
        problems += resume_checks.fit_problems(ctx, start, schedule=schedule_problems)
    return problems
