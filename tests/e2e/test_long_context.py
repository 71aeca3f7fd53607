"""Long context end to end: packed documents kept apart and context parallelism, by ``deepy.py``.

The corpus is many short documents, each ending with the end-of-document token, packed into
``seq_length + 1`` samples (``pack_impl: packed``), so most samples hold several documents. The
single-rank runs with and without ``reset_attention_mask`` / ``reset_position_ids`` are the
references; every context-parallel layout - cp2, cp2·tp2, cp2·pp2, cp2·dp2 ZeRO-1 and cp2·dp2 ZeRO-3 -
must give the per-step losses of the single-rank run with the same mask setting within 1e-5
(relative, fp32), with and without the document masks:

| layout | with document masks | without |
|---|---|---|
| cp2 | in-process | in-process |
| cp2·tp2, cp2·pp2, cp2·dp2 ZeRO-3 | deepy.py launch | in-process |
| cp2·dp2 ZeRO-1 | in-process | deepy.py launch |

"In-process": spawned gloo ranks that do what train.py does - the config through the real loader and
rules, ``initialize``, ``pretrain`` (DeepSpeed's engine with its ZeRO stage, PipelineModule) - several
runs one after another in the same processes, which saves a launch (about 12 s on 2 cores) per run.
A run saved at cp2 (ZeRO-1) after 3 steps resumes at cp1 and continues the single-rank curve.
Without the keys the losses differ (the keys are honoured).

The model-level properties - each document's loss and gradients equal those of the document alone
(tp2, pp2), and context-parallel attention's loss and gradients equal one rank's (with and without
document masks, cp2 and cp2·tp2) - are tests/unit/test_document_mask.py,
tests/distributed/test_document_mask_parallel.py and tests/distributed/test_context_parallel.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ports import free_port
from test_parity import BASE_CONFIG, deepy

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, index_file_path
from tests.distributed.rank_harness import finish_rank, run_ranks

pytestmark = pytest.mark.slow

RTOL = 1e-5
STEPS = 6
DOCUMENTS = {"reset_attention_mask": True, "reset_position_ids": True}
LAYOUTS: dict[str, dict[str, Any]] = {
    # recomputing the blocks (document ids and positions ride along as checkpointed inputs)
    "cp2_tp2": {"num_gpus": 4, "context_parallel_size": 2, "model_parallel_size": 2, "checkpoint_activations": True},
    "cp2_pp2": {"num_gpus": 4, "context_parallel_size": 2, "pipe_parallel_size": 2, "checkpoint_activations": True},
    "cp2_dp2_zero3": {"num_gpus": 4, "context_parallel_size": 2, "zero_optimization": {"stage": 3}},
}
ZERO1 = {"num_gpus": 4, "context_parallel_size": 2, "zero_optimization": {"stage": 1}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Documents of 3 to 20 tokens (bytes 1..255, then the CharLevelTokenizer's EOD 0)."""
    prefix = tmp_path_factory.mktemp("packed") / "docs_text_document"
    rng = np.random.default_rng(7)
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(400):
        doc = rng.integers(1, 256, int(rng.integers(3, 21)))
        doc[-1] = 0
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    return str(prefix)


def config_of(tmp: Path, corpus: str, **overrides: Any) -> dict[str, Any]:
    """The run's config; learned positions, so reset_position_ids matters."""
    return {**BASE_CONFIG, "use_dummy_dataset": False, "data_path": corpus, "split": "98,2,0", "pos_emb": "learned",
            "train_iters": STEPS, "eval_interval": 1000, "num_gpus": 1, **overrides, "log_dir": str(tmp / "logs")}


def losses_of(log_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["iteration"]: row["train/lm_loss"] for row in rows if "train/lm_loss" in row}


def train(tmp: Path, corpus: str, **overrides: Any) -> tuple[dict[int, float], str]:
    """(step -> loss, the run's output) of a ``deepy.py`` launch."""
    tmp.mkdir(parents=True, exist_ok=True)
    proc = deepy(config_of(tmp, corpus, **overrides), tmp)  # no master_port: deepy picks a free one
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return losses_of(tmp / "logs"), out


def assert_same(got: dict[int, float], want: dict[int, float]) -> None:
    assert got and set(got) <= set(want), (got, want)
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(got)], rtol=RTOL, atol=0)


