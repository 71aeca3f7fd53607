"""``train_batch_size_schedule`` against Levanter's rule, re-derived here from its code
(stanford-crfm/levanter @ 9263f81e):

- step s uses the value of the last entry whose ``start <= s`` (``BatchSchedule.batch_size_at_step``,
  src/levanter/schedule.py:98-106; segments end at the next start, schedule.py:86-96), the last one
  holding forever;
- step s reads global samples ``[offset(s), offset(s) + batch(s))``, ``offset(s)`` = the samples of every
  earlier step (``global_data_offset_by_step``/``batch_indices_at_step``, schedule.py:108-119/130-141;
  data/loader.py:166-170 adds each device's slice to it).

The reference below is the plain per-step sum, not the segment formula the code uses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from megatron.config_rules import Device
from megatron.data.batch import BatchLayout
from megatron.data.batch_schedule import BatchSchedule
from megatron.data.build import samples_needed
from megatron.data.sampler import MicroBatchIterator
from megatron.errors import ConfigError
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.derived import finalize
from megatron.neox_arguments.resolved import ResolvedConfig

# the shape of Levanter's gpt2_small_fast_batch_schedule.yaml (starts 0/64/256/1024), sizes scaled down
LEVANTER_STYLE = [(0, 8), (4, 16), (10, 8), (13, 32)]


def levanter_batch(schedule: list[tuple[int, int]], step: int) -> int:
    return [value for start, value in schedule if start <= step][-1]


def levanter_offset(schedule: list[tuple[int, int]], step: int) -> int:
    return sum(levanter_batch(schedule, t) for t in range(step))


def test_each_steps_batch_and_offset_follow_levanters_rule() -> None:
    sched = BatchSchedule.of(LEVANTER_STYLE)
    for step in range(40):
        assert sched.batch_at(step) == levanter_batch(LEVANTER_STYLE, step), step
        assert sched.offset_at(step) == levanter_offset(LEVANTER_STYLE, step), step
        assert sched.step_at_offset(levanter_offset(LEVANTER_STYLE, step)) == step
    assert sched.step_at_offset(levanter_offset(LEVANTER_STYLE, 5) + 8) is None  # inside step 5 (16 samples)
    # the train split is sized by the sum of the steps' batches
    assert samples_needed(8, 20, 0, 0, batch_steps=tuple(LEVANTER_STYLE))[0] == levanter_offset(LEVANTER_STYLE, 20)


class Indices:
    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"text": np.array([i])}


@pytest.mark.parametrize("dp", [1, 2])
def test_the_ranks_read_each_steps_samples_and_a_resume_mid_schedule_reads_the_same(dp: int) -> None:
    """micro 2 per rank: the micro-batch count per step is batch / (2 x dp); the ranks' micro-batches of
    step s together are exactly Levanter's ``[offset(s), offset(s) + batch(s))``, in order of rank."""
    layout, sched = BatchLayout(micro=2, gas=8 // (2 * dp), dp=dp), BatchSchedule.of(LEVANTER_STYLE)
    its = [MicroBatchIterator(Indices(), 0, layout, r, sched) for r in range(dp)]
    resumed = [MicroBatchIterator(Indices(), levanter_offset(LEVANTER_STYLE, 11), layout, r, sched) for r in range(dp)]
    for step in range(16):
        gas = levanter_batch(LEVANTER_STYLE, step) // (2 * dp)
        read = [[int(i) for _ in range(gas) for i in next(it)["text"][:, 0]] for it in its]
        start = levanter_offset(LEVANTER_STYLE, step)
        assert sum(read, []) == list(range(start, start + levanter_batch(LEVANTER_STYLE, step))), step
        if step >= 11:
            assert [[int(i) for _ in range(gas) for i in next(it)["text"][:, 0]] for it in resumed] == read
    assert its[0].consumed_samples == levanter_offset(LEVANTER_STYLE, 16)
    with pytest.raises(Exception, match="not where a step"):
        MicroBatchIterator(Indices(), levanter_offset(LEVANTER_STYLE, 5) + 2 * dp, layout, 0, sched)


BASE: dict[str, Any] = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                        "train_micro_batch_size_per_gpu": 2, "train_iters": 10, "lr": 1e-3,
                        "use_dummy_dataset": True, "tokenizer_type": "CharLevelTokenizer"}


