"""eval.py's pieces that need no model: its config, task lookup, metric names, stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron.errors import ConfigError
from megatron.evaluation.config import checked
from megatron.generation.config import batch_size
from megatron.evaluation.harness import _specs, _task_manager, metric_rows, results_base
from megatron.evaluation.lm_eval_adapter import _cut
from megatron.neox_arguments import NeoXArgs


def test_config_needs_tasks_and_reads_its_keys() -> None:
    with pytest.raises(ConfigError, match="eval.py needs eval_tasks"):
        checked(NeoXArgs(seq_length=32))
    with pytest.raises(ConfigError, match="seq_length must be set"):
        checked(NeoXArgs(eval_tasks=["a"]))
    config = checked(NeoXArgs(seq_length=32, eval_tasks=["a", "b.yaml"], eval_results_prefix="out/x",
                              maximum_tokens=7, train_micro_batch_size_per_gpu=3, log_dir="logs"))
    assert (config.eval_tasks, config.eval_results_prefix, config.maximum_tokens, batch_size(config)) == (
        ["a", "b.yaml"], "out/x", 7, 3)
    assert results_base(config) == "out/x_"
    assert results_base(checked(NeoXArgs(seq_length=32, eval_tasks=["a"], log_dir="logs"))) == "logs/"
    assert batch_size(checked(NeoXArgs(seq_length=32, eval_tasks=["a"]))) == 1  # unset micro-batch: one request


def test_local_task_files_need_no_builtin_index(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("task: my_local_task\ndataset_path: json\noutput_type: loglikelihood\n"
                                     "doc_to_text: '{{a}}'\ndoc_to_target: '{{b}}'\n")
    manager = _task_manager((str(tmp_path / "t.yaml"), str(tmp_path)))
    assert manager.all_tasks == ["my_local_task"]  # the ~15k built-in tasks were not indexed
    assert _specs((str(tmp_path),), manager) == ["my_local_task"]


def test_metric_names_are_prefixed_and_stable() -> None:
    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "exact_match,strict": 1,
                                 "bleu_stderr,none": "N/A"}}}
    assert metric_rows(results) == {"lm_eval/t/acc": 0.5, "lm_eval/t/acc_stderr": 0.1,
                                    "lm_eval/t/exact_match/strict": 1.0}


def test_generations_are_cut_before_the_earliest_stop_string() -> None:
    assert _cut("a cat. a dog\n", [".", "\n"]) == "a cat"
    assert _cut("a cat\n. a dog", [".", "\n"]) == "a cat"
    assert _cut("no stop", ["."]) == "no stop"


def test_generate_and_eval_refuse_to_run_without_a_checkpoint(tmp_path: Path) -> None:
    from megatron.errors import CheckpointError
    from megatron.generation.loading import committed_checkpoint

    with pytest.raises(CheckpointError, match="generate.py needs `load`"):
        committed_checkpoint(None, None, "generate.py")
    (tmp_path / "global_step5").mkdir()  # an incomplete save: no commit marker
    with pytest.raises(CheckpointError, match=f"eval.py: no committed checkpoint in {tmp_path}"):
        committed_checkpoint(str(tmp_path), None, "eval.py")
