"""The post-training losses on tiny tensors: each against a direct computation written here, and
against TRL's own trainers (``DPOTrainer``, ``KTOTrainer``, ``RewardTrainer``) driven with a stub model
whose logits we also feed to ours - an implementation not written by the same hand."""

from __future__ import annotations

import collections
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron.errors import ConfigError, DataError
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.objectives import build_objective, dpo_losses, kto_losses, lm_loss_sum, rm_losses
from megatron.objectives.base import MetricSums, means_from_vector, micro_batch_denominator
from megatron.objectives.kto import mismatched_rows
from megatron.objectives.logprobs import sequence_logps, vocab_parallel_logsumexp
from megatron.objectives.rm import score_positions

V = 13  # vocabulary of the stub models


def _objective(train_impl: str, **kw: object):  # noqa: ANN202
    return build_objective(NeoXArgs(train_impl=train_impl, **kw), eod_token=0)  # type: ignore[arg-type]


def _targets(batch, reference: torch.Tensor | None = None, denominator: float = 1.0):  # noqa: ANN001, ANN202
    if reference is not None:
        batch = batch.__class__(**{**batch.__dict__, "reference": reference})
    return batch.targets(denominator)


# ---------------------------------------------------------------- stub HF model for TRL
class _Accelerator:
    device = torch.device("cpu")

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_for_metrics(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _TokenTable(torch.nn.Module):
    """logits at position t depend on token t only, so ours (inputs text[:, :-1]) and TRL's (all of
    text, then drop the last position) see identical logits."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(V, V)
        with torch.no_grad():
            self.table.weight.copy_(torch.randn(V, V, generator=torch.Generator().manual_seed(7)) * 2)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **_: object) -> object:
        logits = self.table(input_ids)
        if labels is None:  # sequence-classification form for the reward model: one score per row
            return types.SimpleNamespace(logits=logits[:, -1, :1])
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        target = labels[:, 1:]
        counted = target != -100
        per_token = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * counted
        return types.SimpleNamespace(log_probs=per_token, entropy=-(logp.exp() * logp).sum(-1),
                                     mean_logits=logits[:, :-1].mean(-1), is_top1=logp.argmax(-1) == target)


def _trl(cls: type, **attrs: object) -> object:
    trainer = cls.__new__(cls)  # no __init__: only the loss code and the metrics it records
    trainer.__dict__.update(accelerator=_Accelerator(), aux_loss_enabled=False, _tp_size=1, _total_train_tokens=0,
                            _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
                            **attrs)
    return trainer


def _rows(m: int, length: int, prompt: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows and completion masks (prompt positions 0, completion 1; some rows end early)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (m, length), generator=g)
    mask = torch.zeros(m, length, dtype=torch.long)
    mask[:, prompt:] = 1
    mask[0, length - 2 :] = 0  # a shorter response (padding at its end)
    return ids, mask


# ---------------------------------------------------------------- language modelling / SFT
def test_lm_loss_counts_only_unmasked_tokens_and_z_loss() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, V, generator=g)
    labels = torch.randint(0, V, (2, 5), generator=g)
    labels[0, :2] = -100
    labels[1, 4] = -100
    counted = labels >= 0
    direct = F.cross_entropy(logits[counted], labels[counted], reduction="sum")
    total, z_term = lm_loss_sum(logits, labels)
    assert torch.allclose(total, direct) and float(z_term) == 0.0
    # changing a masked target changes nothing
    other = labels.clone()
    other[0, 0] = 3
    other[0, 0] = -100
    assert torch.equal(lm_loss_sum(logits, other)[0], total)
    z = 1e-2
    total_z, z_term = lm_loss_sum(logits, labels, z)
    want_z = z * torch.logsumexp(logits, dim=-1)[counted].square().sum()
    assert torch.allclose(z_term, want_z) and torch.allclose(total_z, direct + want_z)
    assert torch.allclose(vocab_parallel_logsumexp(logits), torch.logsumexp(logits, dim=-1))


def test_lm_prepare_masks_labels_and_eod() -> None:
    obj = _objective("normal", eod_mask_loss=True)
    sample = {"text": torch.tensor([[5, 6, 0, 7, 8]]), "label": torch.tensor([[5, -100, 0, 7, 8]])}
    b = obj.prepare(sample)
    assert b.inputs.tolist() == [[5, 6, 0, 7]]
    assert b.labels.tolist() == [[-100, -100, 7, 8]]  # label -100 and the eod target are not counted
    assert b.units == 2.0
    assert _objective("normal").prepare(sample).labels.tolist() == [[-100, 0, 7, 8]]  # eod_mask_loss off


def test_global_token_mean_over_unequal_micro_batches() -> None:
    """The step loss is sum over all counted tokens / their number, not a mean of micro-batch means."""
    obj = _objective("normal")
    g = torch.Generator().manual_seed(1)
    texts = [torch.randint(1, V, (2, 6), generator=g) for _ in range(2)]
    labels = [t.clone() for t in texts]
    labels[0][:, :4] = -100  # micro-batch 0 counts 2 tokens per row, micro-batch 1 counts 5
    samples = [{"text": t, "label": lab} for t, lab in zip(texts, labels)]
    batches = [obj.prepare(s) for s in samples]
    units = sum(b.units for b in batches)
    denominator = micro_batch_denominator(units, micro_batches=2, dp_size=1)
    logits = [torch.randn(2, 5, V, generator=g) for _ in range(2)]
    per_mb = [obj.loss(x, b.targets(denominator)) for x, b in zip(logits, batches)]
    step = torch.stack(per_mb).mean()  # what DeepSpeed's accumulation does
    all_logits = torch.cat([x.reshape(-1, V) for x in logits])
    all_labels = torch.cat([b.labels.reshape(-1) for b in batches])
    want = F.cross_entropy(all_logits, all_labels, ignore_index=-100)
    assert torch.allclose(step, want)
    mean_of_means = torch.stack([F.cross_entropy(x.reshape(-1, V), b.labels.reshape(-1)) for x, b in zip(logits, batches)]).mean()
    assert not torch.allclose(step, mean_of_means)
    # unmasked equal micro-batches: the denominator is exactly the micro-batch's token count
    assert micro_batch_denominator(8 * 32, micro_batches=2, dp_size=2) == 2 * 32


# ---------------------------------------------------------------- DPO
def test_dpo_losses_direct() -> None:
    pc, pr = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    rc, rr = torch.tensor([-3.5, -4.0]), torch.tensor([-3.5, -3.0])
    for beta in (0.1, 0.5):
        losses, cr, rj = dpo_losses(pc, pr, rc, rr, beta)
        want = [-math.log(1 / (1 + math.exp(-beta * ((a - b) - (c - d))))) for a, b, c, d in zip(pc, pr, rc, rr)]
        assert losses.tolist() == pytest.approx(want, rel=1e-6)
        assert cr.tolist() == pytest.approx([beta * 0.5, beta * -1.0]) and rj.tolist() == pytest.approx([beta * -0.5, beta * 1.0])


def _pairs(m: int = 3, length: int = 8) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    ids, mask = _rows(2 * m, length, prompt=3, seed=2)
    labels = ids.masked_fill(mask == 0, -100)
    sample = {"chosen": ids[:m], "rejected": ids[m:], "chosen_label": labels[:m], "rejected_label": labels[m:]}
    return sample, ids, mask


@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_dpo_matches_trl(beta: float) -> None:
    from trl import DPOTrainer

    model = _TokenTable()
    sample, ids, mask = _pairs()
    ref = torch.tensor([-20.0, -18.5, -30.0, -21.0, -17.0, -25.0])
    trl = _trl(DPOTrainer, model=model, precompute_ref_logps=True, ld_alpha=None, f_divergence_type="reverse_kl",
               loss_types=["sigmoid"], loss_weights=[1.0], beta=beta, use_weighting=False, label_smoothing=0.0)
    want = trl._compute_loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": mask,
                                     "ref_chosen_logps": ref[:3], "ref_rejected_logps": ref[3:]}, False)
    obj = _objective("dpo", dpo_beta=beta)
    batch = obj.prepare(sample)
    m = batch.inputs.shape[0] // 2
    loss = obj.loss(model.table(batch.inputs), _targets(batch, ref, denominator=m))
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    got = means_from_vector(obj.metric_names, obj.metrics.as_vector(obj.metric_names))
    theirs = trl._metrics["train"]
    for ours, name in (("rewards/chosen", "rewards/chosen"), ("rewards/rejected", "rewards/rejected"),
                       ("rewards/accuracy", "rewards/accuracies"), ("rewards/margin", "rewards/margins"),
                       ("logps/chosen", "logps/chosen"), ("logps/rejected", "logps/rejected")):
        assert got[ours] == pytest.approx(theirs[name][-1], rel=1e-5, abs=1e-6), ours
    # the loss moves the policy: its gradient reaches the logits of counted tokens only
    logits = model.table(batch.inputs).detach().requires_grad_(True)
    obj.loss(logits, _targets(batch, ref, m)).backward()
    assert logits.grad is not None and float(logits.grad[batch.labels < 0].abs().sum()) == 0.0


def test_dpo_reference_free_and_fp32_switch() -> None:
    sample, _, _ = _pairs()
    obj = _objective("dpo", dpo_beta=0.3)
    batch = obj.prepare(sample)
    logits = _TokenTable().table(batch.inputs).detach()
    free = obj.loss(logits, _targets(batch, None, 3))  # no reference given: log-probs of 0
    logps = sequence_logps(logits, batch.labels)
    want = -F.logsigmoid(0.3 * (logps[:3] - logps[3:])).mean()
    assert float(free) == pytest.approx(float(want), rel=1e-6)
    # dpo_fp32: false sums the per-token log-probs in the logits' precision
    low = logits.to(torch.bfloat16)
    per_token = -F.cross_entropy(low.float().reshape(-1, V), batch.labels.reshape(-1), ignore_index=-100,
                                 reduction="none").reshape(6, -1)
    assert torch.allclose(sequence_logps(low, batch.labels), per_token.sum(-1))
    assert torch.allclose(sequence_logps(low, batch.labels, fp32=False).float(),
                          per_token.to(torch.bfloat16).sum(-1).float(), atol=0.07)
    assert not torch.equal(sequence_logps(low, batch.labels, fp32=False).float(), per_token.sum(-1))


# ---------------------------------------------------------------- KTO
def test_kto_losses_direct_kl_point_and_weights() -> None:
    policy, ref = torch.tensor([-2.0, -6.0, -3.0]), torch.tensor([-3.0, -5.0, -3.5])
    desirable = torch.tensor([True, False, True])
    beta, wd, wu = 0.5, 1.5, 0.25
    for policy_kl, ref_kl in ((torch.tensor([-4.0, -5.0, -6.0]), torch.tensor([-5.0, -5.5, -6.0])),  # mean +0.5
                              (torch.tensor([-9.0, -5.0, -6.0]), torch.tensor([-5.0, -5.5, -6.0]))):  # mean < 0
        losses, rewards, z0 = kto_losses(policy, policy_kl, ref, ref_kl, desirable, beta, wd, wu)
        mean = float((policy_kl - ref_kl).mean())
        want_z0 = max(0.0, mean)  # clamped at 0
        assert float(z0) == pytest.approx(want_z0)
        sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
        r = (policy - ref).tolist()
        want = [wd * (1 - sig(beta * (r[0] - want_z0))), wu * (1 - sig(beta * (want_z0 - r[1]))),
                wd * (1 - sig(beta * (r[2] - want_z0)))]
        assert losses.tolist() == pytest.approx(want, rel=1e-6)
        assert rewards.tolist() == pytest.approx([beta * x for x in r])


def test_kto_mismatched_rows_rotate_completions_within_the_micro_batch() -> None:
    text = torch.tensor([[1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 9, 0], [10, 11, 12, 0, 0, 0]])
    label = torch.tensor([[-100, -100, 3, 4, -100, -100], [-100, 6, 7, 8, 9, -100], [-100, -100, 12, -100, -100, -100]])
    kl_text, kl_label = mismatched_rows(text, label)
    # sample i: its own prompt, the completion of sample i-1 (TRL's rotation by one)
    assert kl_text.tolist() == [[1, 2, 12, 0, 0, 0], [5, 3, 4, 0, 0, 0], [10, 11, 6, 7, 8, 9]]
    assert kl_label.tolist() == [[-100, -100, 12, -100, -100, -100], [-100, 3, 4, -100, -100, -100],
                                 [-100, -100, 6, 7, 8, 9]]


def test_kto_matches_trl() -> None:
    from trl.trainer.kto_trainer import KTOTrainer

    model = _TokenTable()
    m, length = 4, 8
    ids, mask = _rows(m, length, prompt=3, seed=5)
    label = ids.masked_fill(mask == 0, -100)
    reward = torch.tensor([1.0, -1.0, 0.5, 0.0])  # > 0 desirable
    kl_ids, kl_label = mismatched_rows(ids, label)
    kl_mask = (kl_label != -100).long()
    ref = torch.tensor([-18.0, -22.0, -15.0, -19.0])
    for ref_kl in (torch.tensor([-21.0, -20.0, -26.0, -25.0]), torch.tensor([-5.0, -4.0, -6.0, -5.0])):
        trl = _trl(KTOTrainer, model=model, precompute_ref_logps=True, calculate_KL=True, loss_type="kto", beta=0.3,
                   desirable_weight=1.2, undesirable_weight=0.8)
        want = trl._compute_loss(model, {
            "input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": mask,
            "KL_input_ids": kl_ids, "KL_attention_mask": torch.ones_like(ids), "KL_completion_mask": kl_mask,
            "label": reward > 0, "ref_logps": ref, "ref_KL_logps": ref_kl}, False)
        obj = _objective("kto", kto_beta=0.3, kto_desirable_weight=1.2, kto_undesirable_weight=0.8)
        batch = obj.prepare({"text": ids, "label": label, "reward": reward})
        loss = obj.loss(model.table(batch.inputs), _targets(batch, torch.cat([ref, ref_kl]), denominator=m))
        assert float(loss) == pytest.approx(float(want), rel=1e-5)
        got = means_from_vector(obj.metric_names, obj.metrics.as_vector(obj.metric_names))
        theirs = trl._metrics["train"]
        assert got["kl"] == pytest.approx(theirs["kl"][-1], abs=1e-5)
        assert got["rewards/desirable"] == pytest.approx(theirs["rewards/chosen"][-1], rel=1e-5)
        assert got["rewards/undesirable"] == pytest.approx(theirs["rewards/rejected"][-1], rel=1e-5)
    assert theirs["kl"][-1] == 0.0  # the second reference made the estimate negative: clamped


# ---------------------------------------------------------------- reward model
def test_rm_loss_direct_and_z_loss() -> None:
    c, r = torch.tensor([1.0, -0.5]), torch.tensor([0.0, 0.5])
    assert rm_losses(c, r).tolist() == pytest.approx([math.log(1 + math.exp(-1.0)), math.log(1 + math.exp(1.0))])
    z = rm_losses(c, r, 0.1) - rm_losses(c, r)
    assert z.tolist() == pytest.approx([0.1 * 1.0, 0.1 * 0.5])


def test_rm_matches_trl_and_scores_at_the_last_counted_token() -> None:
    from trl import RewardTrainer

    model = _TokenTable()
    sample, ids, mask = _pairs(m=3, length=8)
    obj = _objective("rm")
    batch = obj.prepare(sample)
    # chosen row 0 ends two tokens early: its score sits at position 5 of the 7 inputs
    assert batch.extras[0].tolist() == [5, 6, 6, 6, 6, 6]
    values = torch.randn(6, 7, 1, generator=torch.Generator().manual_seed(3))
    scores = values[torch.arange(6), batch.extras[0], 0]
    stub = types.SimpleNamespace(training=True)
    trl = _trl(RewardTrainer, model=stub, args=types.SimpleNamespace(center_rewards_coefficient=None))
    want = trl.compute_loss(lambda **_: types.SimpleNamespace(logits=scores.unsqueeze(-1)),
                            {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    loss = obj.loss(values, _targets(batch, None, denominator=3))
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    got = means_from_vector(obj.metric_names, obj.metrics.as_vector(obj.metric_names))
    assert got["rm/accuracy"] == pytest.approx(trl._metrics["train"]["accuracy"][-1])
    assert got["rm/margin"] == pytest.approx(trl._metrics["train"]["margin"][-1], rel=1e-6)
    assert score_positions(torch.full((1, 4), -100), 3).tolist() == [2]  # nothing counted: last position


# ---------------------------------------------------------------- metrics, precomputed reference
def test_metric_sums_weight_items_not_micro_batches() -> None:
    sums = MetricSums()
    sums.add({"a": (torch.tensor(3.0), torch.tensor(1.0))})
    sums.add({"a": (torch.tensor(1.0), torch.tensor(3.0)), "b": (torch.tensor(2.0), torch.tensor(0.0))})
    assert means_from_vector(("a", "b"), sums.as_vector(("a", "b"))) == {"a": 1.0}


def test_precomputed_reference_values_sum_over_the_counted_labels() -> None:
    """DPO samples carrying precompute's per-token values (aligned with the tokens) get, per row, the
    sum over the counted targets: the reference model's sequence log-prob, as computing it directly."""
    obj = _objective("dpo")
    model = _TokenTable()
    tokens = torch.tensor([[1, 2, 3, 4, 5], [1, 3, 5, 7, 9]])
    labels = torch.tensor([[-100, -100, 3, 4, 5], [-100, 3, -100, 7, 9]])
    logp = torch.log_softmax(model.table(tokens[:, :-1]).float(), -1)
    per_token = torch.cat([torch.zeros(2, 1), logp.gather(-1, tokens[:, 1:, None])[..., 0]], dim=1)  # value[0] = 0
    sample = {"chosen": tokens[:1], "chosen_label": labels[:1], "rejected": tokens[1:], "rejected_label": labels[1:],
              "chosen_ref": per_token[:1], "rejected_ref": per_token[1:]}
    batch = obj.prepare(sample)
    want = obj.reference_logps(model.table(batch.inputs), batch.labels)
    assert batch.reference is not None and torch.allclose(batch.reference, want.detach(), atol=1e-6)
    assert obj.prepare({k: v for k, v in sample.items() if not k.endswith("_ref")}).reference is None
