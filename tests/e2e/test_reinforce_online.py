"""GPT-NeoX's online REINFORCE end to end (issue 47): ``deepy.py train.py`` on one rank trains ``train_impl: reinforce``
on rollouts from a stub rollout server this test runs (GPT-NeoX's protocol, fixed rollouts), and hands its weights to
a weight client this test runs (``serve_model_weights``) before the first step. The first step's logged loss equals
GPT-NeoX's formula computed here from those weights on the first rollouts (with the leave-one-out baseline; the KL
term is 0 at the start, when the frozen reference equals the policy - so the reference must be the starting
weights), and the server was asked for the train split. At model_parallel_size 2 (two ranks, one data shard) the
first loss is GPT-NeoX's formula on the same starting weights (the initialisation is the same full weights on every
layout) and the server gets one request: the shard's first rank fetches and hands the rollouts to the other."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ports import free_port

from megatron import torch_internals

REPO = Path(__file__).resolve().parents[2]
PREFIX = [40, 41, 42]
ROLLOUTS: list[dict[str, Any]] = [{"prefix": PREFIX, "completions": [[50, 51, 52, 53], [60, 61]], "rewards": [1.0, -0.5]},
            {"prefix": [44], "completions": [[45, 46], [47]], "rewards": [0.25, 0.75]}]
SEQ = 12


def rollout_server(sock: socket.socket, requests: list[bytes], rollouts: list[dict[str, Any]] = ROLLOUTS) -> None:
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        with conn:
            requests.append(conn.recv(4096))
            conn.sendall(pickle.dumps(rollouts))


def weight_client(port: int, weights: dict[str, torch.Tensor], deadline: float) -> None:
    """Connect once the trainer listens; copy each tensor as it is described (the run trains on right after)."""
    while True:
        try:
            conn = socket.create_connection(("localhost", port))
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
    with conn:
        while True:
            buffer = b""
            while True:
                buffer += conn.recv(1 << 16)
                try:
                    message = pickle.loads(buffer)
                    break
                except (pickle.UnpicklingError, EOFError):
                    continue
            storage = torch_internals.open_shared_cpu_storage(message["manager_handle"], message["storage_handle"],
                                                              message["storage_size_bytes"])
            tensor = torch.empty(0, dtype=message["dtype"]).set_(storage, message["tensor_offset"],
                                                                 message["tensor_size"], message["tensor_stride"])
            weights[message["state_dict_key"]] = tensor.clone()
            conn.sendall(b"ok")
            if message["end"]:
                return


def neox_first_loss(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> float:
    """GPT-NeoX's REINFORCE loss of the first micro-batch (training.py:820-860 @ea7aefd8), written out here, on a model
    holding the served weights."""
    from megatron.model import GPTModel
    from megatron.neox_arguments.run_config import RunConfig
    from megatron.tokenizer import build_tokenizer

    run = RunConfig.from_mapping({k: v for k, v in config.items() if k not in ("num_gpus", "master_port")})
    vocab = run.tokenizer.padded(build_tokenizer(run.tokenizer).vocab_size, 1)
    model = GPTModel(run.model.for_tokenizer(vocab))
    state = {key.removeprefix("module."): value for key, value in weights.items()}
    model.load_state_dict(state)
    model.eval()
    rollout = ROLLOUTS[0]
    texts = [PREFIX + c + [0] * (SEQ + 1 - len(PREFIX) - len(c)) for c in rollout["completions"]]
    labels = [[-100] * len(PREFIX) + c + [-100] * (SEQ + 1 - len(PREFIX) - len(c)) for c in rollout["completions"]]
    r = rollout["rewards"]
    rewards = torch.tensor([[r[0] - r[1]], [r[1] - r[0]]])  # leave-one-out: minus the mean of the other one
    tokens, label = torch.tensor(texts)[:, :-1], torch.tensor(labels)[:, 1:]
    loss_mask = (label >= 0).float()
    with torch.no_grad():
        logp = torch.log(torch.softmax(model(tokens).double(), dim=-1))
    per_token = logp.gather(2, label.clamp(min=0).unsqueeze(2)).squeeze(2)
    loss = (-per_token * rewards * loss_mask).sum(-1) / loss_mask.sum()
    return float(loss.mean())


def config_for(tmp_path: Path, data_port: int) -> dict[str, Any]:
    return {
        "num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "seq_length": SEQ, "max_position_embeddings": SEQ,
        "pos_emb": "rotary", "norm": "layernorm", "tokenizer_type": "CharLevelTokenizer", "precision": "fp32",
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "train_iters": 2, "eval_iters": 0,
        "log_interval": 1, "seed": 7, "num_gpus": 1, "master_port": free_port(), "log_dir": str(tmp_path / "logs"),
        "train_impl": "reinforce", "dataset_impl": "online", "online_dataserver_ips": ["127.0.0.1"],
        "online_dataserver_ports": [data_port],  # data-parallel rank 0 reads entry 0
        "reinforce_leave_one_out": True, "kl_impl": "full", "kl_div_beta": 0.5, "fp32_reinforce": True,
    }


def train(tmp_path: Path, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Run deepy.py train.py on ``config``; its metrics rows."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    log = tmp_path / "deepy.log"
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, "deepy.py", "train.py", str(path)], cwd=REPO, stdout=out,
                              stderr=subprocess.STDOUT, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, log.read_text()[-4000:]
    return [json.loads(line) for line in next((tmp_path / "logs").rglob("metrics.jsonl")).read_text().splitlines()]


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, torch.Tensor],
                                                                      list[dict[str, Any]], list[bytes]]:
    """The one-rank run: its config, the starting weights its weight server handed out, its metrics rows and the
    requests its rollout server got."""
    tmp_path = tmp_path_factory.mktemp("one_rank")
    data_port, weight_port = free_port(), free_port()
    config = {**config_for(tmp_path, data_port), "serve_model_weights": True, "weight_server_port": weight_port}
    requests: list[bytes] = []
    sock = socket.create_server(("127.0.0.1", data_port))
    threading.Thread(target=rollout_server, args=(sock, requests), daemon=True).start()
    weights: dict[str, torch.Tensor] = {}
    client = threading.Thread(target=weight_client, args=(weight_port, weights, time.monotonic() + 300), daemon=True)
    client.start()
    try:
        rows = train(tmp_path, config)
    finally:
        sock.close()
    client.join(timeout=10)
    assert weights, "the trainer served no weights"
    return config, weights, rows, requests


def test_reinforce_trains_on_served_rollouts_and_serves_its_weights(one_rank_run: Any) -> None:
    config, weights, rows, requests = one_rank_run
    first = next(row for row in rows if row.get("iteration") == 1 and "train/lm_loss" in row)
    assert requests and set(requests) == {b"train"}  # eval_iters 0: only the train split was asked for
    assert first["train/lm_loss"] == pytest.approx(neox_first_loss(config, weights), rel=1e-5, abs=1e-6)
    assert first["train/kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the starting policy
    assert first["train/reward"] == pytest.approx(0.25)  # the raw rewards' mean


def test_tensor_parallel_ranks_share_one_fetch(one_rank_run: Any, tmp_path: Path) -> None:
    config, weights, _, _ = one_rank_run
    data_port = free_port()
    # enough rollouts that neither rank's read-ahead (num_workers 2) needs a second request: 16 samples, at most 14 read
    requests: list[bytes] = []
    sock = socket.create_server(("127.0.0.1", data_port))
    threading.Thread(target=rollout_server, args=(sock, requests, ROLLOUTS * 4), daemon=True).start()
    try:
        rows = train(tmp_path, {**config_for(tmp_path, data_port), "num_gpus": 2, "model_parallel_size": 2})
    finally:
        sock.close()
    first = next(row for row in rows if row.get("iteration") == 1 and "train/lm_loss" in row)
    assert requests == [b"train"]  # one data shard: one request (each rank fetching would make two)
    assert first["train/lm_loss"] == pytest.approx(neox_first_loss(config, weights), rel=1e-5, abs=1e-6)
    assert first["train/kl"] == pytest.approx(0.0, abs=1e-6)
