"""LoRA adapters end to end through ``deepy.py``: every layout takes the single-rank LoRA steps, the base
stays bit-identical, the optimizer holds state for the adapters only, and DPO with adapters learns
against the frozen base as its reference.

The parity runs reuse the parity suite's tiny model and layouts (``test_parity.py``) with adapters on
all four projections; the DPO runs reuse the post-training suite's preference data
(``test_post_training.py``).
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from test_parity import BASE_CONFIG, LAYOUTS, assert_close, deepy, free_port, load_golden
from test_post_training import DPO_EVAL, PP2, _dpo, data, kto_paths, pairwise_paths, series  # noqa: F401
from test_post_training import assert_same_steps
from test_post_training import run as run_post

pytestmark = pytest.mark.slow

TARGETS = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
LORA: dict[str, Any] = {"lora_r": 4, "lora_alpha": 8.0, "lora_target_modules": TARGETS}
STEPS = BASE_CONFIG["train_iters"]
# r * (in + out) per adapted projection of the tiny model (hidden 64, MLP 256, fused QKV 192), per block
ADAPTER_PARAMS = BASE_CONFIG["num_layers"] * 4 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64))
ADAM_STATES = 2  # exp_avg and exp_avg_sq per trained element


def train(layout: str, tmp: Path, **extra: Any) -> dict[str, Any]:
    config = {**BASE_CONFIG, **LAYOUTS[layout], **LORA, "log_dir": str(tmp / "logs"), "save": str(tmp / "ckpt"),
              "checkpoint_factor": STEPS, "master_port": free_port(), **extra}
    tmp.mkdir(parents=True, exist_ok=True)
    proc = deepy(config, tmp)
    if proc.returncode != 0:
        pytest.fail(f"LoRA {layout} failed with exit code {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    rows = [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "ckpt": tmp / "ckpt" / f"global_step{STEPS}", "config": config,
            "console": proc.stdout + proc.stderr}


def column(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return train("single", tmp_path_factory.mktemp("lora_single"), extra_save_iters=[5])


def initial_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The seeded initial model of ``config`` without adapters, built in this process."""
    from megatron.model import GPTModel
    from megatron.neox_arguments.run_config import RunConfig
    from megatron.tokenizer import build_tokenizer

    run = RunConfig.from_mapping({k: v for k, v in config.items() if k != "num_gpus"})
    vocab = run.tokenizer.padded(build_tokenizer(run.tokenizer).vocab_size, run.parallel.model_parallel_size)
    return GPTModel(run.model.with_vocab(vocab)).state_dict()


def saved_module(ckpt: Path) -> dict[str, torch.Tensor]:
    """The whole model of a checkpoint without tensor parallelism under ``GPTModel`` names: one file, or
    the pipeline's layer files, both in GPT-NeoX's layout (read back by the reader
    ``tests/unit/test_neox_layout.py`` checks against GPT-NeoX's published rules)."""
    from megatron.checkpointing.neox import NeoxNames, canonical_rank_weights

    names = NeoxNames.from_stored(json.loads((ckpt / "deepy_meta.json").read_text())["args"])
    pipeline = any(ckpt.glob("layer_*-model_00-model_states.pt"))
    return canonical_rank_weights(ckpt, names, tp=1, tp_rank=0, pipeline=pipeline)


def optimizer_state_elements(ckpt: Path) -> int:
    """Elements of every optimizer state tensor in a checkpoint (all data-parallel partitions)."""
    total = 0
    zero_files = sorted(glob.glob(str(ckpt / "*zero_pp_rank_*optim_states.pt")))
    states: list[dict[Any, Any]] = []
    if zero_files:
        for path in zero_files:
            saved = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
            inner = saved.get("base_optimizer_state") or saved["optimizer_state_dict"]  # ZeRO-1/2 or ZeRO-3
            states.append(inner["state"])
    else:
        states.append(torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu",
                                 weights_only=False)["optimizer"]["state"])
    for state in states:
        for per_param in state.values():
            total += sum(v.numel() for k, v in per_param.items() if k != "step")
    return total


