"""eval.py's pieces that need no model: its config, task lookup, metric names, stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron.errors import ConfigError
from megatron.evaluation.config import checked
from megatron.evaluation.harness import _specs, _task_manager, metric_rows, results_base
from megatron.evaluation.lm_eval_adapter import _cut
from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.component_groups import evaluation_run


def test_config_needs_tasks_and_reads_its_keys() -> None:
    with pytest.raises(ConfigError, match="eval.py needs eval_tasks"):
        checked(evaluation_run(NeoXArgs(seq_length=32)))
    with pytest.raises(ConfigError, match="seq_length must be set"):
        checked(evaluation_run(NeoXArgs(eval_tasks=["a"])))
    config = checked(evaluation_run(NeoXArgs(seq_length=32, eval_tasks=["a", "b.yaml"], eval_results_prefix="out/x",
                                             maximum_tokens=7, train_micro_batch_size_per_gpu=3, log_dir="logs")))
    assert (config.evaluation.eval_tasks, config.evaluation.eval_results_prefix, config.textgen.maximum_tokens,
            config.batch_size) == (["a", "b.yaml"], "out/x", 7, 3)
    assert results_base(config) == "out/x_"
    assert results_base(checked(evaluation_run(NeoXArgs(seq_length=32, eval_tasks=["a"], log_dir="logs")))) == "logs/"
    # unset micro-batch: one request
    assert checked(evaluation_run(NeoXArgs(seq_length=32, eval_tasks=["a"]))).batch_size == 1


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


# --- eval_tasks mistakes refused before launch or before the first step (issue 30, items 3 and 4) ------
REPO = Path(__file__).resolve().parents[2]
RUN = """\
num_layers: 2
hidden_size: 64
num_attention_heads: 4
seq_length: 32
max_position_embeddings: 32
optimizer: {type: Adam, params: {lr: 0.001}}
train_micro_batch_size_per_gpu: 2
train_iters: 4
use_dummy_dataset: true
tokenizer_type: CharLevelTokenizer
"""
LOCAL_TASK = "task: deepy_local\ndataset_path: json\noutput_type: loglikelihood\ndoc_to_text: '{{a}}'\ndoc_to_target: '{{b}}'\n"


def dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str) -> tuple[int, str, Path]:
    from megatron.app.deepy import main
    from megatron.errors import run_guarded

    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "task.yaml").write_text(LOCAL_TASK)
    config = tmp_path / "run.yml"
    config.write_text(RUN + extra.format(task=tmp_path / "tasks" / "task.yaml"))
    argv = ["--dry-run", str(REPO / "train.py"), str(config)]
    with pytest.raises(SystemExit) as done:
        run_guarded(lambda: main(argv), argv=argv)
    captured = capsys.readouterr()
    return int(done.value.code or 0), captured.out + captured.err, config


@pytest.mark.parametrize(("extra", "named"), [
    # item 3: gloo "collective mismatch" at the first evaluation before
    ("num_gpus: 2\ncontext_parallel_size: 2\neval_tasks: [{task}]\n", "context_parallel_size=2 ({config}:12)"),
    ("num_gpus: 2\nmodel_parallel_size: 2\nsequence_parallel: true\neval_tasks: [{task}]\n",
     "sequence_parallel=True ({config}:13)"),
    ("num_gpus: 1\ntrain_impl: rm\neval_tasks: [{task}]\n", "train_impl='rm' ({config}:12)"),
    ("num_gpus: 1\neval_tasks: [lambada_openaii, {task}]\n", "unknown task(s) ['lambada_openaii']"),
    ("num_gpus: 1\neval_tasks: [tasks/missing.yaml]\n", "task file(s) ['tasks/missing.yaml'] not found"),
], ids=["context_parallel", "sequence_parallel", "reward_model", "unknown_name", "missing_file"])
def test_eval_tasks_mistakes_are_refused_before_launch(extra: str, named: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, config = dry_run(tmp_path, capsys, extra)
    assert code == 2, out
    assert f"eval_tasks=" in out and f"({config}:" in out and named.format(config=config) in out, out
    assert "Traceback" not in out


def test_known_names_and_local_tasks_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron.evaluation.checks import unknown_task_names

    code, out, _ = dry_run(tmp_path, capsys, "num_gpus: 1\neval_tasks: [{task}, deepy_local]\n")
    assert code == 0, out
    # the harness' own names (a task, a group), against its ~14k task files
    assert unknown_task_names(["lambada_openai", "mmlu", "lambada_openaii"]) == ["lambada_openaii"]


def test_a_task_whose_data_needs_a_download_is_refused_by_name(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, a hub dataset cannot be read: one ConfigError naming eval_tasks and the task (the ranks call
    this before the first step), instead of a ConnectionError traceback at the first evaluation."""
    from megatron.evaluation.harness import load_tasks

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # read once at import by both libraries (lm-eval's dependencies; a rank imports them with these set)
    monkeypatch.setattr("datasets.config.HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "hub.yaml").write_text(LOCAL_TASK.replace("deepy_local", "deepy_hub").replace(
        "dataset_path: json", "dataset_path: deepy-tests/not-downloaded"))
    with pytest.raises(ConfigError, match=r"eval_tasks: task '.*hub.yaml' cannot be loaded \(ConnectionError.*HF_DATASETS_OFFLINE"):
        load_tasks([str(tmp_path / "hub.yaml")])


