"""Cross-entropy computed in the logits' own dtype (``fp16_lm_cross_entropy``), as GPT-NeoX computes it.

GPT-NeoX's ``cross_entropy(output, labels, _fp16=True)`` (``megatron/model/gpt2_model.py:60-76``, commit
ea7aefd8) hands the fp16 logits to its ``mpu.vocab_parallel_cross_entropy`` without the ``.float()`` it
applies otherwise, so every step of ``_VocabParallelCrossEntropy.forward`` (``megatron/mpu/cross_entropy.py``)
runs in fp16: the max over the vocabulary (all-reduced MAX over the tensor-parallel ranks) is subtracted,
the target's shifted logit is picked (all-reduced SUM), ``exp`` is summed over the vocabulary (all-reduced
SUM) and the loss is ``log(sum) - picked``. The same operations in the same order here, in the logits'
dtype; the gradient is autograd's of those operations (``softmax - one_hot``, in the same dtype).

Deepy's default path (:mod:`megatron.mpu.cross_entropy`) upcasts to fp32 block by block, which is
GPT-NeoX's ``_fp16=False`` path (``output.float()``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.mpu.mappings import reduce_from_tensor_model_parallel_region
from megatron.mpu.topology import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


def vocab_parallel_cross_entropy_in_logits_dtype(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token loss in ``logits.dtype`` (shape of ``target``) from this rank's vocabulary shard.

    ``logits`` ``[..., v/tp]``; ``target`` ``[...]`` full-vocabulary ids. A negative target (-100) is
    on no rank: its loss is ``log(sum exp)`` and the caller masks it out, as GPT-NeoX's loss mask does.
    """
    vocab_per_rank = logits.shape[-1]
    top = logits.detach().amax(dim=-1)  # [...]
    if get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=get_tensor_model_parallel_group())
    shifted = logits - top.unsqueeze(-1)  # [..., v/tp], logits' dtype
    local_target = target - get_tensor_model_parallel_rank() * vocab_per_rank
    not_mine = (local_target < 0) | (local_target >= vocab_per_rank)
    index = local_target.masked_fill(not_mine, 0).unsqueeze(-1)
    picked = shifted.gather(-1, index).squeeze(-1).masked_fill(not_mine, 0.0)  # [...]
    picked = reduce_from_tensor_model_parallel_region(picked)
    sum_exp = reduce_from_tensor_model_parallel_region(shifted.exp().sum(dim=-1))  # [...]
    return sum_exp.log() - picked