def test_single_rank_lora_trains_only_the_adapters(single: dict[str, Any]) -> None:
    rows = single["rows"]
    losses = column(rows, "train/lm_loss")
    golden = load_golden()["train/lm_loss"]  # the same model trained in full (test_parity.py)
    # B starts at zero: step 1 sees exactly the base model; afterwards only the adapters move it
    assert losses[0] == pytest.approx(golden[0], rel=1e-6)
    assert max(abs(a - b) for a, b in zip(losses[1:], golden[1:])) > 1e-4
    assert max(losses) - min(losses) > 1e-3
    saved = saved_module(single["ckpt"])
    adapters = {k: v for k, v in saved.items() if ".adapter.lora_" in k}
    assert sum(v.numel() for v in adapters.values()) == ADAPTER_PARAMS
    assert all(v.abs().max() > 0 for k, v in adapters.items() if k.endswith("lora_B")), "an adapter never trained"


@pytest.mark.parametrize("layout", ["single", "pp2", "dp2_zero1"])
def test_base_weights_are_bit_identical_after_training(layout: str, single: dict[str, Any], tmp_path: Path,
                                                       request: pytest.FixtureRequest) -> None:
    run = single if layout == "single" else request.getfixturevalue("layout_runs")[layout]
    initial = initial_weights(single["config"])  # the seeded initialisation does not depend on the layout
    saved = saved_module(run["ckpt"])
    base = {k: v for k, v in saved.items() if ".adapter." not in k}
    assert sorted(base) == sorted(initial)
    changed = [k for k in initial if not torch.equal(initial[k], base[k])]
    assert not changed, f"{layout}: frozen base weights changed: {changed}"


