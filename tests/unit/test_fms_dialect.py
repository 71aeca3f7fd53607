"""fms-fsdp's variants, flags, dummy data and token shards, as its code has them.

The variant shapes are fms-fsdp's ``get_model_config`` (fms_fsdp/utils/config_utils.py at
foundation-model-stack/fms-fsdp 5a296afe) built with ibm-fms 1.13.1's ``LLaMA`` on the meta device
(``LLaMABlock.ff_sub_layer.hidden_dim``, ``sum(p.numel())``), written down here. The shard layout is
``ArrowHandler``'s (fms_fsdp/utils/dataset_utils.py): one document per record batch, token ids in a
``tokens`` column of a pyarrow IPC file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatron.errors import ConfigError, DataError
from megatron.neox_arguments.dialects import split_argv
from megatron.neox_arguments.loading import load_config


def fms_args(*flags: str):  # noqa: ANN201 - the resolved config
    _, parsed = split_argv(list(flags))
    return load_config([], (), None, parsed).args


# variant: (hidden, layers, heads, kv heads, MLP, vocab, positions, rope theta, parameters) from ibm-fms's LLaMA
FMS_VARIANTS = {
    "llama2_70b": (8192, 80, 64, 8, 28672, 32000, 4096, 10000.0, 68_976_648_192),
    "llama2_34b": (8192, 48, 64, 8, 22016, 32000, 16384, 1000000.0, 33_743_970_304),
    "llama2_13b": (5120, 40, 40, 40, 13824, 32000, 4096, 10000.0, 13_015_864_320),
    "llama2_7b": (4096, 32, 32, 32, 11008, 32000, 4096, 10000.0, 6_738_415_616),
    "llama2_1.4b": (2048, 24, 16, 4, 6144, 32000, 4096, 10000.0, 1_288_800_256),
    "llama3_8b": (4096, 32, 32, 8, 14336, 128256, 8192, 500000.0, 8_030_261_248),
    "llama3_8b_4k": (4096, 32, 32, 8, 14336, 128256, 4096, 500000.0, 8_030_261_248),
    "llama3_1.8b": (2048, 24, 16, 8, 7168, 128256, 8192, 500000.0, 1_884_391_424),
    "llama3_1.8b_4k": (2048, 24, 16, 8, 7168, 128256, 4096, 500000.0, 1_884_391_424),
    "llama3_3.2b": (3072, 24, 24, 8, 8192, 128256, 8192, 500000.0, 3_204_074_496),
    "llama3_3.2b_4k": (3072, 24, 24, 8, 8192, 128256, 4096, 500000.0, 3_204_074_496),
    "llama3_70b": (8192, 80, 64, 8, 28672, 128256, 8192, 500000.0, 70_553_706_496),
    "llama3_70b_4k": (8192, 80, 64, 8, 28672, 128256, 4096, 500000.0, 70_553_706_496),
    "llama3_194m_4k": (1024, 10, 8, 8, 2816, 128256, 4096, 500000.0, 391_140_352),
}


@pytest.mark.parametrize("variant", sorted(FMS_VARIANTS))
def test_every_variant_builds_fms_fsdps_shape(variant: str) -> None:
    from megatron.model.flops import num_parameters

    a = fms_args(f"--model_variant={variant}", "--use_dummy_dataset=True")
    # the MLP width built (each half of the gated MLP), as fms-fsdp's GatedLinearUnit has it; GPT-NeoX's
    # intermediate_size that gives it is 3x (megatron/model/mlp_width.py)
    got = (a.hidden_size, a.num_layers, a.num_attention_heads, a.num_kv_heads, a.ffn_hidden_size,
           a.padded_vocab_size, a.max_position_embeddings, float(a.rotary_emb_base))
    assert got == FMS_VARIANTS[variant][:8]
    assert (a.pos_emb, a.norm, a.activation, a.no_weight_tying) == ("rotary", "rmsnorm", "swiglu", True)
    assert not (a.use_bias_in_attn_linear or a.use_bias_in_mlp or a.use_bias_in_norms)
    assert num_parameters(a.for_tokenizer(a.padded_vocab_size)) == FMS_VARIANTS[variant][8]


def test_old_names_and_the_default_variant() -> None:
    """train_config defaults to 7b, the llama2_7b of fms-fsdp before its rename (be50bb6)."""
    assert fms_args("--use_dummy_dataset=True").hidden_size == 4096
    assert fms_args("--model_variant=13b", "--use_dummy_dataset=True").ffn_hidden_size == 13824


def test_mamba_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"model_variant = 'mamba_9.8b' .*Mamba-2 hybrid .*Mamba-1 layers"):
        fms_args("--model_variant=mamba_9.8b", "--use_dummy_dataset=True")


def test_train_sh_as_written_implies_the_13_default_datasets(tmp_path: Path) -> None:
    """scripts/train.sh gives no datasets: train_config's 13 directories under data_path, its weights."""
    a = fms_args("--use_dummy_dataset=False", f"--data_path={tmp_path}/tokens", "--sharding_strategy=HSDP")
    assert len(a.train_data_paths) == 13 and a.train_data_paths[0] == f"{tmp_path}/tokens/lang=en/dataset=commoncrawl"
    assert a.train_data_weights[:3] == [7725.0, 500.0, 550.0] and a.train_data_weights[-1] == 100.0
    assert a.sharding_strategy == "hsdp"  # upper case, as fms-fsdp's docs write it
    assert (a.shard_file_type, a.shard_eos_token, a.num_workers, a.compile_layers) == ("arrow", 0, 1, True)


