"""Issue 42 item 15: ``eval_tasks`` whose documents this machine cannot read are refused before launch.

``python deepy.py eval.py CONFIG eval_tasks=[lambada_openai]`` without a network retried the download for 1m45s
on both ranks and ended in a ~50-line traceback. deepy.py now finds each task's data as lm-evaluation-harness and
Hugging Face ``datasets`` would (``megatron/evaluation/task_data.py``) and says in one line that the dataset
needs a download and which local task to use instead; training with ``eval_tasks`` gets the same check.

The oracles are the libraries' own code, run here: lm-eval 0.4.13's ``TaskIndex``/``load_yaml`` for what a name
and a file resolve to, ``datasets`` 5.2.0's ``CachedDatasetModuleFactory`` for what counts as cached, its
``camelcase_to_snakecase`` and its packaged builders. The shipped task runs through lm-eval itself, offline, in
``tests/unit/test_evaluation.py`` (beside the other in-process harness run: one import of the harness).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron.evaluation import task_data

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
num_gpus: 1
"""
NETWORK_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HTTPS_PROXY",
                     "https_proxy", "ALL_PROXY", "all_proxy")


@pytest.fixture()
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No offline switch, no proxy, the default endpoint, an empty datasets cache."""
    for name in NETWORK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    return monkeypatch


def dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], tasks: str, script: str = "eval.py") -> tuple[int, str]:
    from megatron.app.deepy import main
    from megatron.errors import run_guarded

    config = tmp_path / "run.yml"
    config.write_text(RUN + f"eval_tasks: {tasks}\n")
    argv = ["--dry-run", str(REPO / script), str(config)]
    with pytest.raises(SystemExit) as done:
        run_guarded(lambda: main(argv), argv=argv)
    captured = capsys.readouterr()
    return int(done.value.code or 0), captured.out + captured.err


@pytest.fixture()
def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture()
def listening_port() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield int(server.getsockname()[1])


@pytest.mark.parametrize("script", ["eval.py", "train.py"])
def test_a_hub_task_that_cannot_be_downloaded_is_refused_in_one_line(
        script: str, env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Offline, lambada_openai's dataset (not cached) cannot be read: exit 2, one line naming the key, the task,
    its dataset, why nothing can be downloaded and the shipped local task; training with eval_tasks likewise."""
    env.setenv("HF_DATASETS_OFFLINE", "1")
    code, out = dry_run(tmp_path, capsys, "[lambada_openai]", script)
    assert code == 2, out
    said = [line for line in out.splitlines() if "lambada_openai" in line]
    assert len(said) == 1, out
    for part in ("eval_tasks=['lambada_openai'] (", "task 'lambada_openai' reads 'EleutherAI/lambada_openai'",
                 str(tmp_path / "hf_cache"), "HF_DATASETS_OFFLINE=1 is set", task_data.EXAMPLE_TASK):
        assert part in said[0], (part, said[0])
    assert "Traceback" not in out


def test_a_hub_that_does_not_answer_counts_as_no_network(env: pytest.MonkeyPatch, tmp_path: Path, closed_port: int,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """No offline switch (the user's case): the Hub's host (here HF_ENDPOINT's) refuses the connection."""
    env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port}")
    code, out = dry_run(tmp_path, capsys, "[mmlu]")
    assert code == 2, out
    assert f"127.0.0.1:{closed_port} cannot be reached" in out and "read 'cais/mmlu'" in out, out
    assert "tasks 'mmlu_abstract_algebra', 'mmlu_anatomy' and 55 more" in out  # the group's 57 subjects


def test_a_cached_dataset_or_a_hub_in_reach_passes(env: pytest.MonkeyPatch, tmp_path: Path,
                                                   listening_port: int) -> None:
    """The check itself (the dry runs above show how deepy.py prints it)."""
    from megatron.evaluation.checks import data_problems

    # offline with a prepared copy where datasets looks for one: fine
    (tmp_path / "hf_cache" / "EleutherAI___lambada_openai" / "default" / "0.0.0" / "1a2b").mkdir(parents=True)
    env.setenv("HF_DATASETS_OFFLINE", "1")
    warnings: list[str] = []
    assert data_problems("eval_tasks", ["lambada_openai"], warnings) == [] and warnings == []
    # not told it is offline, datasets also reads a download in huggingface_hub's cache when the Hub is out of reach
    env.delenv("HF_DATASETS_OFFLINE")
    env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "hub" / "datasets--baber--piqa" / "snapshots" / "0a1b").mkdir(parents=True)
    assert data_problems("eval_tasks", ["piqa"], warnings) == [] and warnings == []
    env.setenv("HF_HUB_OFFLINE", "1")  # told it is offline, it does not look there
    assert "task 'piqa' reads 'baber/piqa'" in data_problems("eval_tasks", ["piqa"], warnings)[0]
    env.delenv("HF_HUB_OFFLINE")
    # online and not cached: the download is said before launch (deepy.py prints it as a warning), the run goes on
    env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listening_port}")
    assert data_problems("eval_tasks", ["hellaswag"], warnings) == []
    assert len(warnings) == 1 and "task 'hellaswag' reads 'Rowan/hellaswag'" in warnings[0], warnings
    assert "download it at the first evaluation" in warnings[0] and task_data.EXAMPLE_TASK in warnings[0]


