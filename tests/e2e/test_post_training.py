"""Post-training end to end through ``deepy.py``: SFT, DPO, KTO and reward models on CPU ranks.

The tests build their own data with ``tools/datasets/preprocess_data_with_mask.py`` and the byte-level
``CharLevelTokenizer``. The preference rule: a prompt ``q<letters>:`` is answered by letters from
``a``-``m`` (chosen / desirable) or from ``n``-``z`` (rejected / undesirable); held-out pairs are new
random ones. Each objective gets one learning run on one rank and short runs on other layouts that
must reproduce its per-step losses (fp32, 1e-5): the learning runs use a constant learning rate, so
the first steps of a 20-step run and of a 6-step run are the same steps.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ports import free_port  # noqa: E402  (tests/ports.py: a port range per xdist worker)

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

LEARN_STEPS = 20
SHORT_STEPS = 6
TOL = 1e-5

BASE: dict[str, Any] = {
    "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "max_position_embeddings": 32,
    "norm": "layernorm", "pos_emb": "rotary", "tokenizer_type": "CharLevelTokenizer",
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1.0e-8}},
    "lr_decay_style": "constant", "warmup": 0.0, "weight_decay": 0.0, "gradient_clipping": 1.0,
    "hidden_dropout": 0.0, "attention_dropout": 0.0, "precision": "fp32", "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4, "log_interval": 1, "seed": 1234, "num_workers": 0, "steps_per_print": 1000,
    "eval_iters": 0,
}
TP2 = {"num_gpus": 2, "model_parallel_size": 2}
PP2 = {"num_gpus": 2, "pipe_parallel_size": 2}
DP2_ZERO1 = {"num_gpus": 2, "zero_optimization": {"stage": 1}}
TEMPLATE = ("{% for m in messages %}{{ m.role[0] }}:{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


def _tool():  # noqa: ANN202
    path = REPO / "tools" / "datasets" / "preprocess_data_with_mask.py"
    spec = importlib.util.spec_from_file_location("preprocess_data_with_mask", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data_with_mask"] = module
    spec.loader.exec_module(module)
    return module


def _letters(rng: random.Random, alphabet: str, lo: int, hi: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _write(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Preference pairs, KTO rows and SFT chats (two SFT copies differing only in masked tokens)."""
    tool, root = _tool(), tmp_path_factory.mktemp("data")
    good, bad = "abcdefghijklm", "nopqrstuvwxyz"
    out: dict[str, Any] = {"root": root}
    for split, n, seed in (("train", 256, 0), ("valid", 40, 1)):
        rng = random.Random(seed)
        pairs = [{"prompt": f"q{_letters(rng, 'abcdefghijklmnopqrstuvwxyz', 2, 4)}:",
                  "chosen": _letters(rng, good, 3, 6), "rejected": _letters(rng, bad, 3, 6)} for _ in range(n)]
        common = ["--tokenizer-type", "CharLevelTokenizer", "--append-eod"]
        src = _write(root / f"pairs_{split}.jsonl", pairs)
        tool.main(["--input", src, "--output-prefix", str(root / f"pairs_{split}"), "--mode", "pairwise", *common])
        kto = [{"prompt": p["prompt"], "completion": p[side], "reward": side == "chosen"}
               for p in pairs for side in ("chosen", "rejected")]
        rng.shuffle(kto)
        src = _write(root / f"kto_{split}.jsonl", kto)
        tool.main(["--input", src, "--output-prefix", str(root / f"kto_{split}"), "--mode", "reward", *common])
    (root / "chat.jinja").write_text(TEMPLATE)
    rng = random.Random(2)
    chats = [[{"role": "user", "content": _letters(rng, "abcdefghijklmnopqrstuvwxyz", 2, 6)},
              {"role": "assistant", "content": _letters(rng, "abcdefgh", 1, 8)},
              {"role": "user", "content": _letters(rng, "xyz", 3, 3)}] for _ in range(128)]
    for name, suffix in (("sft_a", None), ("sft_b", "QQQ")):  # b: the trailing (masked) user turn changed
        rows = [{"messages": [*c[:2], {"role": "user", "content": suffix or c[2]["content"]}]} for c in chats]
        src = _write(root / f"{name}.jsonl", rows)
        tool.main(["--input", src, "--output-prefix", str(root / name), "--mode", "sft",
                   "--tokenizer-type", "CharLevelTokenizer", "--chat-template", str(root / "chat.jinja")])
    return out