def test_vocab_size_is_the_dummy_datas_not_the_embeddings() -> None:
    a = fms_args("--model_variant=llama3_194m_4k", "--use_dummy_dataset=True", "--vocab_size=1000")
    assert (a.padded_vocab_size, a.dummy_data, a.dummy_data_vocab_size) == (128256, "counter", 1000)
    assert fms_args("--model_variant=llama3_194m_4k", "--use_dummy_dataset=True").dummy_data_vocab_size == 32000
    with pytest.raises(ConfigError, match=r"vocab_size - 1 = 31999, beyond the 8192 embedding rows of llama_tiny"):
        fms_args("--model_variant=llama_tiny", "--use_dummy_dataset=True")


def test_token_flags_become_the_shard_keys(tmp_path: Path) -> None:
    a = fms_args("--data_path=d", "--datasets=x", "--weights=1", "--bos_token=1", "--eos_token=2", "--strip_tokens=5,6",
                 "--file_type=hf_parquet", "--col_name=text", f"--tokenizer_path={tmp_path}")
    assert (a.shard_bos_token, a.shard_eos_token, a.shard_strip_tokens) == (1, 2, [5, 6])
    assert (a.shard_file_type, a.shard_column, a.shard_tokenizer) == ("hf_parquet", "text", str(tmp_path))
    for flag, reason in (("--bol_token=3", "bol_token .*not built"), ("--logical_shards=64", "logical shards"),
                         ("--col_name=text", "ArrowHandler\\(\\) without col_name")):
        with pytest.raises(ConfigError, match=reason):
            fms_args("--data_path=d", "--datasets=x", "--weights=1", flag)
    assert fms_args("--use_dummy_dataset=True", "--logical_shards=1024").train_iters == 1_000_000


def test_counter_dummy_data_targets_are_the_inputs() -> None:
    """SteadyCounter yields (x, x): x = consecutive ids modulo vocab_size, row after row."""
    import torch

    from megatron.data.dummy_dataset import DummyDataset
    from megatron.objectives.base import shifted

    data = DummyDataset(4, 5, 7, pattern="counter")
    rows = [data[i] for i in range(3)]
    batch = {key: torch.as_tensor(np.stack([r[key] for r in rows])) for key in rows[0]}
    inputs, targets = shifted(batch, "text", "label", None)
    expected = torch.tensor([[x % 7 for x in range(5 * i, 5 * i + 5)] for i in range(3)])
    assert torch.equal(inputs, expected) and torch.equal(targets, expected)
    assert data[10**9]["text"][0] == (5 * 10**9) % 7  # a function of the sample index, O(1)


def write_arrow_shard(path: Path, docs: list[list[int]]) -> None:
    """fms-fsdp's arrow shard: an IPC file, one record batch (one document) per write, column 'tokens'."""
    import pyarrow as pa

    schema = pa.schema([("tokens", pa.uint32())])
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.ipc.new_file(str(path), schema) as writer:
        for doc in docs:
            writer.write(pa.record_batch([pa.array(doc, type=pa.uint32())], schema=schema))


