"""Resume at another parallel layout, with no offline step: the loss curve continues.

Each chain trains a few steps, saves, and the next run loads at a different (tp, pp, dp, ZeRO)
layout; the runs' losses together must equal one uninterrupted run at dp2. The conversion to a
DeepSpeed universal checkpoint happens inside the loading run (rank 0 converts, the others wait).
Global batch (8) and the schedule are the same in every layout, so the data position carries over.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_resume import DP2, assert_curves_match, deepy, losses, output

pytestmark = pytest.mark.slow

# Different layouts sum in a different order, so allow float noise, far below a step's change.
TOL = 2e-5


def layout(tp: int, pp: int, dp: int, zero: int) -> tuple[str, ...]:
    """``pp=0`` is the plain model (no PipelineModule): DeepSpeed allows ZeRO-2 only there."""
    return (
        f"num_gpus={tp * max(pp, 1) * dp}",
        f"model_parallel_size={tp}",
        f"pipe_parallel_size={pp}",
        f"zero_optimization={{stage: {zero}}}",
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("reference")
    proc = deepy(tmp, *DP2, "hidden_dropout=0.0", "log_dir=logs")
    assert proc.returncode == 0, output(proc)
    return losses(tmp / "logs")


def run_chain(
    tmp: Path, stages: list[tuple[tuple[str, ...], int]], extra: tuple[str, ...] = ()
) -> list[dict[int, float]]:
    """Run each (layout, stop step) in turn on one checkpoint directory; return each run's losses."""
    curves = []
    for index, (lay, stop) in enumerate(stages):
        log_dir = f"logs{index}"
        proc = deepy(tmp, *lay, *extra, "hidden_dropout=0.0", "save=ckpt", "load=ckpt", "checkpoint_factor=4",
                     f"exit_interval={stop}", f"log_dir={log_dir}")  # fmt: skip
        assert proc.returncode == 0, output(proc)
        if index > 0:
            assert "layout changed from" in output(proc), output(proc)
        curves.append(losses(tmp / log_dir))
    return curves


def test_dp2_to_dp1_to_dp2_across_zero_stages(tmp_path: Path, reference: dict[int, float]) -> None:
    curves = run_chain(tmp_path, [(layout(1, 0, 2, 1), 4), (layout(1, 0, 1, 2), 8), (layout(1, 0, 2, 1), 12)])
    assert [sorted(c) for c in curves] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    for curve in curves:
        assert_curves_match(curve, reference, TOL)
    assert (tmp_path / "ckpt" / "global_step4_universal" / "COMMITTED").exists()


def test_tp2_to_tp1_and_back_with_gqa_and_swiglu(tmp_path: Path) -> None:
    # fused QKV with unequal sections (4 query heads, 2 kv heads) and a gated MLP: the universal
    # conversion must cut and glue them section by section
    model = ("num_kv_heads=2", "activation=swiglu")
    ref = deepy(tmp_path, *layout(1, 1, 2, 1), *model, "hidden_dropout=0.0", "log_dir=ref")
    assert ref.returncode == 0, output(ref)
    reference = losses(tmp_path / "ref")
    stages = [(layout(2, 1, 1, 1), 4), (layout(1, 1, 2, 1), 8), (layout(2, 1, 1, 1), 12)]
    for curve in run_chain(tmp_path, stages, model):
        assert_curves_match(curve, reference, TOL)


def test_pp2_to_pp1_and_back(tmp_path: Path, reference: dict[int, float]) -> None:
    curves = run_chain(tmp_path, [(layout(1, 2, 1, 1), 4), (layout(1, 1, 2, 1), 8), (layout(1, 2, 1, 1), 12)])
    for curve in curves:
        assert_curves_match(curve, reference, TOL)

    # the plain model (pipe_parallel_size: 0) names parameters differently: a clear refusal
    plain = deepy(tmp_path, *layout(1, 0, 2, 1), "load=ckpt", "iteration=8", "log_dir=plain")
    assert plain.returncode == 2, output(plain)
    assert "pipeline-wrapped and the plain model name their parameters differently" in output(plain)