def pairwise_paths(root: Path, prefix: str = "pairs", valid: bool = True) -> dict[str, Any]:
    splits = ("train", "valid") if valid else ("train",)
    keys: dict[str, Any] = {"dataset_impl": "pairwise", "pack_impl": "unpacked"}
    for split in splits:
        base = root / f"{prefix}_{split}"
        keys |= {f"pos_{split}_data_paths": [f"{base}_chosen_document"],
                 f"neg_{split}_data_paths": [f"{base}_rejected_document"],
                 f"pos_{split}_label_data_paths": [f"{base}_chosen_label_document"],
                 f"neg_{split}_label_data_paths": [f"{base}_rejected_label_document"]}
    return keys


def kto_paths(root: Path, valid: bool = True) -> dict[str, Any]:
    keys: dict[str, Any] = {"pack_impl": "unpacked"}
    for split in ("train", "valid") if valid else ("train",):
        base = root / f"kto_{split}"
        keys |= {f"{split}_data_paths": [f"{base}_text_document"],
                 f"{split}_label_data_paths": [f"{base}_label_document"],
                 f"{split}_reward_data_paths": [f"{base}_reward_document"]}
    return keys


def run(tmp: Path, name: str, config: dict[str, Any]) -> list[dict[str, Any]]:
    """``deepy.py train.py <config>``; returns the metrics rows."""
    work = tmp / name
    work.mkdir(parents=True, exist_ok=True)
    full = {**BASE, "num_gpus": 1, **config, "log_dir": str(work / "logs"), "master_port": free_port()}
    (work / "config.json").write_text(json.dumps(full))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "deepy.py", "train.py", str(work / "config.json")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"{name} failed with exit code {proc.returncode}:\n{(proc.stdout + proc.stderr)[-5000:]}")
    return [json.loads(line) for line in (work / "logs" / "metrics.jsonl").read_text().splitlines()]