def test_arrow_shards_are_read_as_streaming_doc_dataset_reads_them(tmp_path: Path) -> None:
    from megatron.data.indexed_dataset import MMapIndexedDataset
    from megatron.data.token_shards import materialize_shards

    root = tmp_path / "lang=en" / "dataset=x"
    write_arrow_shard(root / "b" / "part-1.arrow", [[9, 10, 11]])
    write_arrow_shard(root / "a.arrow", [[0, 3, 4, 0], [5], [7, 8], [6, 6, 6, 6, 1]])
    (root / "notes.txt").write_text("not a shard")
    def read(**settings: object) -> list[list[int]]:
        data = MMapIndexedDataset(materialize_shards(str(root), str(tmp_path / "cache"), vocab_size=64, **settings))
        return [list(map(int, data[i])) for i in range(len(data))]

    # a.arrow before b/part-1.arrow (the walked tree, sorted); one leading and one trailing id of the drop
    # set (strip_tokens with eos 0) go; [5] with its eos is one token short of min_length 3; eos after each
    assert read(eos=0, strip=[6]) == [[3, 4, 0], [7, 8, 0], [6, 6, 6, 1, 0], [9, 10, 11, 0]]
    # with bos 1: bos joins the drop set and comes before each document, and [5] reaches 3 tokens
    assert read(eos=0, bos=1, strip=[6]) == [[1, 3, 4, 0], [1, 5, 0], [1, 7, 8, 0], [1, 6, 6, 6, 0], [1, 9, 10, 11, 0]]
    prefix = materialize_shards(str(root), str(tmp_path / "cache"), eos=0, bos=1, strip=[6], vocab_size=64)
    again = materialize_shards(str(root), str(tmp_path / "cache"), eos=0, bos=1, strip=[6], vocab_size=64)
    assert again == prefix  # read once: a second call finds the dataset
    with pytest.raises(DataError, match="a.arrow: token id 8 is beyond the model.s 8 embedding rows"):
        materialize_shards(str(root), str(tmp_path / "cache8"), vocab_size=8)
    with pytest.raises(DataError, match="no hf_parquet shard files"):
        materialize_shards(str(root), str(tmp_path / "cache"), file_type="hf_parquet")


def test_parquet_shards_are_tokenized_with_the_tokenizer_directory(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    from megatron.data.indexed_dataset import MMapIndexedDataset
    from megatron.data.token_shards import materialize_shards

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 2, "b": 3, "c": 4, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path / "tok")
    (tmp_path / "ds").mkdir()
    pq.write_table(pa.table({"body": ["a b c", "c c"]}), tmp_path / "ds" / "p.parquet")
    prefix = materialize_shards(str(tmp_path / "ds"), str(tmp_path / "cache"), file_type="hf_parquet", column="body",
                                tokenizer_dir=str(tmp_path / "tok"), eos=0)
    data = MMapIndexedDataset(prefix)
    assert [list(map(int, data[i])) for i in range(len(data))] == [[2, 3, 4, 0], [4, 4, 0]]


def test_the_shard_keys_shape_what_training_reads(tmp_path: Path) -> None:
    """train_data_paths naming shard directories, through build_datasets: each sample is packed from the
    framed documents; the counter dummy data stays below dummy_data_vocab_size."""
    from megatron.data.build import build_datasets
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.run_config import data_run

    write_arrow_shard(tmp_path / "x" / "0.arrow", [[7, 8, 9, 10, 11] for _ in range(20)])
    write_arrow_shard(tmp_path / "y" / "0.arrow", [[2, 3, 4, 5, 6] for _ in range(20)])
    base = dict(seq_length=6, seed=1, train_batch_size=4, train_iters=5, eval_iters=0, eval_interval=10,
                cache_dir=str(tmp_path / "cache"))
    train = build_datasets(data_run(NeoXArgs(**base, train_data_paths=[str(tmp_path / "x")], shard_bos_token=1,
                                              shard_eos_token=2, shard_strip_tokens=[11])), None, 64).train
    sample = [int(t) for t in train[0]["text"]]
    stream = [1, 7, 8, 9, 10, 2]  # bos, the document without its stripped 11, eos; documents packed back to back
    start = stream.index(sample[0])
    assert sample == (stream * 3)[start:start + 7]
    blended = build_datasets(data_run(NeoXArgs(**base, train_data_paths=[str(tmp_path / "x"), str(tmp_path / "y")],
                                               train_data_weights=[1.0, 3.0])), None, 64).train
    from_y = sum(any(2 <= int(t) <= 6 for t in blended[i]["text"]) for i in range(40))
    assert 24 <= from_y <= 36  # weights 1:3 blend the two directories (y: ids 2..6, x: 7..11)
    counter = build_datasets(data_run(NeoXArgs(**base, use_dummy_dataset=True, dummy_data="counter",
                                               dummy_data_vocab_size=5)), None, 64).train
    assert [int(t) for t in counter[1]["text"][:6]] == [1, 2, 3, 4, 0, 1]  # ids 6..11 modulo 5


def test_the_profiler_traces_every_rank_so_rank0_only_must_be_off() -> None:
    """get_profiler returns None on ranks other than 0 unless profiler_rank0_only is false (its default
    is true); Deepy's profiler writes one trace per rank."""
    with pytest.raises(ConfigError, match="traces every rank"):
        fms_args("--use_dummy_dataset=True", "--use_profiler=True")
    assert fms_args("--use_dummy_dataset=True", "--use_profiler=True", "--profiler_rank0_only=False").profile


