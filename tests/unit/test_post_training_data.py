"""Post-training data: masked preprocessing (prompt/completion, chat templates), SFT label alignment,
pairwise and KTO reward datasets, and build_datasets for each train_impl."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron.data.build import DataSplits, build_datasets
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.run_config import data_run
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.pairwise_dataset import PairwiseDataset
from megatron.data.reward_dataset import RewardDataset
from megatron.data.sample_index import packed_samples_per_epoch
from megatron.data.sft_dataset import SFTDataset
from megatron.errors import DataError
from megatron.tokenizer.char_level import CharLevelTokenizer
from tools.datasets import preprocess_data_with_mask as tool


TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _run(tmp_path: Path, records: list[dict], mode: str = "sft", extra: list[str] | None = None) -> str:
    src = _jsonl(tmp_path / f"{mode}.jsonl", records)
    prefix = str(tmp_path / "out" / mode)
    rc = tool.main(["--input", src, "--output-prefix", prefix, "--mode", mode,
                    "--tokenizer-type", "CharLevelTokenizer", *(extra or [])])
    assert rc == 0
    return prefix


def _decode(ids: np.ndarray) -> str:
    return bytes(int(i) for i in ids if 0 < i < 256).decode()


def test_prompt_completion_labels(tmp_path: Path) -> None:
    prefix = _run(tmp_path, [{"q": "2+2=", "a": "4"}, {"q": "hi ", "a": "there"}],
                  extra=["--prompt-key", "q", "--completion-key", "a", "--append-eod"])
    text = MMapIndexedDataset(prefix + "_text_document")
    label = MMapIndexedDataset(prefix + "_label_document")
    assert label.dtype == np.int32
    assert list(text[0]) == list(b"2+2=4") + [0]
    assert list(label[0]) == [-100] * 4 + [ord("4"), 0]
    assert _decode(text[1]) == "hi there" and list(label[1][:3]) == [-100] * 3


def test_chat_template_only_assistant_turns_get_loss(tmp_path: Path) -> None:
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"},
            {"role": "assistant", "content": "A2"}]
    template = tool.load_chat_template(None, str(tmp_path / "tok" / "tokenizer.json"))
    ids, labels = tool.encode_messages(CharLevelTokenizer(), template, chat, append_eod=False)
    rendered = "<system>S</s><user>U1</s><assistant>A1</s><user>U2</s><assistant>A2</s>"
    assert bytes(ids).decode() == rendered
    trained = "".join(chr(i) if lab != -100 else "_" for i, lab in zip(ids, labels))
    assert trained.replace("_", " ").split() == ["A1</s>", "A2</s>"]
    # The same through the CLI with --chat-template.
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    prefix = _run(tmp_path, [{"messages": chat}], extra=["--chat-template", str(tmp_path / "t.jinja")])
    assert list(MMapIndexedDataset(prefix + "_label_document")[0]) == labels
    with pytest.raises(DataError, match="chat template"):
        _run(tmp_path, [{"messages": chat}])  # CharLevelTokenizer has no template of its own


def test_bad_records_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"sft.jsonl:2: missing key 'completion'"):
        _run(tmp_path, [{"prompt": "a", "completion": "b"}, {"prompt": "x"}])
    with pytest.raises(DataError, match="reward"):
        _run(tmp_path, [{"completion": "b", "reward": "good"}], mode="reward")
    assert not list((tmp_path / "out").glob("*.idx"))


def _sft_corpus(tmp_path: Path, n: int = 40) -> str:
    rng = np.random.default_rng(0)
    records = [{"prompt": "p" * int(rng.integers(1, 9)), "completion": "c" * int(rng.integers(1, 9))}
               for _ in range(n)]
    return _run(tmp_path, records, extra=["--append-eod"])


@pytest.mark.parametrize("pack_impl", ["packed", "pack_until_overflow", "unpacked"])
def test_sft_labels_stay_aligned_when_packed(tmp_path: Path, pack_impl: str) -> None:
    prefix = _sft_corpus(tmp_path)
    text = MMapIndexedDataset(prefix + "_text_document")
    label = MMapIndexedDataset(prefix + "_label_document")
    ds = SFTDataset("train", text, label, (0, len(text)), 30, 12, seed=3, pack_impl=pack_impl)
    trained = 0
    for i in range(len(ds.shuffle_idx)):
        s = ds[i]
        assert s["text"].shape == s["label"].shape == (13,)
        keep = s["label"] != -100
        assert np.array_equal(s["label"][keep], s["text"][keep])
        # prompt bytes ('p') never get loss; completion bytes ('c') always do
        assert not np.any(s["text"][keep] == ord("p"))
        real = s["text"] != 0 if pack_impl != "packed" else np.ones(13, bool)
        assert np.all(keep[(s["text"] == ord("c")) & real])
        trained += int(np.sum(s["text"][:-1][keep[:-1]] == ord("c")))
    if pack_impl == "packed":
        total_c = int(sum(np.sum(text[j] == ord("c")) for j in range(len(text))))
        spe = packed_samples_per_epoch(int(text.sizes.sum()), 12)
        assert len(ds.shuffle_idx) % spe == 0
        epochs = len(ds.shuffle_idx) // spe
        assert total_c * epochs - trained <= 12 * epochs  # at most each epoch's tail is unseen


def test_pairwise_shapes_and_padding(tmp_path: Path) -> None:
    records = [{"prompt": "Q" * (i % 5 + 1), "chosen": "good" * (i % 3 + 1), "rejected": "bad"} for i in range(12)]
    prefix = _run(tmp_path, records, mode="pairwise")
    files = {r: MMapIndexedDataset(f"{prefix}_{r}_document")
             for r in ("chosen", "rejected", "chosen_label", "rejected_label")}
    ds = PairwiseDataset("train", files["chosen"], files["rejected"], (0, 12), 12, 10, seed=1,
                         chosen_label=files["chosen_label"], rejected_label=files["rejected_label"], pad_id=0)
    seen = set()
    for i in range(12):
        s = ds[i]
        assert set(s) == {"chosen", "rejected", "chosen_label", "rejected_label"}
        assert all(v.shape == (11,) and v.dtype == np.int64 for v in s.values())
        assert np.all(s["rejected_label"][s["rejected"] == 0] == -100)
        assert _decode(s["rejected"][s["rejected_label"] != -100]) == "bad"
        assert _decode(s["chosen"]).startswith("Q")
        seen.add(ds.pair_id(i))
    assert seen == set(range(12))  # one epoch = every pair once
    long = PairwiseDataset("t", files["chosen"], files["rejected"], (0, 12), 12, 6, seed=1, allow_chopped=False)
    assert all(max(files["chosen"].sizes[long.pair_id(i)], 3) <= 7 for i in range(12))


def test_kto_reward_dataset(tmp_path: Path) -> None:
    records = [{"prompt": f"q{i}:", "completion": "y" if i % 2 else "n", "reward": bool(i % 2)} for i in range(10)]
    records[3]["reward"] = 0.25
    prefix = _run(tmp_path, records, mode="reward")
    reward = MMapIndexedDataset(prefix + "_reward_document")
    assert reward.dtype == np.float32 and list(reward.sizes) == [1] * 10
    ds = RewardDataset("train", MMapIndexedDataset(prefix + "_text_document"),
                       MMapIndexedDataset(prefix + "_label_document"), reward, (0, 10), 10, 8, seed=0)
    for i in range(10):
        s = ds[i]
        assert s["text"].shape == s["label"].shape == (9,) and s["reward"].dtype == np.float32
        doc = int(_decode(s["text"]).split(":")[0][1:])
        expected = 0.25 if doc == 3 else (1.0 if doc % 2 else -1.0)
        assert float(s["reward"]) == expected


def build(padded_vocab_size: int = 512, **kw: object) -> DataSplits:  # CharLevelTokenizer: 512 ids
    base: dict[str, object] = dict(seq_length=8, seed=1, train_batch_size=2, train_iters=4, eval_iters=1,
                                   eval_interval=2)
    base.update(kw)
    return build_datasets(data_run(NeoXArgs(**base)), None, padded_vocab_size)


def test_build_datasets_for_each_train_impl(tmp_path: Path) -> None:
    sft = _sft_corpus(tmp_path)
    splits = build(data_path=sft + "_text_document", split="8,1,1")
    assert len(splits.train) == 8 and len(splits.valid) == 6 and len(splits.test) == 2
    assert splits.valid.lo == 32 and splits.test.lo == 36  # split over documents
    splits = build(train_data_paths=[sft + "_text_document"], train_label_data_paths=[sft + "_label_document"],
                   eval_iters=0)
    assert set(splits.train[0]) == {"text", "label"}

    pw = _run(tmp_path, [{"prompt": "q", "chosen": "yes", "rejected": "no"}] * 4, mode="pairwise")
    splits = build(train_impl="dpo", dataset_impl="pairwise", eval_iters=0,
                                  pos_train_data_paths=[pw + "_chosen_document"],
                                  neg_train_data_paths=[pw + "_rejected_document"],
                                  pos_train_label_data_paths=[pw + "_chosen_label_document"],
                                  neg_train_label_data_paths=[pw + "_rejected_label_document"])
    assert set(splits.train[5]) == {"chosen", "rejected", "chosen_label", "rejected_label"}
    assert splits.valid is None and splits.test is None

    rw = _run(tmp_path, [{"completion": "abc", "reward": True}] * 3, mode="reward")
    splits = build(train_impl="kto", eval_iters=0, train_data_paths=[rw + "_text_document"],
                                  train_label_data_paths=[rw + "_label_document"],
                                  train_reward_data_paths=[rw + "_reward_document"])
    assert float(splits.train[0]["reward"]) == 1.0

    with pytest.raises(DataError, match="prepare_data.py"):
        build(train_data_paths=[str(tmp_path / "nope_text_document")])


def test_data_must_match_train_impl(tmp_path: Path) -> None:
    from megatron.errors import ConfigError

    sft = _sft_corpus(tmp_path)
    with pytest.raises(ConfigError, match="pos_train_data_paths"):
        build(train_impl="dpo", eval_iters=0, train_data_paths=[sft + "_text_document"])
    with pytest.raises(ConfigError, match="train_reward_data_paths"):
        build(train_impl="kto", eval_iters=0, train_data_paths=[sft + "_text_document"])
    # Dummy data carries the keys of each objective.
    for impl, keys in (("normal", {"text"}), ("dpo", {"chosen", "rejected", "chosen_label", "rejected_label"}),
                       ("kto", {"text", "label", "reward"})):
        ds = build(train_impl=impl, use_dummy_dataset=True, padded_vocab_size=32).train
        assert set(ds[3]) == keys and ds[3][sorted(keys)[0]].shape == (9,)
