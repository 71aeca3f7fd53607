"""GPT-NeoX's online REINFORCE (issue 47): the loss and each KL estimator against GPT-NeoX's formulas written out here
(megatron/training.py:796-860 @ea7aefd8, independent of ``megatron/objectives/reinforce.py``), the online dataset's
protocol and baselines against a stub rollout server and a direct computation (megatron/data/online_dataset.py), the
weight server's protocol read back by a client written here (megatron/model/weight_server.py), and the refusals."""

from __future__ import annotations

import pickle
import socket
import threading
from typing import Any

import numpy as np
import pytest
import torch
from ports import free_port

from megatron import torch_internals
from megatron.config_rules import RuleContext
from megatron.data.online_dataset import OnlineDataset
from megatron.neox_arguments import NeoXArgs
from megatron.objectives import build_objective
from megatron.objectives.config import reference_kind
from megatron.objectives.reinforce_checks import reinforce_layout, reinforce_reads_online_rollouts, weight_server_layout
from megatron.training.weight_server import serve_once

ROWS, SEQ, VOCAB = 3, 6, 11


def _args(**keys: Any) -> NeoXArgs:
    return NeoXArgs(**{"train_impl": "reinforce", "dataset_impl": "online", **keys})


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Policy logits, reference logits, labels (a masked prompt of 1-3 tokens per row) and rewards ``[n, 1]``."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, SEQ, VOCAB, generator=g)
    ref_logits = logits + 0.5 * torch.randn(ROWS, SEQ, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    for row, prompt in enumerate((1, 2, 3)):
        labels[row, :prompt] = -100
    rewards = torch.tensor([[0.7], [-1.3], [0.2]])
    return logits, ref_logits, labels, rewards


def neox_loss(logits: torch.Tensor, ref_logits: torch.Tensor | None, labels: torch.Tensor, rewards: torch.Tensor,
              kl_impl: str, beta: float) -> torch.Tensor:
    """GPT-NeoX's forward_step for train_impl reinforce, written out from its code (fp32_reinforce)."""
    loss_mask = (labels >= 0).float()
    labels = torch.where(labels >= 0, labels, torch.zeros_like(labels))  # _get_batch: masked labels read token 0
    logp = torch.log(torch.softmax(logits.double(), dim=-1))  # [n, s, v], in float64 as the independent value
    per_token_logp = logp.gather(2, labels.unsqueeze(2)).squeeze(2)
    if ref_logits is None:
        loss = -(rewards * per_token_logp)
    else:
        ref_logp = torch.log(torch.softmax(ref_logits.double(), dim=-1))
        ref_per_token = ref_logp.gather(2, labels.unsqueeze(2)).squeeze(2)
        if kl_impl == "full":
            kl = (logp.exp() * (logp - ref_logp)).sum(-1)  # KL(pi || ref) at every position
        else:
            d = per_token_logp - ref_per_token
            kl = {"abs": d.abs(), "mse": 0.5 * d * d, "kl": d}[kl_impl]
        loss = (-per_token_logp * rewards) + beta * kl
    loss = (loss * loss_mask).sum(-1) / loss_mask.sum()
    return loss.mean()


@pytest.mark.parametrize("kl_impl", ["abs", "mse", "kl", "full"])
def test_loss_and_each_kl_estimator_match_gpt_neox(kl_impl: str) -> None:
    logits, ref_logits, labels, rewards = _batch()
    objective = build_objective(_args(kl_impl=kl_impl, kl_div_beta=0.3))
    reference = objective.reference_logps(ref_logits, labels)
    assert reference.shape == ((ROWS, SEQ, VOCAB) if kl_impl == "full" else (ROWS, SEQ))
    got, stats = objective.loss_sum(logits, labels, (rewards, rewards + 1), reference)
    want = neox_loss(logits, ref_logits, labels, rewards, kl_impl, 0.3)
    assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    # the penalty changes the loss (an estimator that returned 0 would not pass)
    assert want.item() != pytest.approx(neox_loss(logits, None, labels, rewards, kl_impl, 0.0).item(), rel=1e-3)
    assert stats["reward"][0].item() / stats["reward"][1].item() == pytest.approx(float((rewards + 1).mean()))


def test_without_kl_beta_no_reference_and_no_penalty() -> None:
    """GPT-NeoX builds the reference model only with kl_div_beta > 0 (training.py:1164); the loss is then
    -reward * logp alone."""
    logits, _, labels, rewards = _batch(1)
    args = _args(kl_div_beta=0.0)
    assert reference_kind(args) == "none" and reference_kind(_args()) == "frozen_copy"
    objective = build_objective(args)
    got, _ = objective.loss_sum(logits, labels, (rewards, rewards), torch.zeros(ROWS))
    assert got.item() == pytest.approx(neox_loss(logits, None, labels, rewards, "mse", 0.0).item(), rel=1e-5)


def test_fp32_reinforce_false_takes_the_log_softmax_in_the_model_precision() -> None:
    logits, _, labels, rewards = _batch(2)
    half = logits.bfloat16()
    mask = (labels >= 0).float()
    safe = labels.clamp(min=0).unsqueeze(2)
    low = half.log_softmax(-1).gather(2, safe).squeeze(2)  # GPT-NeoX's get_logp without the fp32 cast
    want = ((-(rewards * low)) * mask).sum(-1).div(mask.sum()).mean()
    got, _ = build_objective(_args(fp32_reinforce=False, kl_div_beta=0.0)).loss_sum(half, labels, (rewards, rewards),
                                                                                    torch.zeros(ROWS))
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    fp32, _ = build_objective(_args(kl_div_beta=0.0)).loss_sum(half, labels, (rewards, rewards), torch.zeros(ROWS))
    assert fp32.item() != got.item()  # the cast matters in bf16


# ---- the online dataset against a stub rollout server ------------------------------------------------------------
ROLLOUTS: list[dict[str, Any]] = [{"prefix": [5, 6], "completions": [[7, 8, 9], [10]], "rewards": [1.0, 0.0]},
            {"prefix": [3], "completions": [[4], [4, 4], [2]], "rewards": [2.0, 5.0, -1.0]}]


class RolloutServer:
    """Answers every connection with ``ROLLOUTS`` (GPT-NeoX's online_data_example_llama3.py: read the split's name,
    send the pickled list, close), recording the requests."""

    def __init__(self) -> None:
        self.port = free_port()
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("localhost", self.port))
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.requests.append(conn.recv(4096))
                conn.sendall(pickle.dumps(ROLLOUTS))


