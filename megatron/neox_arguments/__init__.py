"""Deepy's arguments: schema, loading of config files, rules, and the DeepSpeed split.

The public names are imported lazily (PEP 562) so that ``import megatron.neox_arguments`` stays cheap
for ``deepy.py --dry-run`` and so the submodules can import each other without import cycles.
"""

from __future__ import annotations

from megatron.lazy import lazy_exports

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "NeoXArgs": "megatron.neox_arguments.arguments",
    "ResolvedConfig": "megatron.neox_arguments.resolved",
    "load_resolved": "megatron.neox_arguments.resolved",
    "load_config": "megatron.neox_arguments.loading",
    "config_from_mapping": "megatron.neox_arguments.loading",
    "apply_overrides": "megatron.neox_arguments.overrides",
    "finalize": "megatron.neox_arguments.derived",
    "detect_world_size": "megatron.neox_arguments.derived",
    "deepspeed_config": "megatron.neox_arguments.deepspeed_split",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
