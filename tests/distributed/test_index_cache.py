"""Index cache under a real race: two processes ask for the same index at the same moment."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np

from megatron.data.index_cache import load_arrays, load_or_build, save_arrays


def _worker(cache: str, log: str, barrier, results) -> None:  # type: ignore[no-untyped-def]
    def build() -> dict[str, np.ndarray]:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # a slow build widens the race window
        return {"a": np.arange(1000, dtype=np.int64), "b": np.ones((3, 2), dtype=np.float32)}

    barrier.wait()
    arrays = load_or_build(cache, build, timeout_s=60)
    results.put((os.getpid(), int(arrays["a"].sum()), arrays["b"].shape))


def test_two_processes_build_once(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    cache, log = str(tmp_path / "idx" / "x.deepyidx"), str(tmp_path / "builds.log")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(cache, log, barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    got = [results.get(timeout=5) for _ in range(2)]
    assert len({g[0] for g in got}) == 2
    assert all(g[1:] == (499500, (3, 2)) for g in got)
    assert len(Path(log).read_text().split()) == 1  # built exactly once
    assert not list(Path(cache).parent.glob("*.tmp"))


def test_roundtrip_and_atomic_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "c.deepyidx"
    save_arrays(path, {"x": np.arange(5, dtype=np.int16), "empty": np.zeros((0, 2), np.int64)})
    out = load_arrays(path)
    assert out["x"].tolist() == [0, 1, 2, 3, 4] and out["x"].dtype == np.int16
    assert out["empty"].shape == (0, 2)
    save_arrays(path, {"x": np.arange(3, dtype=np.int64)})
    assert load_arrays(path)["x"].tolist() == [0, 1, 2]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