def finalized(world: int, **values: Any) -> NeoXArgs:
    merged = {**BASE, **values}
    provenance = {key: f"cfg.yml:{line}" for line, key in enumerate(merged, start=1)}
    return finalize(ResolvedConfig(args=NeoXArgs(**merged), provenance=provenance), world,
                    device=Device(cuda=False, fp16_supported=False)).args


def steps(*pairs: tuple[int, int]) -> list[dict[str, int]]:
    return [{"start_step": s, "global_batch": b} for s, b in pairs]


def test_train_batch_size_is_step_zeros_batch_and_bad_schedules_are_refused_by_name() -> None:
    args = finalized(2, train_batch_size_schedule=steps((0, 4), (3, 12)))
    assert (args.train_batch_size, args.gradient_accumulation_steps) == (4, 1)
    for values, words in (
        (dict(train_batch_size_schedule=steps((0, 4), (3, 6))), "not a positive multiple of the micro batch x dp"),
        (dict(train_batch_size_schedule=steps((1, 4))), "the first entry starts at step 0"),
        (dict(train_batch_size_schedule=steps((0, 4), (3, 8), (3, 12))), "increasing start_step"),
        (dict(train_batch_size_schedule=steps((0, 4)), train_batch_size=8), "train_batch_size is step 0's batch"),
        (dict(train_batch_size_schedule=steps((0, 4)), pipe_parallel_size=1), "pipeline engine"),
        (dict(train_batch_size_schedule=[{"start": 0, "value": 4}]), "is not {start_step: int"),
    ):
        with pytest.raises(ConfigError) as err:
            finalized(2, **values)
        assert "train_batch_size_schedule" in err.value.message and "cfg.yml:" in err.value.message, err.value.message
        assert words in err.value.message, err.value.message


# Levanter's schedule, written as its config/gpt2_small_fast_batch_schedule.yaml writes it (@9263f81e: a
# list of {start, value} under trainer.train_batch_size, per_device_parallelism -1, an eval parallelism,
# allow_nondivisible_batch_size: true); the sizes here are small
LEVANTER = """\
model:
  type: gpt2
  hidden_dim: 32
  num_heads: 4
  num_layers: 2
trainer:
  per_device_parallelism: -1
  per_device_eval_parallelism: 4
  train_batch_size:
    - start: 0
      value: 16
    - start: 4
      value: 32
    - start: 10
      value: 8
  num_train_steps: 20
  allow_nondivisible_batch_size: true
"""


def load_levanter(tmp_path: Any, text: str) -> Any:
    from megatron.neox_arguments.dialects import split_argv
    from megatron.neox_arguments.loading import load_config

    (tmp_path / "run.yaml").write_text(text)
    _, parsed = split_argv(["--config_path", str(tmp_path / "run.yaml")])
    return load_config([], (), None, parsed)


def test_levanters_schedule_maps_onto_the_key_with_one_micro_batch(tmp_path: Any) -> None:
    resolved = load_levanter(tmp_path, LEVANTER)
    assert resolved.args.train_batch_size_schedule == steps((0, 16), (4, 32), (10, 8))
    # per_device_parallelism -1: Levanter runs each step's batch whole; Deepy's fixed micro batch x dp is the
    # sizes' gcd (8), so step 0's 16 samples are 2 micro-batches, step 4's 32 are 4
    assert resolved.args.gradient_accumulation_steps == 2
    resolved.args.use_dummy_dataset, resolved.args.tokenizer_type = True, "CharLevelTokenizer"  # no data block here
    args = finalize(resolved, 2, device=Device(cuda=False, fp16_supported=False)).args
    assert (args.train_batch_size, args.train_micro_batch_size_per_gpu) == (16, 4)
    with pytest.raises(ConfigError, match="trainer.train_batch_size.*per_device_eval_parallelism"):
        load_levanter(tmp_path, LEVANTER.replace("  per_device_eval_parallelism: 4\n", ""))