def test_eval_rows_go_to_the_run_that_wrote_the_checkpoint(tmp_path: Path) -> None:
    """Not to the newest run of log_dir, which ``<log_dir>/metrics.jsonl`` follows (issue 30, newcomer)."""
    import json

    from megatron.evaluation.harness import write_results
    from megatron.generation.loading import run_name_of
    from megatron.logging.metrics import MetricsWriter

    logs = tmp_path / "logs"
    for name in ("20260101-000000-aaaa", "20260102-000000-bbbb"):  # the second is newer: the link points there
        with MetricsWriter.for_run(logs, name) as writer:
            writer.write({"iteration": 5, "train/lm_loss": 1.0})
    ckpt = tmp_path / "ckpt" / "global_step5"
    ckpt.mkdir(parents=True)
    (ckpt / "deepy_meta.json").write_text(json.dumps(
        {"format": 2, "iteration": 5, "extra": {"train_state": {"iteration": 5, "run_name": "20260101-000000-aaaa"}}}))
    assert run_name_of(ckpt) == "20260101-000000-aaaa"

    config = NeoXArgs(seq_length=32, eval_tasks=["t"], log_dir=str(logs), eval_results_prefix=str(tmp_path / "r"))
    write_results({"results": {"t": {"acc,none": 0.25}}}, evaluation_run(config), checkpoint=str(ckpt.parent), step=5,
                  run_name=run_name_of(ckpt))
    rows = {name: [json.loads(line) for line in (logs / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("20260101-000000-aaaa", "20260102-000000-bbbb")}
    assert rows["20260101-000000-aaaa"][-1] == {"iteration": 5, "lm_eval/t/acc": 0.25}
    assert all("lm_eval/t/acc" not in r for r in rows["20260102-000000-bbbb"])
    assert json.loads((tmp_path / "r_eval_results.json").read_text())["deepy"]["run_name"] == "20260101-000000-aaaa"


def test_eval_tasks_limit_caps_the_documents_each_task_reads(tmp_path: Path) -> None:
    """lm-evaluation-harness runs on a local 5-document task; eval_tasks_limit=2 scores the first 2 only."""
    import json
    from types import SimpleNamespace

    from lm_eval.api.model import LM

    from megatron.evaluation.harness import evaluate

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"a": f"q{i}", "b": f" a{i}"}) + "\n" for i in range(5)))
    (tmp_path / "t.yaml").write_text(
        f"task: limit_probe\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {docs}\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: '{{a}}'\ndoc_to_target: '{{b}}'\n"
        "metric_list:\n  - metric: acc\n")

    class Scored(LM):  # every continuation gets log-probability -1 and counts as greedy
        replica = SimpleNamespace(dp_rank=0, tp_rank=0, pp_rank=0)
        seen: list[str] = []

        def loglikelihood(self, requests):  # type: ignore[no-untyped-def]
            self.seen.extend(r.args[0] for r in requests)
            return [(-1.0, True) for _ in requests]

        def loglikelihood_rolling(self, requests):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def generate_until(self, requests):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    lm = Scored()
    config = NeoXArgs(seq_length=32, eval_tasks=[str(tmp_path / "t.yaml")], eval_tasks_limit=2)
    results = evaluate(lm, evaluation_run(config))  # type: ignore[arg-type]
    assert sorted(lm.seen) == ["q0", "q1"]  # without the limit: all 5
    assert len(results["samples"]["limit_probe"]) == 2


def test_the_shipped_local_task_runs_through_lm_eval_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 42 item 15: configs/lm_eval/python_builtins.yaml, as the docs run it (from the repository root,
    offline): the harness reads all 24 questions from the file beside it and scores each choice after the
    docstring; with an LM that prefers the shortest choice, accuracy is the share of questions whose answer is
    the shortest name."""
    import json
    from types import SimpleNamespace
    from typing import Any

    from lm_eval.api.model import LM

    from megatron.evaluation.harness import evaluate
    from megatron.evaluation.task_data import EXAMPLE_TASK

    monkeypatch.chdir(REPO)
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", tmp_path / "cache")
    data = REPO / "configs" / "lm_eval" / "python_builtins.jsonl"
    docs = [json.loads(line) for line in data.read_text().splitlines()]

    class Shortest(LM):
        replica = SimpleNamespace(dp_rank=0, tp_rank=0, pp_rank=0)
        contexts: set[str] = set()

        def loglikelihood(self, requests: Any) -> list[tuple[float, bool]]:
            self.contexts.update(r.args[0] for r in requests)
            return [(-float(len(r.args[1])), False) for r in requests]

        def loglikelihood_rolling(self, requests: Any) -> Any:
            raise NotImplementedError

        def generate_until(self, requests: Any) -> Any:
            raise NotImplementedError

    lm = Shortest()
    config = NeoXArgs(seq_length=32, eval_tasks=[EXAMPLE_TASK])
    results = evaluate(lm, evaluation_run(config))  # type: ignore[arg-type]
    assert lm.contexts == {f"{d['docstring']}\nThe built-in function:" for d in docs}
    shortest = [min(range(4), key=lambda i, d=d: len(d["choices"][i])) for d in docs]  # lm-eval: first of equals
    want = sum(s == d["answer"] for s, d in zip(shortest, docs)) / len(docs)
    assert len(docs) == 24 and sorted(d["answer"] for d in docs) == sorted([0, 1, 2, 3] * 6)
    assert results["results"]["python_builtins"]["acc,none"] == pytest.approx(want)
    assert len(results["samples"]["python_builtins"]) == 24