@pytest.fixture(scope="module")
def rollout_server() -> Any:
    server = RolloutServer()
    yield server
    server.sock.close()


def test_online_dataset_leave_one_out(rollout_server: RolloutServer) -> None:
    ds = OnlineDataset(10, 6, "valid", "localhost", rollout_server.port, leave_one_out=True)
    before = len(rollout_server.requests)
    samples = [ds[0] for _ in range(5)]
    assert rollout_server.requests[before:] == [b"valid"]  # one request, the split's name
    rewards = [s["reward"][0] for s in samples]
    raws = [float(s["raw_reward"][0]) for s in samples]
    assert raws == [1.0, 0.0, 2.0, 5.0, -1.0]
    assert rewards == pytest.approx([1.0 - 0.0, 0.0 - 1.0, 2.0 - 2.0, 5.0 - 0.5, -1.0 - 3.5])
    first = samples[0]
    assert first["text"].tolist() == [5, 6, 7, 8, 9, 0, 0]  # seq_length + 1, padded with 0
    assert first["label"].tolist() == [-100, -100, 7, 8, 9, -100, -100]
    assert samples[1]["text"].tolist() == [5, 6, 10, 0, 0, 0, 0]
    ds[0]
    assert len(rollout_server.requests) == before + 2  # the buffer ran empty: fetched again


def test_online_dataset_running_mean_baseline(rollout_server: RolloutServer) -> None:
    ds = OnlineDataset(10, 6, "train", "localhost", [rollout_server.port], leave_one_out=False)
    rewards = [float(ds[i]["reward"][0]) for i in range(10)]
    # rollout means 0.5, 2.0, 0.5, 2.0: each baselined by the mean of the earlier ones (0 for the first)
    baselines = [0.0, 0.5, float(np.mean([0.5, 2.0])), float(np.mean([0.5, 2.0, 0.5]))]
    want = [1.0 - baselines[0], 0.0 - baselines[0], 2.0 - baselines[1], 5.0 - baselines[1], -1.0 - baselines[1],
            1.0 - baselines[2], 0.0 - baselines[2], 2.0 - baselines[3], 5.0 - baselines[3], -1.0 - baselines[3]]
    assert rewards == pytest.approx(want)


