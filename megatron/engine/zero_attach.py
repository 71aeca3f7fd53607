"""Run an optimizer's own pre-step hook before each step of DeepSpeed's ZeRO optimizer.

DeepSpeed 0.19.8's ZeRO optimizers (stages 1-3) replace each group's parameters by one flat fp32 tensor, this
rank's partition, and call the optimizer's ``step`` once per group (stage 3: once per sub-group;
``stage_1_and_2.py`` ``_optimizer_step``, ``stage3.py`` ``_optimizer_step``): no call sees every group. An optimizer
that needs something over all of them (Levanter's Muon and Scion clip their AdamW/signum half by its own global
norm: ``megatron/engine/levanter_whole_tensor_optim.py``) has a ``before_zero_step(pending)`` method, called here
before each ZeRO step with this rank's part of every reduced gradient
(``deepspeed_internals.zero_pending_gradients``). Where the whole parameters lie in the partitions is told by
``megatron/engine/whole_parameters.py``'s ``attach_whole_parameters``. Optimizers without the method, and engines
without ZeRO, are left as they are.
"""

from __future__ import annotations

from typing import Any

from megatron.deepspeed_internals import before_zero_step, zero_masters, zero_pending_gradients


def install_zero_pre_step(engine: Any) -> None:
    """Install the engine's optimizer's ``before_zero_step`` (module docstring)."""
    base, wrapper = engine.basic_optimizer, engine.optimizer
    before = getattr(base, "before_zero_step", None)
    if before is None or wrapper is base or not zero_masters(wrapper):
        return
    before_zero_step(wrapper, lambda: before(zero_pending_gradients(wrapper)))