@pytest.fixture(scope="module")
def single(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    return train(tmp_path_factory.mktemp("single"), corpus, **DOCUMENTS)[0]


@pytest.fixture(scope="module")
def single_plain(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    return train(tmp_path_factory.mktemp("single_plain"), corpus)[0]


def test_document_keys_change_the_run(single: dict[int, float], single_plain: dict[int, float]) -> None:
    assert len(single) == len(single_plain) == STEPS
    assert abs(single[1] - single_plain[1]) > 1e-3  # the first step already sees other documents' tokens


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_context_parallel_layout_with_document_masks_matches_single_rank(
        layout: str, corpus: str, single: dict[int, float], tmp_path: Path) -> None:  # fmt: skip
    assert_same(train(tmp_path, corpus, **DOCUMENTS, **LAYOUTS[layout])[0], single)


def test_context_parallel_without_document_masks_matches_single_rank(
        corpus: str, single_plain: dict[int, float], tmp_path: Path) -> None:  # fmt: skip
    assert_same(train(tmp_path, corpus, **ZERO1)[0], single_plain)


def test_resume_from_cp2_at_cp1_continues_the_curve(corpus: str, single: dict[int, float], tmp_path: Path) -> None:
    # ZeRO-1 partitions the optimizer state over the cp2 ranks: loading at cp1 must regroup it
    save = {"save": str(tmp_path / "ckpt"), "load": str(tmp_path / "ckpt"), "checkpoint_factor": 3,
            "zero_optimization": {"stage": 1}}
    first, _ = train(tmp_path / "cp2", corpus, **DOCUMENTS, **save, num_gpus=2, context_parallel_size=2,
                     exit_interval=3)
    assert sorted(first) == [1, 2, 3]
    second, out = train(tmp_path / "cp1", corpus, **DOCUMENTS, **save)
    assert sorted(second) == [4, 5, 6], out[-3000:]
    assert "layout changed from" in out and "resumed from" in out, out[-3000:]
    assert_same(first | second, single)


# --- the other mask setting of each launched layout, and cp2, in-process (see the module docstring) --
CP2 = {"num_gpus": 2, "context_parallel_size": 2}
IN_PROCESS: dict[int, dict[str, dict[str, Any]]] = {  # world size -> run name -> config overrides
    4: {"cp2_tp2_plain": LAYOUTS["cp2_tp2"], "cp2_pp2_plain": LAYOUTS["cp2_pp2"],
        "cp2_dp2_zero3_plain": LAYOUTS["cp2_dp2_zero3"], "cp2_dp2_zero1_documents": {**ZERO1, **DOCUMENTS}},
    2: {"cp2_plain": CP2, "cp2_documents": {**CP2, **DOCUMENTS}},
}
# what each run's engine was built with (zero stage, tp, pp, cp): the layout its name says
BUILT_WITH = {"cp2_tp2_plain": "zero=0 tp=2 pp=1 cp=2", "cp2_pp2_plain": "zero=0 tp=1 pp=2 cp=2",
              "cp2_dp2_zero3_plain": "zero=3 tp=1 pp=1 cp=2", "cp2_dp2_zero1_documents": "zero=1 tp=1 pp=1 cp=2",
              "cp2_plain": "zero=0 tp=1 pp=1 cp=2", "cp2_documents": "zero=0 tp=1 pp=1 cp=2"}


def _runs_in_process(rank: int, out_dir: str) -> None:
    """One rank: every run of ``plan.json`` in turn, as train.py runs one; stops at the first failure
    (the other ranks would wait for it in their next collective: the harness times out)."""
    import os
    import traceback

    import torch

    plan = json.loads(Path(out_dir, "plan.json").read_text())
    world = int(plan["world"])
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(plan["port"]))
    torch.set_num_threads(1)
    from megatron import mpu
    from megatron.initialize import initialize
    from megatron.neox_arguments.run_config import RunConfig
    from megatron.training.pretrain import pretrain

    results: dict[str, str] = {}
    for name, config in plan["runs"].items():
        try:
            run = RunConfig.from_mapping(config, world)
            initialize(run.parallel, run.training.seed)  # new groups for this run's layout
            pretrain(run, run.checkpoint)
            # what the layout became: the DeepSpeed config and groups the engine was built from
            zero = int((run.deepspeed_config.get("zero_optimization") or {}).get("stage", 0))
            results[name] = (f"ok zero={zero} tp={mpu.get_tensor_model_parallel_world_size()} "
                             f"pp={mpu.get_pipe_parallel_world_size()} cp={mpu.get_context_parallel_world_size()}")
        except Exception:
            results[name] = traceback.format_exc()
            break
    finish_rank(out_dir, rank, results)


@pytest.fixture(scope="module")
def in_process(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Path]]:
    """Run name -> ("ok <zero, tp, pp, cp it was built with>" or each failing rank's traceback, its log directory)."""
    outcome: dict[str, tuple[str, Path]] = {}
    for world, runs in IN_PROCESS.items():
        tmp = tmp_path_factory.mktemp(f"in_process_{world}")
        configs = {name: config_of(tmp / name, corpus, **overrides) for name, overrides in runs.items()}
        (tmp / "plan.json").write_text(json.dumps({"world": world, "port": free_port(), "runs": configs}))
        results = run_ranks(_runs_in_process, world, tmp, timeout_s=300)
        for name in runs:
            failed = [f"rank {r}: {res.get(name, 'not run')}" for r, res in enumerate(results)
                      if not res.get(name, "").startswith("ok")]
            outcome[name] = ("\n".join(failed) or results[0][name], tmp / name / "logs")
    return outcome


@pytest.mark.parametrize("name", [name for runs in IN_PROCESS.values() for name in runs])
def test_context_parallel_layout_in_process_matches_single_rank(
        name: str, in_process: dict[str, tuple[str, Path]], single: dict[int, float],
        single_plain: dict[int, float]) -> None:  # fmt: skip
    status, log_dir = in_process[name]
    assert status == f"ok {BUILT_WITH[name]}", status
    got = losses_of(log_dir)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    assert_same(got, single if name.endswith("_documents") else single_plain)
