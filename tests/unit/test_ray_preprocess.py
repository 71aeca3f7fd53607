"""Tokenization on a real Ray cluster (``ray start --head`` on this machine, started once for the module) writes
the bytes the single-machine path writes: ``preprocess_data.py --ray ADDRESS`` against the tool without --ray,
and the ``train_urls`` cache built with ``tokenize_ray_address`` against the one built without it. Without
Ray installed, --ray and the key are refused by name."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer.char_level import CharLevelTokenizer
from ports import free_port
from tools.datasets import train_tokenizer

# Not imported here: Ray reads RAY_AUTH_MODE once, when the process first imports it, and the in-process tests
# below set it first (monkeypatch).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "datasets" / "preprocess_data.py"
# `ray start` enables token authentication; a driver that names the address must ask for it (Ray 2.60's
# worker.py connects with a token only when RAY_AUTH_MODE=token or the address is found automatically).
RAY_ENV = {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}


def _texts(n: int, seed: int) -> list[str]:
    """Documents of random words with unicode, an empty one and a whitespace-only one among them."""
    rng = random.Random(seed)
    words = ["alpha", "Grüße", "東京", "tokens", "ray", "shard", "🙂", "the", "of", "data", "x" * 12, "\t", "\n"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 400))) for _ in range(n)]
    texts[n // 3], texts[n // 2] = "", "   "
    return texts


def _jsonl(path: Path, texts: list[str]) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for t in texts:
            fh.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    return path


class Head:
    """A Ray head node with 2 CPUs on this machine, starting in the background (`ray start --head --block`)."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        with open(log, "w") as out:  # a file, not a pipe nobody drains while the node runs
            self.proc = subprocess.Popen(["ray", "start", "--head", "--block", f"--port={self.port}", "--num-cpus=2",
                                          "--include-dashboard=false", "--disable-usage-stats"],
                                         stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **RAY_ENV},
                                         start_new_session=True)

    def address(self) -> str:
        """Its address, once it has started (the tests do their single-machine work meanwhile)."""
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start --head did not start ({self.proc.poll()}):\n{self.log.read_text()}")
            time.sleep(0.1)
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes of its node on SIGTERM
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Head]:
    head = Head(tmp_path_factory.mktemp("ray") / "head.log")
    try:
        yield head
    finally:
        head.stop()


def _same_files(a: str, b: str) -> None:
    for ext in (".bin", ".idx"):
        assert Path(a + ext).read_bytes() == Path(b + ext).read_bytes(), f"{a}{ext} differs from {b}{ext}"


def test_preprocess_data_on_a_ray_cluster_writes_the_single_machine_bytes(cluster: Head, tmp_path: Path) -> None:
    texts = _texts(2200, seed=1)  # ~2.3 MB: three 1 MB chunks, so both actors work and the order matters
    corpus = _jsonl(tmp_path / "docs.jsonl", texts)
    train_tokenizer.save(train_tokenizer.train_bpe(texts[:200], vocab_size=400), tmp_path / "tok.json")
    common = ["--input", str(corpus), "--tokenizer-type", "HFTokenizer", "--vocab-file", str(tmp_path / "tok.json"),
              "--append-eod", "--quiet"]

    def tool(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(TOOL), *common, *extra], capture_output=True, text=True,
                              env={**os.environ, **RAY_ENV}, timeout=180)

    here = tool("--output-prefix", str(tmp_path / "here"), "--workers", "1")
    on_ray = tool("--output-prefix", str(tmp_path / "ray"), "--ray", cluster.address(), "--workers", "2")
    assert here.returncode == 0, here.stderr
    assert on_ray.returncode == 0, on_ray.stderr
    assert "2 Ray workers" in on_ray.stdout
    _same_files(str(tmp_path / "here_text_document"), str(tmp_path / "ray_text_document"))
    assert len(MMapIndexedDataset(str(tmp_path / "ray_text_document"))) == sum(1 for t in texts if t.strip())  # empty ones skipped


class PidRecordingTokenizer(CharLevelTokenizer):
    """Char-level ids; each batch it tokenizes leaves a file named for the process that did it."""

    def __init__(self, record_dir: Path) -> None:
        super().__init__()
        self.record_dir = record_dir

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        (self.record_dir / str(os.getpid())).touch()
        return super().tokenize_batch(texts)


