"""MoE end to end through ``deepy.py``: the same tiny fp32 MoE model gives the same per-step loss
on every layout, and a run split by a checkpoint continues exactly.

The model is the parity suite's tiny GPT (tests/e2e/test_parity.py) with a 4-expert top-2 MoE
layer in both blocks, load-balancing and z-loss in the objective (with coefficients large enough
that a wrong aux-loss gradient scale moves the losses by far more than the tolerance). Layouts:

* ``single``: 1 rank; reproduces ``golden_losses.json["parity_moe_tiny_fp32"]``;
* ``tp2``: experts split over the tensor-parallel ranks (GPT-NeoX's expert parallelism), ZeRO-1;
  its step-5 checkpoint is also resumed at tp1 x dp2 (the experts re-split, universal checkpoint);
* ``pp2``: pipeline stages, one MoE layer each (aux-loss gradients injected on both stages);
* ``dp2_zero1``: every data-parallel rank holds all experts, optimizer sharded by ZeRO-1;
* ``dp2_ep2`` (the resume test): experts split over the 2 data-parallel ranks with all-to-all,
  5 steps, a checkpoint, new processes, 5 more steps.

Refresh the golden entry after an intended numerical change with
``DEEPY_UPDATE_GOLDEN=1 pytest tests/e2e/test_moe_parity.py -k single``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_parity import BASE_CONFIG, GOLDEN, RTOL, assert_close, assert_ranks_report_their_coordinates, deepy, free_port

pytestmark = pytest.mark.slow

GOLDEN_KEY = "parity_moe_tiny_fp32"
MOE_CONFIG: dict[str, Any] = {
    **BASE_CONFIG,
    "moe_num_experts": 4,
    "moe_top_k": 2,
    "moe_router_type": "topk",
    "moe_aux_loss_coeff": 0.01,
    "moe_z_loss_coeff": 0.001,
}
LAYOUTS: dict[str, dict[str, Any]] = {
    "single": {"num_gpus": 1},
    # ZeRO-1 so that its step-5 checkpoint can also be loaded at another tp (universal checkpoint)
    "tp2": {"num_gpus": 2, "model_parallel_size": 2, "zero_optimization": {"stage": 1}},
    "pp2": {"num_gpus": 2, "pipe_parallel_size": 2},
    "dp2_zero1": {"num_gpus": 2, "zero_optimization": {"stage": 1}},
}
EP2 = {"num_gpus": 2, "moe_expert_parallel_size": 2, "zero_optimization": {"stage": 0}}


def run(config: dict[str, Any], tmp: Path, log_dir: str) -> list[dict[str, Any]]:
    config = {**config, "log_dir": str(tmp / log_dir), "master_port": free_port()}
    proc = deepy(config, tmp)
    if proc.returncode != 0:
        pytest.fail(f"{log_dir} failed with exit code {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    assert_ranks_report_their_coordinates(log_dir, proc.stdout + proc.stderr, config)
    return [json.loads(line) for line in (tmp / log_dir / "metrics.jsonl").read_text().splitlines()]


def curves(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    train = [r for r in rows if "train/lm_loss" in r]
    return {
        "train/lm_loss": [r["train/lm_loss"] for r in train],
        "train/grad_norm": [r["train/grad_norm"] for r in train],
        "train/moe_aux_loss": [r["train/moe_aux_loss"] for r in train],
        "eval_and_test/lm_loss": [r[k] for r in rows for k in ("eval/lm_loss", "test/lm_loss") if k in r],
    }


def load_golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())[GOLDEN_KEY]


def assert_matches_golden(name: str, got: dict[str, list[float]], golden: dict[str, Any]) -> None:
    assert_close(name, "train/lm_loss", got["train/lm_loss"], golden["train/lm_loss"], RTOL)
    assert_close(name, "train/grad_norm", got["train/grad_norm"], golden["train/grad_norm"], 1e-4)
    assert_close(name, "train/moe_aux_loss", got["train/moe_aux_loss"], golden["train/moe_aux_loss"], 1e-4)
    assert_close(name, "eval/test lm_loss", got["eval_and_test/lm_loss"], golden["eval_and_test/lm_loss"], RTOL)


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    """The tp2 layout, saving a checkpoint at step 5 on the way: (metrics rows, checkpoint dir)."""
    tmp = tmp_path_factory.mktemp("tp2")
    config = {**MOE_CONFIG, **LAYOUTS["tp2"], "save": str(tmp / "ckpt"), "checkpoint_factor": 5}
    return run(config, tmp, "logs"), tmp / "ckpt"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_loss_equals_golden(layout: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if layout == "tp2":
        rows = request.getfixturevalue("tp2_run")[0]
    else:
        rows = run({**MOE_CONFIG, **LAYOUTS[layout]}, tmp_path, "logs")
    got = curves(rows)
    if layout == "single" and os.environ.get("DEEPY_UPDATE_GOLDEN"):
        data = json.loads(GOLDEN.read_text())
        data[GOLDEN_KEY] = {**got, "config": MOE_CONFIG}
        GOLDEN.write_text(json.dumps(data, indent=2) + "\n")
    assert_matches_golden(layout, got, load_golden())
    # it really trained (random tokens leave little loss to lose: the gradient norm shows it)
    assert got["train/grad_norm"][-1] < 0.6 * got["train/grad_norm"][0]
    if layout == "single":
        # router statistics are logged every step and add up
        train = [r for r in rows if "train/lm_loss" in r]
        for row in train:
            shares = [row[f"moe/expert_share/{e}"] for e in range(4)]
            assert sum(shares) == pytest.approx(1.0)
            assert max(shares) <= row["moe/max_expert_share"] <= 1.0
            assert 0 < row["moe/router_entropy"] <= 1.3863 + 1e-6  # at most log(4)
            assert row["train/moe_z_loss"] > 0 and row["train/moe_aux_loss"] >= 0.99


def test_expert_parallel_run_resumes_exactly_and_equals_golden(tmp_path: Path) -> None:
    """Experts split over data-parallel ranks: the losses equal the single rank's, and a run
    interrupted after step 5 (checkpoint with one expert shard per expert-parallel rank) continues
    with exactly the losses of the uninterrupted run."""
    ckpt = str(tmp_path / "ckpt")
    common = {**MOE_CONFIG, **EP2, "save": ckpt, "load": ckpt, "checkpoint_factor": 5}
    first = curves(run({**common, "exit_interval": 5}, tmp_path, "logs1"))
    assert sorted(p.name for p in (tmp_path / "ckpt" / "global_step5" / "deepy_experts").iterdir()) == [
        "tp00_pp00_ep00.pt", "tp00_pp00_ep01.pt"]  # fmt: skip
    second = curves(run(common, tmp_path, "logs2"))
    assert len(first["train/lm_loss"]) == 5 and len(second["train/lm_loss"]) == 5  # resumed, not restarted
    joined = {key: first[key] + second[key] for key in first}
    # evaluations: step 5 (first run) and the test split (second run). The resumed run's step-10
    # evaluation reads the validation stream from its start again (Deepy does not checkpoint the
    # evaluator's position), so it is not the uninterrupted run's.
    (eval5,), (_, test) = first["eval_and_test/lm_loss"], second["eval_and_test/lm_loss"]
    golden = load_golden()
    joined["eval_and_test/lm_loss"] = [eval5, test]
    golden = {**golden, "eval_and_test/lm_loss": [golden["eval_and_test/lm_loss"][i] for i in (0, 2)]}
    assert_matches_golden("dp2_ep2 (resumed at step 5)", joined, golden)


def test_experts_split_over_tp_resume_at_another_layout(tmp_path: Path, tp2_run: tuple[list, Path]) -> None:
    """The tp2 checkpoint (2 experts per tensor-parallel rank) loaded at tp1 x dp2 (all 4 experts on
    each rank) through a universal checkpoint: steps 6-10 equal the uninterrupted run's."""
    config = {**MOE_CONFIG, "num_gpus": 2, "zero_optimization": {"stage": 1}, "load": str(tp2_run[1]),
              "iteration": 5}  # fmt: skip
    got = curves(run(config, tmp_path, "logs"))
    golden = load_golden()
    assert_close("tp1 dp2 from tp2", "train/lm_loss", got["train/lm_loss"], golden["train/lm_loss"][5:], RTOL)
    assert_close("tp1 dp2 from tp2", "train/grad_norm", got["train/grad_norm"], golden["train/grad_norm"][5:], 1e-4)


def test_golden_entry_is_consistent() -> None:
    golden = load_golden()
    assert golden["config"] == MOE_CONFIG, "MOE_CONFIG changed: refresh the golden entry (see module doc)"
    assert len(golden["train/lm_loss"]) == MOE_CONFIG["train_iters"]
