"""Starting an objective whose model has parameters its checkpoint lacks (a reward model from a
language model: SFT -> RM): those start from their initialisation, everything else loads.

The objective declares the new parameters by ``GPTModel`` name prefix (``value_head.``), so this
works on the module, not on the files' naming: DeepSpeed's loader hands each module (the whole
``GPTModel``, or each ``PipelineModule`` layer) its state dict, and the module's ``load_state_dict``
is what is wrapped here for the duration of one load.

* Plain engine: ``GPTModel.load_state_dict`` runs non-strict; a missing key outside the declared
  prefixes, or a declared one of the same shape found in the checkpoint, stops the load naming them.
  Keys the checkpoint has and the model lacks (the language model's head) are dropped and reported.
* Pipeline: a layer made only of new parameters (``ValueHeadPipe``) for which the checkpoint has no
  file (DeepSpeed's ``ckpt_layer_path_list``) is not shown to DeepSpeed's per-layer loader (swapped
  for a placeholder without ``load_state_dict`` while loading: DeepSpeed skips such entries); other
  layers load non-strictly as above.

LoRA adapters on a base checkpoint:
Loading a checkpoint without LoRA adapters (a base model) into a run that trains adapters.

The adapters add state-dict entries (``<layer>.adapter.lora_A/B``) that a base checkpoint does not
have. Such a checkpoint is the run's starting point (``initialize_from`` / ``finetune``): its weights
are loaded strictly into the base layers while the adapters are detached, and the adapters keep
their fresh initialisation (``B == 0``, so the run starts exactly at the base model). Resuming a run
is different: its own checkpoints hold the adapters, so the normal strict load applies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from megatron.deepspeed_internals import pipeline_local_start
from megatron.errors import CheckpointError
from megatron.model.lora import ADAPTER, LoRAAdapter
from megatron.model.pipeline import model_parameter_name


@dataclass
class NewParameterReport:
    """What the load left at its initialisation and what it dropped, by ``GPTModel`` name."""

    initialised: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def notes(self) -> list[str]:
        out = []
        if self.initialised:
            out.append(f"new parameters start from their initialisation: {', '.join(sorted(self.initialised))}")
        if self.dropped:
            out.append(f"checkpoint tensors this model does not have were dropped: {', '.join(sorted(self.dropped))}")
        return out


class _NoState:
    """Stands in for a layer DeepSpeed's pipeline loader must skip (it has no ``load_state_dict``)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer


def _non_strict(module: nn.Module, to_model_name: Callable[[str], str], is_new: Callable[[str], bool],
                report: NewParameterReport) -> Callable[..., Any]:
    original = module.load_state_dict

    def load_state_dict(state_dict: Any, strict: bool = True, **kwargs: Any) -> Any:
        result = original(state_dict, strict=False, **kwargs)
        missing = [to_model_name(k) for k in result.missing_keys]
        unexplained = [k for k in missing if not is_new(k)]
        if unexplained:
            raise CheckpointError(f"the checkpoint lacks parameters this model needs (only "
                                  f"{', '.join(sorted({k for k in missing if is_new(k)})) or 'none'} may start from "
                                  f"their initialisation): {', '.join(sorted(unexplained))}")
        report.initialised += missing
        report.dropped += [to_model_name(k) for k in result.unexpected_keys]
        return result

    return load_state_dict


def _in_layer(index: int) -> Callable[[str], str]:
    """A pipeline layer's own state-dict key -> the model's parameter name (the layer at ``index``)."""
    return lambda key: model_parameter_name(f"{index}.{key}")