PARITY_LAYOUTS = ["tp2", "pp2", "dp2_zero1", "dp2_zero3"]
RECOMPUTED = {"pp2": {"checkpoint_activations": True}, "dp2_zero1": {"selective_checkpointing": 1}}
"""Two layouts also recompute every block in the backward (DeepSpeed's reentrant checkpoint): with the frozen
embedding in front, the first recomputed block once passed no gradient to its adapters (selective recomputation
left the single-rank curve by 6e-3) and, every block recomputed, the loss had none (DeepSpeed's "loss must be a
scalar tensor"). Recomputation changes no number, so these runs still equal the single rank's."""


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One LoRA run per layout, shared by the parity, base and optimizer-state tests."""
    runs = {}
    for name in PARITY_LAYOUTS:
        tmp = tmp_path_factory.mktemp(f"lora_{name}")
        extra = dict(RECOMPUTED.get(name, {}))
        if name in PEFT_LAYOUTS:  # the PEFT saves ride along: they change no number
            extra.update(lora_peft_save_path=str(tmp / "peft"), lora_peft_save_interval=4)
        if name == HF_SAVE_LAYOUT:  # the merged HF saves too (every rank gathers, rank 0 writes)
            extra.update(hf_save_path=str(tmp / "hf"), hf_save_interval=HF_SAVE_INTERVAL)
        runs[name] = train(name, tmp, **extra)
    return runs


PEFT_LAYOUTS = ("dp2_zero1", "dp2_zero3")
"""The layout runs that also save their adapters in PEFT's format while training (rank 0 of two writes; under
ZeRO-3 both ranks gather the adapters first)."""
HF_SAVE_LAYOUT = "dp2_zero3"
"""The layout run that also writes its merged model while training (hf_save_path: ZeRO-3's partitions gathered)."""
HF_SAVE_INTERVAL = 3
"""The last 0-based step (9) is a multiple of it: the forced last save finds it written on every rank alike (issue
42: rank 1 gathered for it again while rank 0 went on to the final evaluation, and the run never ended)."""


@pytest.mark.parametrize("layout", PEFT_LAYOUTS)
def test_peft_saves_while_training_hold_the_trained_adapters(layout: str,
                                                             layout_runs: dict[str, dict[str, Any]]) -> None:
    """lora_peft_save_path: Levanter's directories (0-based steps 4 and 8 of 10 at interval 4, then the last, 9:
    lora.py:384-400, trainer.py:97-100,448-449 at 9263f81e), each PEFT's two files; the last holds the adapters of
    the step-10 checkpoint under the names and row order of the offline export (megatron/interop/lora_export.py)
    (under ZeRO-3 the checkpoint's adapters are its fp32 optimizer partitions, read by the converter's reader)."""
    from safetensors.torch import load_file

    from megatron.interop.deepy_checkpoint import read_full_checkpoint
    from megatron.interop.lora_export import peft_state_dict
    from megatron.neox_arguments.run_config import RunConfig

    run = layout_runs[layout]
    peft = Path(run["config"]["lora_peft_save_path"])
    assert sorted(p.name for p in peft.iterdir()) == ["step-4", "step-8", "step-9"]
    config = json.loads((peft / "step-9" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, TARGETS)
    model = RunConfig.from_mapping({k: v for k, v in run["config"].items() if k != "num_gpus"}).model
    want = peft_state_dict(model, read_full_checkpoint(run["ckpt"]).weights)
    last = load_file(str(peft / "step-9" / "adapter_model.safetensors"))
    assert sorted(last) == sorted(want) and all(torch.equal(last[k], want[k]) for k in want)
    earlier = load_file(str(peft / "step-4" / "adapter_model.safetensors"))
    assert any(not torch.equal(earlier[k], last[k]) for k in want)  # written as training went, not only at the end


@pytest.mark.parametrize("layout", PARITY_LAYOUTS)
def test_lora_layout_equals_single_rank(layout: str, single: dict[str, Any],
                                        layout_runs: dict[str, dict[str, Any]]) -> None:
    rows, want = layout_runs[layout]["rows"], single["rows"]
    assert_close(f"lora {layout}", "train/lm_loss", column(rows, "train/lm_loss"), column(want, "train/lm_loss"), 1e-5)
    assert_close(f"lora {layout}", "train/grad_norm", column(rows, "train/grad_norm"),
                 column(want, "train/grad_norm"), 1e-4)
    assert_close(f"lora {layout}", "eval/lm_loss", column(rows, "eval/lm_loss"), column(want, "eval/lm_loss"), 1e-5)


@pytest.mark.parametrize("layout", ["single", *PARITY_LAYOUTS])
def test_the_run_header_counts_the_adapters_of_the_whole_model(layout: str, single: dict[str, Any],
                                                               request: pytest.FixtureRequest) -> None:
    """Issue 32: LoRA runs did not say how many parameters train. Split over tp, pp and ZeRO-3 the header
    still counts the whole model's adapters once."""
    run = single if layout == "single" else request.getfixturevalue("layout_runs")[layout]
    assert f" {ADAPTER_PARAMS:,} trainable (LoRA adapters, " in run["console"], run["console"][-3000:]


@pytest.mark.parametrize("layout", ["single", "dp2_zero1", "dp2_zero3"])
def test_optimizer_state_is_adapters_times_state_count(layout: str, single: dict[str, Any],
                                                       request: pytest.FixtureRequest) -> None:
    run = single if layout == "single" else request.getfixturevalue("layout_runs")[layout]
    # the full model has ~0.1M parameters; its Adam state would be ~25x this
    assert optimizer_state_elements(run["ckpt"]) == ADAPTER_PARAMS * ADAM_STATES


# ---------------------------------------------------------------- checkpoints
def test_lora_resume_continues_the_curve_exactly(single: dict[str, Any], tmp_path: Path) -> None:
    """The step-5 checkpoint of the single-rank run (adapters, their optimizer state, the frozen base)
    resumes into steps 6-10 of the uninterrupted run."""
    config = {**BASE_CONFIG, **LAYOUTS["single"], **LORA, "log_dir": str(tmp_path / "logs"),
              "load": str(single["ckpt"].parent), "iteration": 5, "master_port": free_port()}
    proc = deepy(config, tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    got = {r["iteration"]: r["train/lm_loss"] for r in rows if "train/lm_loss" in r}
    want = {r["iteration"]: r["train/lm_loss"] for r in single["rows"] if "train/lm_loss" in r}
    assert sorted(got) == [6, 7, 8, 9, 10]
    assert all(got[i] == pytest.approx(want[i], rel=1e-6) for i in got), (got, want)


def files_under(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` (relative path -> size, modification time): what a run wrote there."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_adapters_start_from_a_checkpoint_without_them_and_keep_it_across_a_layout_change(tmp_path: Path) -> None:
    """A full-parameter checkpoint becomes the frozen base of an adapter run (initialize_from): it loads
    although it has no adapter entries (here at another layout), and the base stays bit-identical to it.
    Resumed at another layout (dp2 ZeRO-1 -> dp2 ZeRO-3, through a universal checkpoint), the adapter run
    keeps that trained base bit for bit (not the seeded initialisation the conversion used to leave it at)
    and takes the uninterrupted run's step; the conversion goes beside the new run's `save`, never into the
    source."""
    full = {**BASE_CONFIG, **LAYOUTS["single"], "train_iters": 2, "log_dir": str(tmp_path / "full" / "logs"),
            "save": str(tmp_path / "full" / "ckpt"), "checkpoint_factor": 2, "master_port": free_port()}
    (tmp_path / "full").mkdir()
    assert deepy(full, tmp_path / "full").returncode == 0
    base = saved_module(tmp_path / "full" / "ckpt" / "global_step2")
    assert base and not any(".adapter." in k for k in base)
    # at another layout than the base (dp2 ZeRO-1): the base comes through a universal checkpoint
    adapted = train("dp2_zero1", tmp_path / "lora", initialize_from=str(tmp_path / "full" / "ckpt"), train_iters=3,
                    checkpoint_factor=3, extra_save_iters=[2])
    saved = saved_module(adapted["ckpt"].parent / "global_step3")
    assert all(torch.equal(saved[k], base[k]) for k in base)
    assert {k for k in saved if k not in base} == {k for k in saved if ".adapter.lora_" in k} != set()
    # the checkpoint names its base
    meta = json.loads((adapted["ckpt"].parent / "global_step3" / "deepy_meta.json").read_text())
    assert meta["args"]["initialize_from"] == str(tmp_path / "full" / "ckpt") and meta["args"]["lora_r"] == 4

    from megatron.interop.deepy_checkpoint import read_full_checkpoint

    source = adapted["ckpt"].parent
    before = files_under(source)
    moved = train("dp2_zero3", tmp_path / "moved", initialize_from=str(tmp_path / "full" / "ckpt"), load=str(source),
                  iteration=2, train_iters=3, checkpoint_factor=3)
    assert files_under(source) == before  # nothing written into the checkpoint it resumed
    assert not any("_universal" in p.name for p in moved["ckpt"].parent.iterdir())  # dropped after its own save
    got, want = column(moved["rows"], "train/lm_loss"), column(adapted["rows"], "train/lm_loss")
    assert len(got) == 1 and abs(got[0] - want[2]) <= 1e-5, (got, want)
    weights = read_full_checkpoint(moved["ckpt"].parent / "global_step3").weights
    changed = [k for k in base if not torch.equal(weights[k], base[k])]
    assert not changed, f"frozen base weights changed across the layout change: {changed}"


# ---------------------------------------------------------------- export
def convert(ckpt: Path, out: Path, *extra: str) -> str:
    import subprocess
    import sys

    from test_parity import REPO

    proc = subprocess.run([sys.executable, str(REPO / "tools" / "ckpts" / "convert_neox_to_hf.py"), str(ckpt.parent),
                           str(out), *extra], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


@torch.no_grad()
def test_merged_and_peft_exports_reproduce_our_logits(single: dict[str, Any], layout_runs: dict[str, dict[str, Any]],
                                                      tmp_path: Path) -> None:
    """The merged model (from the single-rank checkpoint) read by transformers, and the base plus PEFT
    adapter (from the tp2 checkpoint) read by peft, give our adapted model's logits within 1e-4."""
    from megatron.interop.deepy_checkpoint import read_full_checkpoint
    from megatron.interop.hf_model import load_hf_model
    from megatron.interop.lora_export import adapted_model, load_peft_model, lora_config_of

    assert "verified" in convert(single["ckpt"], tmp_path / "merged")  # --adapters merge is the default
    out = convert(layout_runs["tp2"]["ckpt"], tmp_path / "peft", "--adapters", "peft")
    assert "logits(peft)" in out
    tokens = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(3))
    full = read_full_checkpoint(single["ckpt"])
    ours = adapted_model(full.config, lora_config_of(full.args), full.weights)(tokens)
    merged = load_hf_model(tmp_path / "merged", torch.float32)(input_ids=tokens).logits
    assert (merged - ours).abs().max() <= 1e-4
    peft = load_peft_model(tmp_path / "peft", tmp_path / "peft" / "lora_adapter")(input_ids=tokens).logits
    # the tp2 run took the single-rank steps (1e-5), so its adapters give the same function
    assert (peft - ours).abs().max() <= 1e-4
    base = load_hf_model(tmp_path / "peft", torch.float32)(input_ids=tokens).logits
    assert (base - ours).abs().max() > 1e-2  # the adapters matter: without them the logits differ
    config = json.loads((tmp_path / "peft" / "lora_adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, TARGETS)


@torch.no_grad()
def test_hf_saves_while_training_hold_the_merged_model(layout_runs: dict[str, dict[str, Any]]) -> None:
    """hf_save_path on a LoRA run under ZeRO-3 at dp2 (lora_lm.py's merged_hf_save_path, 163-168 at 9263f81e): 0-based
    steps 3, 6 and 9 of 10 at interval 3 (9, the last, once: the run ended within the launch's bound, 400 s); the
    last, read by transformers, gives our adapted model's logits at the run's step-10 checkpoint, and the console
    says which checkpoint each save holds."""
    from transformers import AutoModelForCausalLM

    from megatron.interop.deepy_checkpoint import read_full_checkpoint
    from megatron.interop.lora_export import adapted_model, lora_config_of

    run = layout_runs[HF_SAVE_LAYOUT]
    hf = Path(run["config"]["hf_save_path"])
    assert sorted(p.name for p in hf.iterdir()) == ["step-3", "step-6", "step-9"]
    assert run["console"].count(f"hf_save_path: wrote {hf / 'step-9'}, the model after 10 steps (Levanter's 0-based "
                                "step 9): the weights of Deepy's global_step10") == 1
    merged = AutoModelForCausalLM.from_pretrained(hf / "step-9", local_files_only=True, torch_dtype=torch.float32)
    full = read_full_checkpoint(run["ckpt"])
    tokens = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(3))
    ours = adapted_model(full.config, lora_config_of(full.args), full.weights)(tokens)
    assert (merged.eval()(input_ids=tokens).logits - ours).abs().max() <= 1e-4


# ---------------------------------------------------------------- DPO with adapters
DPO_LORA = {"lora_r": 8, "lora_alpha": 16.0, "lora_target_modules": TARGETS,
            "optimizer": {"type": "Adam", "params": {"lr": 0.005, "betas": [0.9, 0.95], "eps": 1.0e-8}}}


@pytest.fixture(scope="module")
def dpo_lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dpo_lora")


@pytest.fixture(scope="module")
def dpo_lora(data: dict[str, Any], dpo_lora_dir: Path) -> list[dict[str, Any]]:  # noqa: F811
    """20 steps; its last step is saved (trained adapters, which a later run starts from)."""
    config = {**_dpo(data["root"]), **pairwise_paths(data["root"]), **DPO_EVAL, **DPO_LORA, "train_iters": 20,
              "save": str(dpo_lora_dir / "ckpt"), "checkpoint_factor": 20}
    return run_post(dpo_lora_dir, "single", config)


def test_dpo_with_lora_learns_against_the_frozen_base(dpo_lora: list[dict[str, Any]]) -> None:
    losses = series(dpo_lora, "train/lm_loss")
    # the reference is the base without adapters, which is the policy at step 1: loss log 2, rewards 0
    assert losses[1] == pytest.approx(np.log(2), abs=1e-6)
    assert series(dpo_lora, "train/rewards/chosen")[1] == pytest.approx(0.0, abs=1e-6)
    evals = [r for r in dpo_lora if "eval/rewards/accuracy" in r]
    assert evals[-1]["eval/rewards/accuracy"] > 0.9, evals  # held-out pairs
    assert evals[-1]["eval/rewards/margin"] > 0


def test_dpo_with_lora_from_a_lora_checkpoint_starts_at_it(data: dict[str, Any], dpo_lora: list[dict[str, Any]],  # noqa: F811
                                                           dpo_lora_dir: Path, tmp_path: Path) -> None:
    """Started from a checkpoint with trained adapters (issue 30 item 6), the reference is that checkpoint's
    model - base and adapters -, not the base alone: step 1's loss is ln 2 and its rewards 0 (they were 0.6934
    and non-zero), whatever the step then does."""
    rows = run_post(tmp_path, "from_lora", {**_dpo(data["root"]), **DPO_LORA, "train_iters": 1,
                                            "initialize_from": str(dpo_lora_dir / "ckpt")})
    assert series(rows, "train/lm_loss")[1] == pytest.approx(np.log(2), abs=1e-6)
    for side in ("chosen", "rejected"):
        assert series(rows, f"train/rewards/{side}")[1] == pytest.approx(0.0, abs=1e-6)


def test_dpo_with_lora_pp2_equals_single_rank(data: dict[str, Any], dpo_lora: list[dict[str, Any]],  # noqa: F811
                                              tmp_path: Path) -> None:
    """The reference pass goes through the policy's own pipeline with the adapters off."""
    rows = run_post(tmp_path, "pp2", {**_dpo(data["root"]), **DPO_LORA, **PP2})
    for key in ("train/lm_loss", "train/rewards/chosen", "train/rewards/rejected"):
        assert_same_steps(f"dpo lora pp2 {key}", series(rows, key), series(dpo_lora, key))



def test_kto_with_lora_under_zero3_starts_at_its_reference(data: dict[str, Any], tmp_path: Path) -> None:  # noqa: F811
    """KTO's reference is the base with adapters off, gathered from ZeRO-3 partitions: at step 1 the
    policy equals it (KL estimate 0, rewards 0); then the adapters move the policy away from it."""
    rows = run_post(tmp_path, "kto_dp2_zero3", {"train_impl": "kto", **kto_paths(data["root"], valid=False),
                                                "train_iters": 3, **DPO_LORA, "num_gpus": 2,
                                                "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})
    kl = series(rows, "train/kl")
    assert sorted(kl) == [1, 2, 3]
    assert kl[1] == pytest.approx(0.0, abs=1e-6)
    assert series(rows, "train/rewards/desirable")[1] == pytest.approx(0.0, abs=1e-6)
    assert abs(kl[3]) > 1e-6


def test_dry_run_estimates_memory_for_the_adapters(tmp_path: Path) -> None:
    """The trained count the estimate uses is the adapters' (what the optimizer state above holds)."""
    config = {**BASE_CONFIG, **LAYOUTS["single"], **LORA, "log_dir": str(tmp_path / "logs")}
    proc = deepy(config, tmp_path, "--dry-run", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trained (LoRA r=4)" in proc.stdout and f"{ADAPTER_PARAMS:,}" in proc.stdout, proc.stdout


def test_reward_model_with_lora_pp2_learns(data: dict[str, Any], tmp_path: Path) -> None:  # noqa: F811
    """RM: adapters plus the new scalar head (the only trained weights besides them), on two pipeline stages."""
    rows = run_post(tmp_path, "rm_pp2", {"train_impl": "rm", **pairwise_paths(data["root"]), "train_iters": 12,
                                         "eval_interval": 12, "eval_iters": 5, **DPO_LORA, **PP2})
    evals = [r["eval/rm/accuracy"] for r in rows if "eval/rm/accuracy" in r]
    assert evals and evals[-1] > 0.9, evals  # held-out pairs