def test_a_load_path_without_checkpoints_starts_from_scratch_as_fms_fsdp_does(tmp_path: Path) -> None:
    """fms-fsdp's Checkpointer.load (checkpointing_utils.py:165-211 at 5a296afe): a ckpt_load_path whose
    checkpoints/ is missing or empty is "No valid checkpoint detected ..., starting from scratch"."""
    save = tmp_path / "save"
    fresh = fms_args("--use_dummy_dataset=True", f"--ckpt_save_path={save}", f"--ckpt_load_path={tmp_path / 'none'}")
    assert fresh.load is None and fresh.save == str(save / "checkpoints")
    (tmp_path / "old" / "checkpoints" / "step_10_ckp").mkdir(parents=True)
    resumed = fms_args("--use_dummy_dataset=True", f"--ckpt_save_path={save}", f"--ckpt_load_path={tmp_path / 'old'}")
    assert resumed.load == str(tmp_path / "old" / "checkpoints")
    same = fms_args("--use_dummy_dataset=True", f"--ckpt_save_path={save}", f"--ckpt_load_path={save}")
    assert same.load == str(save / "checkpoints")  # a restart's own directory, empty on the first run


# ----------------------------------------------------------- pre-tokenized data against the model's rows
def write_token_dataset(prefix: Path, docs: list[list[int]], dtype: type = np.uint16) -> None:
    """A tokenized dataset (``.bin``/``.idx``, what prepare_data.py and preprocess_data.py write)."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in docs:
        builder.add_item(np.asarray(doc, dtype=np.int64))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def fms_dry_run(tmp: Path, *flags: str):  # noqa: ANN201 - the resolved config
    """``deepy.py --dry-run train.py <flags>`` as the command runs it (every check before launch), one CPU rank."""
    from megatron.app.deepy import parse_command, resolve

    repo = Path(__file__).resolve().parents[2]
    return resolve(parse_command(["--dry-run", str(repo / "train.py"), *flags, f"--ckpt_save_path={tmp / 'ck'}",
                                  f"--ckpt_load_path={tmp / 'ck'}", f"--tracker_dir={tmp / 'logs'}", "--seq_length=32",
                                  "--mixed_precision=False", "--num_gpus=1"]))


def test_pre_tokenized_data_is_checked_against_the_variants_rows_not_a_stand_in_tokenizer(tmp_path: Path) -> None:
    """fms-fsdp trains on token ids without a tokenizer: the ids are bounded by the model variant's embedding
    rows (its ``src_vocab_size``: llama_small's 32000), not by the 512 tokens of the byte-level tokenizer that
    stands in for the end-of-document id. The README's pydocs data holds ids up to 8191 (an 8192-token
    tokenizer): it passes the dry run; an id of 32000 has no row and is refused before launch, naming the rows."""
    write_token_dataset(tmp_path / "data" / "pydocs_text_document", [[(37 * j) % 8191 + 1 for j in range(50)] + [8191]])
    flags = ("--use_dummy_dataset=False", f"--data_path={tmp_path / 'data'}", "--datasets=pydocs_text_document",
             "--weights=1", "--model_variant=llama_small")
    resolved = fms_dry_run(tmp_path, *flags)
    assert resolved.args.padded_vocab_size == 32000 and resolved.args.tokenizer_type == "CharLevelTokenizer"
    write_token_dataset(tmp_path / "wide" / "pydocs_text_document", [[5, 6, 32000, 7]], np.int32)
    with pytest.raises(ConfigError, match=r"holds token id 32000 \(sequence 0\), but the model has 32000 embedding "
                                          r"rows \(padded_vocab_size=32000 \(.*model_variant=llama_small"):
        fms_dry_run(tmp_path, *flags[:1], f"--data_path={tmp_path / 'wide'}", *flags[2:])


def test_ids_beyond_a_small_variants_rows_are_refused_before_launch(tmp_path: Path) -> None:
    """llama_tiny's 8192 rows: an id of 8999 has no row. The ranks would refuse it (``TokenRangeChecked``) after the
    launch; the dry run refuses it first, naming the model's rows (not a tokenizer this run does not have)."""
    write_token_dataset(tmp_path / "data" / "ds_text_document", [[1, 2, 3, 8999]])
    with pytest.raises(ConfigError, match=r"holds token id 8999 .* the model has 8192 embedding rows"):
        fms_dry_run(tmp_path, "--use_dummy_dataset=False", f"--data_path={tmp_path / 'data'}",
                    "--datasets=ds_text_document", "--weights=1", "--model_variant=llama_tiny")