def test_online_dataset_refuses_a_rollout_longer_than_the_sequence(rollout_server: RolloutServer) -> None:
    from megatron.errors import DataError

    with pytest.raises(DataError, match="seq_length"):
        OnlineDataset(1, 3, "train", "localhost", rollout_server.port)[0]


# ---- the weight server, read back by a client of its protocol ------------------------------------------------------
def read_weights(port: int, received: dict[str, torch.Tensor]) -> None:
    """A generation server's side: connect, and for each message open the tensor where it lives and answer."""
    for _ in range(200):
        try:
            conn = socket.create_connection(("localhost", port))
            break
        except ConnectionRefusedError:
            threading.Event().wait(0.05)
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
            assert message["storage_device"] == "cpu"
            storage = torch_internals.open_shared_cpu_storage(message["manager_handle"], message["storage_handle"],
                                                              message["storage_size_bytes"])
            received[message["state_dict_key"]] = torch.empty(0, dtype=message["dtype"]).set_(
                storage, message["tensor_offset"], message["tensor_size"], message["tensor_stride"])
            conn.sendall(b"ok")
            if message["end"]:
                return


def test_weight_server_hands_out_the_live_weights() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2, bias=False))
    port, received = free_port(), dict[str, torch.Tensor]()
    client = threading.Thread(target=read_weights, args=(port, received))
    client.start()
    serve_once(model, port)
    client.join(timeout=30)
    want = model.state_dict()
    assert list(received) == list(want)
    for key, tensor in want.items():
        assert torch.equal(received[key], tensor), key
    first = model[0]
    assert isinstance(first, torch.nn.Linear)
    with torch.no_grad():  # an optimizer's in-place update: the client sees it without being sent anything
        first.weight.add_(1.0)
    assert torch.equal(received["0.weight"], first.weight)


# ---- refusals ------------------------------------------------------------------------------------------------------
def _problems(rule: Any, world_size: int = 1, **keys: Any) -> list[str]:
    return rule(RuleContext(args=NeoXArgs(**keys), world_size=world_size))


def test_refusals_name_the_keys() -> None:
    (message,) = _problems(reinforce_reads_online_rollouts, train_impl="reinforce")
    assert "train_impl='reinforce'" in message and "dataset_impl: online" in message
    (message,) = _problems(reinforce_reads_online_rollouts, dataset_impl="online")
    assert "dataset_impl='online'" in message
    assert _problems(reinforce_reads_online_rollouts, kl_impl="abs")[0].startswith("kl_impl='abs'")
    (message,) = _problems(reinforce_layout, train_impl="reinforce", dataset_impl="online", pipe_parallel_size=1)
    assert "pipe_parallel_size=1" in message
    # the tensor-parallel ranks of a data shard share its rollouts (tests/e2e/test_reinforce_online.py)
    assert _problems(reinforce_layout, train_impl="reinforce", dataset_impl="online", model_parallel_size=2,
                     world_size=2) == []
    (message,) = _problems(reinforce_layout, train_impl="reinforce", dataset_impl="online", context_parallel_size=2,
                           world_size=2)
    assert "context_parallel_size=2" in message
    (message,) = _problems(reinforce_layout, train_impl="reinforce", dataset_impl="online",
                           online_dataserver_ports=[10000], world_size=2)
    assert "online_dataserver_ports=[10000]" in message
    assert _problems(reinforce_layout, train_impl="reinforce", dataset_impl="online", world_size=2) == []
    (message,) = _problems(weight_server_layout, serve_model_weights=True, zero_stage=3)
    assert "ZeRO stage 3" in message
    assert _problems(weight_server_layout, weight_server_port=7000)[0].startswith("weight_server_port=7000")
    assert _problems(weight_server_layout, serve_model_weights=True, weight_server_port=[7000, 7001],
                     world_size=2) == []
