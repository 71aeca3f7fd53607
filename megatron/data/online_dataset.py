"""``dataset_impl: online``: rollouts fetched from rollout servers while training runs, GPT-NeoX's protocol and
baselines (megatron/data/online_dataset.py @ea7aefd8).

**Protocol.** When its buffer is empty, a data-parallel rank opens a TCP connection to its server
(``online_dataserver_ips``/``_ports``: one value for every rank, or entry ``r`` of a list for data-parallel rank
``r``), sends the split's name (``train``, ``valid`` or ``test``, UTF-8, nothing else), reads until the server closes
the connection and unpickles a list of rollouts, each a dict ``{"prefix": [token ids], "completions": [[token ids],
...], "rewards": [float, ...]}`` (one reward per completion). Every completion becomes one sample, in order.

**Baselines** (subtracted from the rewards as a rollout arrives; the raw rewards are kept for the metrics):
``reinforce_leave_one_out``: each completion's reward minus the mean of the other completions' rewards of its prompt;
otherwise the mean of the last 100 rollouts' mean rewards, taken before this rollout joins them (0 for the first).

**Samples.** ``text`` = prefix + completion, ``label`` = -100 over the prefix then the completion (the loss counts
the completion's tokens only), both padded to ``seq_length + 1`` with token 0 / label -100, ``reward`` and
``raw_reward`` as ``[1]`` float32. A rollout longer than ``seq_length + 1`` tokens is refused by name (GPT-NeoX
passes it on unpadded, and the batch then fails to stack or runs past ``seq_length``).

**Parallel ranks.** The ranks that read one data shard (its tensor- and context-parallel ranks) see the same rollouts:
the shard's first rank fetches them and broadcasts the list to the others over a gloo group each split's dataset
makes for itself (GPT-NeoX reads data on tensor-parallel rank 0 and broadcasts the batch, training.py get_batch ->
mpu.broadcast_data @ea7aefd8), so a server gets one request per data shard, not one per rank.

The index a sample is asked for is not read: the samples come in the order the server sends them, and a resumed run
asks the server for new ones (its position is the server's business, as in GPT-NeoX).
"""

from __future__ import annotations

import logging
import pickle
import socket
from typing import Any

import numpy as np

from megatron import mpu
from megatron.errors import DataError

log = logging.getLogger("deepy")

REWARD_WINDOW = 100
"""Rollouts whose mean rewards make the running-mean baseline (GPT-NeoX's ``reward_buffer``)."""


def leave_one_out(rewards: list[float]) -> list[float]:
    """Each reward minus the mean of the others (a single completion has no others: NaN, as numpy's mean of none)."""
    return [r - float(np.mean([o for j, o in enumerate(rewards) if j != i])) for i, r in enumerate(rewards)]


def for_rank(value: Any, rank: int) -> Any:
    """``value`` itself, or entry ``rank`` of a list (GPT-NeoX: the same port for every rank when one is given)."""
    return value[rank] if isinstance(value, list) else value


def fetch_rollouts(host: str, port: int, split: str) -> list[dict[str, Any]]:
    """One request: the split's name out, the pickled rollouts back until the server closes."""
    with socket.create_connection((host, port)) as conn:
        conn.sendall(split.encode())
        chunks = []
        while chunk := conn.recv(4096):
            chunks.append(chunk)
    rollouts = pickle.loads(b"".join(chunks))  # the rollout server is the run's own (GPT-NeoX's protocol)
    if not isinstance(rollouts, list):
        raise DataError(f"the rollout server at {host}:{port} sent {type(rollouts).__name__}, not a list of rollouts")
    return rollouts


class OnlineDataset:
    """This data-parallel rank's rollouts for one split (module docstring)."""

    wraps = True  # any index: it is not read

    def __init__(self, num_samples: int, seq_length: int, split: str, ips: str | list[str], ports: int | list[int],
                 leave_one_out: bool = False) -> None:
        self.num_samples, self.seq_length, self.split = num_samples, seq_length, split
        self.ips, self.ports, self.leave_one_out = ips, ports, leave_one_out
        self.reward_buffer: list[float] = []
        self.samples: list[tuple[list[int], list[int], float, float]] = []
        # built on every rank, in the same order (build_datasets): the group of the ranks reading this data shard
        self.group, self.fetcher = mpu.new_data_shard_group() if mpu.model_parallel_is_initialized() else (None, 0)

    def __len__(self) -> int:
        return self.num_samples

    def server(self) -> tuple[str, int]:
        rank = mpu.get_data_shard_rank()
        return str(for_rank(self.ips, rank)), int(for_rank(self.ports, rank))

    def receive(self, host: str, port: int) -> list[dict[str, Any]]:
        """The next rollouts: fetched here, or on the shard's first rank and broadcast (module docstring). Every
        rank of the shard refills at the same sample, so they all enter the broadcast, in the same order."""
        if self.group is None:
            return fetch_rollouts(host, port, self.split)
        import torch.distributed as dist  # lazy: deepy.py's checks import this module and must not load torch

        box: list[Any] = [None]
        failure: Exception | None = None
        if dist.get_rank() == self.fetcher:
            try:
                box[0] = fetch_rollouts(host, port, self.split)
            except Exception as err:  # the others are waiting in the broadcast: they are told, then it is raised
                failure, box[0] = err, f"{type(err).__name__}: {err}"
        dist.broadcast_object_list(box, src=self.fetcher, group=self.group)
        if failure is not None:
            raise failure
        if isinstance(box[0], str):
            raise DataError(f"rank {self.fetcher}, which fetches this data shard's {self.split} rollouts from "
                            f"{host}:{port}, failed: {box[0]}")
        rollouts: list[dict[str, Any]] = box[0]
        return rollouts

    def refill(self) -> None:
        host, port = self.server()
        rollouts = self.receive(host, port)
        log.debug("online data: %d rollouts from %s:%d for %s", len(rollouts), host, port, self.split)
        for rollout in rollouts:
            raw = [float(r) for r in rollout["rewards"]]
            if self.leave_one_out:
                rewards = leave_one_out(raw)
            else:
                baseline = float(np.mean(self.reward_buffer)) if self.reward_buffer else 0.0
                self.reward_buffer.append(float(np.mean(raw)))
                if len(self.reward_buffer) > REWARD_WINDOW:
                    self.reward_buffer.pop(0)
                rewards = [r - baseline for r in raw]
            for completion, reward, raw_reward in zip(rollout["completions"], rewards, raw):
                self.samples.append((list(rollout["prefix"]), list(completion), reward, raw_reward))
        if not self.samples:
            raise DataError(f"the rollout server at {host}:{port} sent no completions for the {self.split} split")

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not self.samples:
            self.refill()
        prefix, completion, reward, raw_reward = self.samples.pop(0)
        text = prefix + completion
        label = [-100] * len(prefix) + completion
        width = self.seq_length + 1
        if len(text) > width:
            raise DataError(f"a {self.split} rollout holds {len(text)} tokens (prefix {len(prefix)} + completion "
                            f"{len(completion)}), more than seq_length + 1 = {width}: raise seq_length or have the "
                            "rollout server cut its completions")
        return {"text": np.array(text + [0] * (width - len(text)), dtype=np.int64),
                "label": np.array(label + [-100] * (width - len(label)), dtype=np.int64),
                "reward": np.array([reward], dtype=np.float32),
                "raw_reward": np.array([raw_reward], dtype=np.float32)}
