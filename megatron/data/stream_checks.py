"""Before-launch checks of ``streaming`` and ``stream_shards`` (``megatron/data/streaming.py``): what the streamed
order needs (train_urls, the packed cut, a step count, a stream count that divides every global batch), said with
the keys and their files rather than by a rank."""

from __future__ import annotations

from megatron.config_rules import RuleContext, rule
from megatron.objective_needs import needs_of

_CONFLICTS: tuple[tuple[str, str], ...] = (
    ("train_batch_size_schedule", "the streams are cut from one global batch size (a stream's positions are kept at "
     "multiples of it)"),
    ("train_epochs", "the number of samples of an epoch is not known before the stream has been read once: set "
     "train_iters"),
    ("max_train_epochs", "the epoch's end is not known before the stream has been read once: set train_iters"),
    ("checkpoint_validation_with_forward_pass", "it reads the first global batch again, and a stream is read "
     "forward only"),
    ("weight_by_num_documents", "there is one streamed source, nothing to weight"),
)


@rule
def streaming_reads_train_urls(ctx: RuleContext) -> list[str]:
    """``streaming`` streams ``train_urls`` (lm samples, packed); ``stream_shards`` only with it and dividing the
    global batch."""
    streaming, shards = ctx.get("streaming"), ctx.get("stream_shards")
    if not streaming:
        return [f"{ctx.show('stream_shards')} counts the logical streams of streaming: set streaming: true or remove "
                "it"] if shards is not None else []
    shown = ctx.show("streaming")
    problems = []
    if not ctx.get("train_urls"):
        problems.append(f"{shown} reads train_urls, which is not set: list the jsonl/parquet/arrow files or "
                        "save_to_disk directories there")
    if ctx.get("pack_impl") != "packed":
        problems.append(f"{shown} packs documents back to back: {ctx.show('pack_impl')} is not built for streams; "
                        "use pack_impl: packed")
    if ctx.get("dataset_impl") != "gpt2" or needs_of(ctx.get("train_impl")).dataset != "lm":
        problems.append(f"{shown} streams plain text for language modelling: {ctx.show('train_impl')} / "
                        f"{ctx.show('dataset_impl')} read other datasets; prepare them offline")
    for key, why in _CONFLICTS:
        if ctx.get(key):
            problems.append(f"{shown} with {ctx.show(key)}: {why}")
    batch = ctx.get("train_batch_size")
    if shards is not None and batch is not None and int(batch) % int(shards):
        problems.append(f"{ctx.show('stream_shards')} does not divide the global batch train_batch_size={batch}: "
                        "global sample i is sample i // S of stream i mod S, and every checkpoint must fall on the "
                        "same sample of every stream; use a divisor of the global batch")
    return problems


@rule
def data_shuffle_reads_text_datasets(ctx: RuleContext) -> list[str]:
    """``data_shuffle: false`` (or an era length) orders the text datasets (gpt2, SFT); preference pairs and reward
    samples keep their seeded order, so it is refused there rather than ignored; eras need 2 or more samples and
    an offline split (a stream's order is its logical streams')."""
    shuffle = ctx.get("data_shuffle")
    if shuffle is True or ctx.get("use_dummy_dataset"):
        return []
    if shuffle is not False and int(shuffle) < 2:
        return [f"{ctx.show('data_shuffle')} is an era length (samples permuted within eras of that many): give 2 or "
                "more, or true/false"]
    order = "in file order" if shuffle is False else f"in eras of {shuffle} samples"
    if ctx.get("dataset_impl") != "gpt2" or needs_of(ctx.get("train_impl")).dataset != "lm":
        return [f"{ctx.show('data_shuffle')} keeps text datasets {order}; the pairs or rewards that "
                f"{ctx.show('train_impl')} / {ctx.show('dataset_impl')} read are always shuffled from the seed"]
    if shuffle is not False and ctx.get("streaming"):
        return [f"{ctx.show('data_shuffle')} with {ctx.show('streaming')}: a stream is read in its logical streams' "
                "order, and eras would send every rank into every stream; set data_shuffle: false (or true) to "
                "say the streamed order, or prepare the data offline"]
    return []