def test_tokenize_ray_address_builds_the_url_cache_on_the_cluster(cluster: Head, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.data.build import build_datasets
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.run_config import data_run

    for name, value in RAY_ENV.items():
        monkeypatch.setenv(name, value)
    # lazy: Ray reads RAY_AUTH_MODE when first imported (set just above)
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import this test module
    _jsonl(tmp_path / "a.jsonl", _texts(700, seed=2))  # ~0.7M characters: one chunk
    _jsonl(tmp_path / "b.jsonl", _texts(1200, seed=3))  # ~1.3M characters: two chunks
    pids = tmp_path / "pids"
    pids.mkdir()
    tokenizer = PidRecordingTokenizer(pids)

    def cache(address: str | None) -> str:
        cache_dir = tmp_path / ("cache_ray" if address else "cache_here")
        config = NeoXArgs(seq_length=64, seed=1, train_batch_size=4, train_iters=5, eval_iters=0,
                          train_urls=[str(tmp_path / "{a,b}.jsonl")], cache_dir=str(cache_dir),
                          tokenize_ray_address=address)
        splits = build_datasets(data_run(config), tokenizer, tokenizer.vocab_size)
        assert splits.train is not None and len(splits.train) > 0
        (prefix,) = [str(p)[: -len(".idx")] for p in cache_dir.rglob("urls_*.idx")]
        return prefix

    here = cache(None)
    assert {int(p.name) for p in pids.iterdir()} == {os.getpid()}
    for p in pids.iterdir():
        p.unlink()
    on_ray = cache(cluster.address())
    workers = {int(p.name) for p in pids.iterdir()}
    assert os.getpid() not in workers and len(workers) == 2, workers  # tokenized by the cluster's 2 actors only
    _same_files(here, on_ray)
    docs = MMapIndexedDataset(on_ray)
    assert len(docs) == 1900 and docs[0][-1] == tokenizer.eod


def test_bad_input_on_ray_is_reported_at_its_line(cluster: Head, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.data.url_sources import materialize_urls
    from megatron.errors import DataError

    for name, value in RAY_ENV.items():
        monkeypatch.setenv(name, value)
    shard = tmp_path / "bad.jsonl"
    shard.write_text('{"text": "fine"}\n{"txt": "no text key"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"{shard}:2: expected a JSON object with a 'text' string"):
        materialize_urls([str(shard)], str(tmp_path / "cache"), CharLevelTokenizer(), ray_address=cluster.address())
    assert not list((tmp_path / "cache").rglob("*.idx"))


def test_ray_refused_by_name_when_not_installed(tmp_path: Path) -> None:
    from megatron.neox_arguments import config_from_mapping
    from megatron.neox_arguments.optional_packages import missing_package_problems
    from megatron.config_rules import RuleContext

    corpus = _jsonl(tmp_path / "docs.jsonl", ["one document"])
    hide_ray = ("import sys; sys.modules['ray'] = None; from tools.datasets.preprocess_data import cli; "
                "sys.argv[0] = 'preprocess_data.py'; cli()")
    proc = subprocess.run([sys.executable, "-c", hide_ray, "--input", str(corpus), "--output-prefix",
                           str(tmp_path / "out"), "--tokenizer-type", "CharLevelTokenizer", "--ray"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--ray spreads tokenization over a Ray cluster, but Ray is not installed" in proc.stderr
    assert "pip install 'ray==" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("out*"))

    args = config_from_mapping({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16,
                                "train_micro_batch_size_per_gpu": 2, "train_iters": 4, "lr": 1e-3,
                                "tokenizer_type": "CharLevelTokenizer", "train_urls": ["data/a.jsonl"],
                                "tokenize_ray_address": "local"}).args
    problems = missing_package_problems(RuleContext(args=args), find_spec=lambda name: None if name == "ray" else 1)
    assert len(problems) == 1 and "tokenize_ray_address" in problems[0] and "needs the 'ray' package" in problems[0]


def test_pack_matches_the_url_cache_layout() -> None:
    """The actors' concatenated ids + sizes are what one add_item per document writes."""
    from megatron.data.url_sources import _ray_setup, _ray_tokenize

    tok = CharLevelTokenizer()
    state = _ray_setup(tok, "text", np.uint16)
    tokens, sizes = _ray_tokenize(state, ("x.jsonl", 7, ['{"text": "ab"}\n', "\n", '{"text": ""}\n']))
    assert sizes.tolist() == [3, 1]
    assert tokens.tolist() == [*tok.tokenize("ab"), tok.eod, tok.eod] and tokens.dtype == np.uint16