@contextlib.contextmanager
def tolerating_new_parameters(engine: Any, prefixes: tuple[str, ...]) -> Iterator[NewParameterReport]:
    """Within the block, loads into ``engine`` leave parameters named ``prefixes*`` at their init."""
    report = NewParameterReport()
    if not prefixes:
        yield report
        return

    def is_new(name: str) -> bool:
        return name.startswith(prefixes)

    module = engine.module
    patched: list[nn.Module] = []
    try:
        if hasattr(module, "forward_funcs"):  # PipelineModule: one state dict per layer
            start = pipeline_local_start(module)
            new_layers: list[int] = []
            for i, layer in enumerate(module.forward_funcs):
                if not isinstance(layer, nn.Module):
                    continue
                names = [model_parameter_name(f"{start + i}.{n}") for n, _ in layer.named_parameters()]
                if names and all(is_new(n) for n in names):
                    new_layers.append(i)
                # patched for this load only (restored on the way out): method-assign on purpose
                layer.load_state_dict = _non_strict(  # type: ignore[method-assign]
                    layer, _in_layer(start + i), is_new, report)
                patched.append(layer)
            module.load_state_dir = _skipping_absent(module, new_layers, start, report)
            patched.append(module)
        else:
            module.load_state_dict = _non_strict(module, lambda k: k, is_new, report)
            patched.append(module)
        yield report
    finally:
        for item in patched:
            for name in ("load_state_dict", "load_state_dir"):
                if name in vars(item):
                    delattr(item, name)  # the class's method again


def _skipping_absent(module: Any, new_layers: list[int], start: int, report: NewParameterReport) -> Callable[..., Any]:
    """``PipelineModule.load_state_dir`` that does not show DeepSpeed a layer made only of new
    parameters when the checkpoint has no file for it (DeepSpeed's loader requires one per layer)."""
    original = module.load_state_dir

    def load_state_dir(load_dir: str, checkpoint_engine: Any, strict: bool = True) -> Any:
        swapped = [(i, module.forward_funcs[i]) for i in new_layers if not module.ckpt_layer_path_list(load_dir, i)]
        for i, layer in swapped:
            module.forward_funcs[i] = _NoState(layer)
            report.initialised += [model_parameter_name(f"{start + i}.{n}") for n, _ in layer.named_parameters()]
        try:
            return original(load_dir, checkpoint_engine, strict=strict)
        finally:
            for i, layer in swapped:
                module.forward_funcs[i] = layer

    return load_state_dir


# --- LoRA adapters on a base checkpoint ----------------------------------------------------------
def _adapter_rank(args: dict[str, Any]) -> int:
    return int(args.get("lora_r") or 0)


@contextlib.contextmanager
def adapters_detached(module: nn.Module) -> Iterator[None]:
    """``module``'s state dict without the adapters inside the block (no forward may run in it)."""
    detached: list[tuple[nn.Module, LoRAAdapter]] = []
    for layer in module.modules():
        adapter = dict(layer.named_children()).get(ADAPTER)
        if isinstance(adapter, LoRAAdapter):
            detached.append((layer, adapter))
    for layer, _ in detached:
        delattr(layer, ADAPTER)  # nn.Module removes a registered child from its children
    try:
        yield
    finally:
        for layer, adapter in detached:
            layer.add_module(ADAPTER, adapter)


def base_for_adapters(saved_args: dict[str, Any], args: dict[str, Any], weights_only: bool) -> bool:
    """A run with adapters starts from a checkpoint without them: the load runs with the adapters detached."""
    return weights_only and _adapter_rank(args) > 0 and _adapter_rank(saved_args) == 0


def base_checkpoint_loading(engine: Any, ckpt_dir: Path, saved_args: dict[str, Any], args: dict[str, Any],
                            weights_only: bool) -> contextlib.AbstractContextManager[None]:
    """The context a load of ``ckpt_dir`` runs in: adapters detached when a run with adapters starts
    from a checkpoint without them; refused when such a checkpoint would be resumed."""
    if _adapter_rank(args) == 0 or _adapter_rank(saved_args) > 0:
        return contextlib.nullcontext()
    if not weights_only:
        raise CheckpointError(
            f"{ckpt_dir} holds no LoRA adapters (it was saved with lora_r 0) and this run trains adapters "
            f"(lora_r {_adapter_rank(args)}): start from it as the frozen base with initialize_from: "
            f"{ckpt_dir.parent} (or finetune: true), and save the adapter run to another directory")
    return adapters_detached(engine.module)