def test_a_local_task_whose_data_file_is_missing_is_refused(env: pytest.MonkeyPatch, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    task = tmp_path / "tasks" / "mine.yaml"
    task.parent.mkdir()
    task.write_text("task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: tasks/mine.jsonl\n"
                    "test_split: test\noutput_type: loglikelihood\ndoc_to_text: '{{a}}'\ndoc_to_target: '{{b}}'\n")
    env.chdir(tmp_path)
    code, out = dry_run(tmp_path, capsys, f"[{task}]")
    assert code == 2 and "task 'mine' reads ['tasks/mine.jsonl'], which do not exist" in out, out
    from megatron.evaluation.checks import data_problems

    (tmp_path / "tasks" / "mine.jsonl").write_text('{"a": "x", "b": " y"}\n')
    assert data_problems("eval_tasks", [str(task)], []) == []


def test_task_names_resolve_as_the_harness_indexes_them() -> None:
    """lm-eval's own index of three task folders (tasks, a template ``include``, a group of groups of tagged
    tasks) against ours: every name to the same file and dataset."""
    from lm_eval.tasks._index import Kind, TaskIndex
    from lm_eval.tasks._yaml_loader import load_yaml

    root = task_data.harness_task_files()[0].parents[0]
    while root.name != "tasks":
        root = root.parent
    folders = [root / "lambada", root / "hellaswag", root / "mmlu" / "default"]
    index = TaskIndex.build(folders)
    ours = task_data.TaskFiles([f for folder in folders for f in task_data.yaml_files(folder)])
    tasks = [entry for entry in index.values() if entry.kind == Kind.TASK]
    assert len(tasks) >= 60
    for entry in tasks:
        [source] = ours.sources(entry.name) or [None]
        assert source is not None and source.yaml_path == entry.yaml_path, entry.name
        assert (source.dataset_path, source.dataset_name) == (entry.cfg["dataset_path"], entry.cfg.get("dataset_name"))
        assert task_data.read_task_yaml(entry.yaml_path) == load_yaml(entry.yaml_path, resolve_func=False)
    for entry in index.values():  # groups and tags: the same member tasks
        if entry.kind == Kind.TAG:
            assert {s.task for s in ours.sources(entry.name) or []} == entry.tags, entry.name
    mmlu = ours.sources("mmlu") or []
    assert len(mmlu) == 57 and {s.dataset_path for s in mmlu} == {"cais/mmlu"}


def test_cached_and_builders_as_datasets_decides(tmp_path: Path) -> None:
    """datasets' fallback for a Hub dataset it cannot reach, and the names it serves from its own code."""
    from datasets.load import CachedDatasetModuleFactory
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    assert set(_PACKAGED_DATASETS_MODULES) <= task_data.packaged_builders()
    for name in ("lambada_openai", "TriviaQA", "ARC-Challenge", "SQuADv2", "HellaSwag", "mmlu_pro"):
        assert task_data._snake(name) == camelcase_to_snakecase(name), name

    def datasets_finds(name: str) -> bool:
        try:
            CachedDatasetModuleFactory(name, cache_dir=str(tmp_path)).get_module()
        except FileNotFoundError:
            return False
        return True

    for name, made in (("EleutherAI/lambada_openai", "EleutherAI___lambada_openai/default/0.0.0/abc"),
                       ("Rowan/HellaSwag", "Rowan___hella_swag/default/0.0.0/abc"),
                       ("piqa", "piqa/plain_text"),  # not deep enough: no prepared copy
                       ("openai/gsm8k", None)):
        if made:
            (tmp_path / made).mkdir(parents=True)
        assert task_data.hub_cached(name, str(tmp_path)) == datasets_finds(name), name