def series(rows: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {r["iteration"]: r[key] for r in rows if key in r and key.startswith("train/")}


def last(rows: list[dict[str, Any]], key: str) -> float:
    return [r[key] for r in rows if key in r][-1]


def assert_same_steps(name: str, got: dict[int, float], want: dict[int, float], tol: float = TOL) -> None:
    assert got, f"{name}: no steps logged"
    bad = [(s, v, want.get(s)) for s, v in sorted(got.items()) if s not in want or abs(v - want[s]) > tol * max(1.0, abs(want[s]))]
    assert not bad, f"{name}: (step, got, single-rank) differ beyond {tol}: {bad}"


# ---------------------------------------------------------------- SFT
SFT = {"eod_mask_loss": True, "z_loss": 1e-3, "pack_impl": "unpacked", "train_iters": SHORT_STEPS}


def _sft(root: Path, name: str) -> dict[str, Any]:
    return {**SFT, "train_data_paths": [str(root / f"{name}_text_document")],
            "train_label_data_paths": [str(root / f"{name}_label_document")]}


@pytest.fixture(scope="module")
def sft_single(data: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("sft")
    rows = run(tmp, "single", {**_sft(data["root"], "sft_a"), "train_micro_batch_size_per_gpu": 4,
                                "save": str(tmp / "ckpt"), "checkpoint_factor": SHORT_STEPS})
    return {"rows": rows, "ckpt": tmp / "ckpt"}


def test_sft_ignores_masked_tokens_and_normalises_over_the_global_batch(
        data: dict[str, Any], sft_single: dict[str, Any], tmp_path: Path) -> None:
    """Masked tokens changed (data b) on another layout and micro-batch size: the same losses.

    The micro-batches hold different numbers of counted tokens, so a mean of micro-batch means would
    differ between micro-batch 4 (single) and 2 (here); the global token mean does not.
    """
    want = series(sft_single["rows"], "train/lm_loss")
    assert len(want) == SHORT_STEPS and want[SHORT_STEPS] < want[1]
    assert last(sft_single["rows"], "train/z_loss") > 0
    rows = run(tmp_path, "dp2_zero1_masked_changed", {**_sft(data["root"], "sft_b"), **DP2_ZERO1,
                                                       "train_micro_batch_size_per_gpu": 2})
    assert_same_steps("sft dp2 zero1 (masked tokens changed)", series(rows, "train/lm_loss"), want)
    assert_same_steps("sft z_loss", series(rows, "train/z_loss"), series(sft_single["rows"], "train/z_loss"))


# ---------------------------------------------------------------- DPO
def _dpo(root: Path, **extra: Any) -> dict[str, Any]:
    return {"train_impl": "dpo", "dpo_beta": 0.1, **pairwise_paths(root, valid=False), "train_iters": SHORT_STEPS,
            **extra}


# held-out pairs every 3 steps (all 40 of them each time), so a 6-step run on another layout evaluates
# the same batches at steps 3 and 6
DPO_EVAL = {"eval_interval": 3, "eval_iters": 5}


@pytest.fixture(scope="module")
def dpo_single(data: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """40 steps on one rank from the seeded initialisation (the reference), evaluating held-out pairs."""
    tmp = tmp_path_factory.mktemp("dpo")
    config = {**_dpo(data["root"]), **pairwise_paths(data["root"]), **DPO_EVAL, "train_iters": LEARN_STEPS,
              "save": str(tmp / "ckpt"),
              "extra_save_iters": [3], "checkpoint_factor": LEARN_STEPS}
    return {"rows": run(tmp, "single", config), "ckpt": tmp / "ckpt", "tmp": tmp}


def test_dpo_learns_the_preference(dpo_single: dict[str, Any]) -> None:
    rows = dpo_single["rows"]
    losses = series(rows, "train/lm_loss")
    assert losses[1] == pytest.approx(np.log(2), abs=1e-6)  # policy == reference at the first step
    assert series(rows, "train/rewards/margin")[LEARN_STEPS] > 0
    evals = [r for r in rows if "eval/rewards/accuracy" in r]
    assert [r["iteration"] for r in evals] == [*range(3, LEARN_STEPS, 3), LEARN_STEPS]
    assert evals[-1]["eval/rewards/accuracy"] > 0.9, evals  # held-out pairs
    assert evals[-1]["eval/rewards/margin"] > evals[0]["eval/rewards/margin"] > 0
    assert evals[-1]["eval/rewards/chosen"] > evals[-1]["eval/rewards/rejected"]


def test_dpo_pp2_with_a_frozen_reference_pipeline(data: dict[str, Any], dpo_single: dict[str, Any], tmp_path: Path) -> None:
    rows = run(tmp_path, "pp2", {**_dpo(data["root"]), **pairwise_paths(data["root"]), **DPO_EVAL, **PP2})
    for key in ("train/lm_loss", "train/rewards/accuracy", "train/rewards/chosen"):
        assert_same_steps(f"dpo pp2 {key}", series(rows, key), series(dpo_single["rows"], key))
    for key in ("eval/lm_loss", "eval/rewards/accuracy", "eval/rewards/margin"):  # evaluation through the pipeline
        got = {r["iteration"]: r[key] for r in rows if key in r}
        assert sorted(got) == [3, 6], got
        assert_same_steps(f"dpo pp2 {key}", got, {r["iteration"]: r[key] for r in dpo_single["rows"] if key in r})


def test_dpo_dp2_zero1(data: dict[str, Any], dpo_single: dict[str, Any], tmp_path: Path) -> None:
    rows = run(tmp_path, "dp2_zero1", {**_dpo(data["root"]), **DP2_ZERO1, "train_micro_batch_size_per_gpu": 2})
    assert_same_steps("dpo dp2 zero1", series(rows, "train/lm_loss"), series(dpo_single["rows"], "train/lm_loss"))


def test_precompute_then_train_dpo_with_reference_logps(data: dict[str, Any], dpo_single: dict[str, Any],
                                                        tmp_path: Path) -> None:
    """The documented two commands: ``generate.py text_gen_type=precompute precompute_model_name=ref``
    from a checkpoint, then DPO with ``reference_logps: ref`` fine-tuning from that checkpoint. Its
    steps equal those of the frozen-copy run from the same checkpoint (whose reference is those
    weights), and the first step's loss is log 2 (policy == reference)."""
    start = {**_dpo(data["root"]), "load": str(dpo_single["ckpt"]), "iteration": 3, "finetune": True,
             "train_iters": 2}
    work = tmp_path / "precompute"
    work.mkdir()
    full = {**BASE, "num_gpus": 1, **start, "log_dir": str(work / "logs"), "master_port": free_port()}
    (work / "config.json").write_text(json.dumps(full))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "deepy.py", "generate.py", str(work / "config.json"),
                           "text_gen_type=precompute", "precompute_model_name=ref"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    precomputed = series(run(tmp_path, "precomputed", {**start, "reference_logps": "ref"}), "train/lm_loss")
    frozen = series(run(tmp_path, "frozen", start), "train/lm_loss")
    assert precomputed[1] == pytest.approx(np.log(2), abs=1e-5)
    assert_same_steps("dpo with precomputed reference", precomputed, frozen)


def test_dpo_resume_mid_run_continues_the_curve(data: dict[str, Any], dpo_single: dict[str, Any], tmp_path: Path) -> None:
    """Resume from the learning run's step-3 checkpoint: the reference (the starting weights, not the
    resumed policy) comes back, and steps 4-6 are the uninterrupted ones."""
    # the checkpoint's schedule (train_iters LEARN_STEPS), stopped after step 6 by exit_interval
    rows = run(tmp_path, "resumed", {**_dpo(data["root"]), "load": str(dpo_single["ckpt"]), "iteration": 3,
                                     "train_iters": LEARN_STEPS, "exit_interval": 6})
    got = series(rows, "train/lm_loss")
    assert sorted(got) == [4, 5, 6]
    assert_same_steps("dpo resumed at 3", got, series(dpo_single["rows"], "train/lm_loss"))


def test_dpo_reference_is_the_initialize_from_checkpoint(data: dict[str, Any], sft_single: dict[str, Any],
                                                         tmp_path: Path) -> None:
    """Starting from the SFT checkpoint, policy and reference agree at step 1: loss log 2, rewards 0."""
    rows = run(tmp_path, "from_sft", {**_dpo(data["root"]), "train_iters": 2,
                                      "initialize_from": str(sft_single["ckpt"])})
    assert series(rows, "train/lm_loss")[1] == pytest.approx(np.log(2), abs=1e-6)
    assert series(rows, "train/rewards/chosen")[1] == pytest.approx(0.0, abs=1e-6)
    assert series(rows, "train/lm_loss")[2] != pytest.approx(np.log(2), abs=1e-6)  # and it trains


# ---------------------------------------------------------------- reward model
@pytest.fixture(scope="module")
def rm_single(data: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("rm")
    config = {"train_impl": "rm", **pairwise_paths(data["root"]), "train_iters": LEARN_STEPS,
              "eval_interval": LEARN_STEPS, "eval_iters": 5, "save": str(tmp / "ckpt"), "checkpoint_factor": LEARN_STEPS}
    return {"rows": run(tmp, "single", config), "ckpt": tmp / "ckpt"}


def test_reward_model_learns_and_keeps_its_head(rm_single: dict[str, Any]) -> None:
    rows = rm_single["rows"]
    assert last(rows, "eval/rm/accuracy") > 0.9, [r for r in rows if "eval/rm/accuracy" in r]
    assert last(rows, "eval/rm/margin") > 0
    from megatron.checkpointing.neox import NeoxNames, canonical_rank_weights

    ckpt = rm_single["ckpt"] / f"global_step{LEARN_STEPS}"
    names = NeoxNames.from_stored(json.loads((ckpt / "deepy_meta.json").read_text())["args"])
    # GPT-NeoX's layout (sequential.<L+4>.value_head.weight), read back under the model's own names
    states = canonical_rank_weights(ckpt, names, tp=1, tp_rank=0, pipeline=False)
    assert states["value_head.weight"].shape == (1, 64) and not any(k.startswith("output_layer") for k in states)


@pytest.mark.parametrize("pipe", [0, 1])
def test_reward_model_starts_from_a_language_model_checkpoint(data: dict[str, Any], sft_single: dict[str, Any],
                                                              tmp_path: Path, pipe: int) -> None:
    """SFT -> RM: ``initialize_from`` an LM checkpoint (plain and PipelineModule engines). With a zero
    learning rate the saved RM holds the LM's weights exactly (its LM head dropped) and a value head
    equal to the seeded initialisation of a fresh model of the same config."""
    from megatron.interop.deepy_checkpoint import read_full_checkpoint
    from megatron.model import GPTModel
    from megatron.neox_arguments import NeoXArgs

    lm_ckpt = sft_single["ckpt"]  # saved at pipe_parallel_size 0
    if pipe:  # a language model saved by a PipelineModule run (a layout change would go through universal)
        lm_ckpt = tmp_path / "lm_ckpt"
        run(tmp_path, "lm_pp1", {**_sft(data["root"], "sft_a"), "train_iters": 1, "pipe_parallel_size": 1,
                                 "save": str(lm_ckpt), "checkpoint_factor": 1})
    config = {"train_impl": "rm", **pairwise_paths(data["root"], valid=False), "train_iters": 1,
              "pipe_parallel_size": pipe, "initialize_from": str(lm_ckpt),
              "optimizer": {"type": "Adam", "params": {"lr": 0.0}},
              "save": str(tmp_path / "ckpt"), "checkpoint_factor": 1}
    run(tmp_path, f"rm_from_lm_pp{pipe}", config)
    lm = read_full_checkpoint(lm_ckpt).weights
    rm = read_full_checkpoint(tmp_path / "ckpt").weights
    body = sorted(k for k in rm if not k.startswith("value_head."))
    assert body and body == sorted(k for k in lm if not k.startswith("output_layer."))
    assert all(torch.equal(rm[k], lm[k]) for k in body)
    args = NeoXArgs(**{k: v for k, v in {**BASE, **config}.items() if k != "num_gpus"}, padded_vocab_size=512)
    fresh = GPTModel(args.with_vocab(512).replace(value_head=True)).state_dict()  # train_impl rm: a value head
    assert torch.equal(rm["value_head.weight"], fresh["value_head.weight"])


def test_reward_model_pp2(data: dict[str, Any], rm_single: dict[str, Any], tmp_path: Path) -> None:
    rows = run(tmp_path, "pp2", {"train_impl": "rm", **pairwise_paths(data["root"], valid=False),
                                 "train_iters": SHORT_STEPS, **PP2})
    for key in ("train/lm_loss", "train/rm/accuracy"):
        assert_same_steps(f"rm pp2 {key}", series(rows, key), series(rm_single["rows"], key))


# ---------------------------------------------------------------- KTO
@pytest.fixture(scope="module")
def kto_single(data: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("kto")
    config = {"train_impl": "kto", **kto_paths(data["root"]), "train_iters": LEARN_STEPS,
              "eval_interval": LEARN_STEPS, "eval_iters": 5}
    return run(tmp, "single", config)


def test_kto_separates_desirable_from_undesirable(kto_single: list[dict[str, Any]]) -> None:
    desirable, undesirable = last(kto_single, "eval/rewards/desirable"), last(kto_single, "eval/rewards/undesirable")
    assert desirable > 0 > undesirable, (desirable, undesirable)
    assert last(kto_single, "eval/rewards/margin") > 0.5
    assert series(kto_single, "train/kl")[1] == pytest.approx(0.0, abs=1e-6)  # policy == reference at first


def test_kto_pp2(data: dict[str, Any], kto_single: list[dict[str, Any]], tmp_path: Path) -> None:
    rows = run(tmp_path, "pp2", {"train_impl": "kto", **kto_paths(data["root"], valid=False),
                                 "train_iters": SHORT_STEPS, **PP2})
    for key in ("train/lm_loss", "train/kl", "train/rewards/desirable"):
        assert_same_steps(f"kto pp2 {key}", series(rows, key), series(kto_single, key))


# ---------------------------------------------------------------- the remaining objective x layout pairs
# (above: SFT dp2·ZeRO-1, DPO tp2/pp2/dp2·ZeRO-1, RM pp2, KTO pp2)
LAYOUTS = {"tp2": TP2, "pp2": PP2, "dp2_zero1": DP2_ZERO1}


@pytest.mark.parametrize(("objective", "layout"), [("sft", "tp2"), ("sft", "pp2"), ("rm", "tp2"),
                                                   ("rm", "dp2_zero1"), ("kto", "tp2"), ("kto", "dp2_zero1")])
def test_objective_on_layout_equals_single_rank(objective: str, layout: str, data: dict[str, Any],
                                                request: pytest.FixtureRequest, tmp_path: Path) -> None:
    root = data["root"]
    if objective == "sft":
        single = request.getfixturevalue("sft_single")["rows"]
        config: dict[str, Any] = {**_sft(root, "sft_a"), "train_micro_batch_size_per_gpu": 4}
        keys = ("train/lm_loss", "train/z_loss")
    elif objective == "rm":
        single = request.getfixturevalue("rm_single")["rows"]
        config = {"train_impl": "rm", **pairwise_paths(root, valid=False), "train_iters": SHORT_STEPS}
        keys = ("train/lm_loss", "train/rm/accuracy", "train/rm/margin")
    else:
        single = request.getfixturevalue("kto_single")
        config = {"train_impl": "kto", **kto_paths(root, valid=False), "train_iters": SHORT_STEPS}
        keys = ("train/lm_loss", "train/kl", "train/rewards/desirable")
    rows = run(tmp_path, layout, {**config, **LAYOUTS[layout]})
    for key in keys:
        got = series(rows, key)
        assert sorted(got) == list(range(1, SHORT_STEPS + 1)), (key, sorted(got))
        assert_same_steps(f"{objective} {layout} {key}", got, series(single, key))
