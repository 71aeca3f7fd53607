"""Each component's own instance of its group: what the argument layer hands a component instead of the flat object
of every key (``NeoXArgs``), so the component holds its keys and nothing else (issue 46)."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

from megatron import plugins
from megatron.config_schema import ArgGroup
from megatron.evaluation.config import EvalArgs, EvalRun
from megatron.generation.config import TextgenArgs, batch_size
from megatron.logging.config import LoggingArgs
from megatron.model.config import GPTConfig
from megatron.neox_arguments.arguments import NeoXArgs

G = TypeVar("G", bound=BaseModel)

_WITH_PLUGIN_KEYS: dict[tuple[type[BaseModel], tuple[type[ArgGroup], ...]], type[BaseModel]] = {}


def _with_plugin_keys(cls: type[G]) -> type[G]:
    """``cls``, joined with the keys of the plug-ins its selecting key chooses among (``ObjectiveArgs`` declares
    ``train_impl``: it also holds ``DPOKeys``' and ``KTOKeys``' keys, which the chosen objective reads from its
    config); the same class for the same plug-ins."""
    extra = tuple(keys for name, keys in plugins.key_groups()
                  if name.split(":")[0] in cls.model_fields and not issubclass(cls, keys))
    if not extra:
        return cls
    if (cls, extra) not in _WITH_PLUGIN_KEYS:
        _WITH_PLUGIN_KEYS[cls, extra] = type(cls.__name__, (cls, *extra), {"__module__": cls.__module__,
                                                                            "__doc__": cls.__doc__})
    return _WITH_PLUGIN_KEYS[cls, extra]  # type: ignore[return-value]  # a subclass of cls, built above


def group(args: NeoXArgs, cls: type[G]) -> G:
    """The instance of ``cls`` (a component's group) holding ``args``' values of its keys and nothing else:
    what the component receives. ``args`` is validated already, so the values are taken as they are (the
    group's own defaults fill nothing: every key is in ``args``), and the keys the user set stay marked as set."""
    composed = _with_plugin_keys(cls)
    names = set(composed.model_fields)
    values: dict[str, Any] = {}
    for name in names:  # a loop, not a comprehension: the honesty test's recorder knows this frame as a copy
        values[name] = getattr(args, name)
    return composed.model_construct(_fields_set=names & args.model_fields_set, **values)


def evaluation_run(args: NeoXArgs) -> EvalRun:
    """What evaluation reads (eval.py, lm-eval in training): its own instance of each group it reads keys of, and
    the requests run together, derived once from the micro-batch."""
    return EvalRun(evaluation=group(args, EvalArgs), model=group(args, GPTConfig), textgen=group(args, TextgenArgs),
                   logging=group(args, LoggingArgs), batch_size=batch_size(args.train_micro_batch_size_per_gpu))
