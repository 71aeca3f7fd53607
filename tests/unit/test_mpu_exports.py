"""``megatron.mpu`` exports its names lazily (the schema imports ``mpu/parallel_config.py`` without
DeepSpeed): the lazy table must still hold every parallel-state name, DeepSpeed's ``get_model_parallel_*``
included, since the package itself is the ``mpu`` handed to ``deepspeed.initialize``."""

from __future__ import annotations

import importlib
import inspect

import megatron.mpu as mpu
from megatron.mpu import topology


def test_every_parallel_state_name_is_exported() -> None:
    public = {name for name, value in vars(topology).items()
              if not name.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value))
              and value.__module__ == topology.__name__}
    assert {"get_model_parallel_group", "get_model_parallel_world_size", "get_model_parallel_rank"} <= public
    assert public - set(mpu._EXPORTS) == set()


def test_each_export_is_the_defining_modules_object() -> None:
    for name, module in mpu._EXPORTS.items():
        assert getattr(mpu, name) is getattr(importlib.import_module(f"megatron.mpu.{module}"), name), name
