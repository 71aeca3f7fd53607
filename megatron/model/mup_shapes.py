"""muP's width arithmetic, ported from Microsoft's ``mup`` 1.0.0 (the package GPT-NeoX ea7aefd8 calls): the base
shapes file, each parameter's width dimensions and multipliers, and MuAdam's/MuSGD's learning rates per parameter.

Deepy does not depend on the ``mup`` package itself: mup 1.0.0 requires torchvision, whose only installable wheel
here is CUDA-linked and breaks ``import transformers`` on a CPU torch, and what Deepy uses of it is this small
arithmetic. No torch here: the rules read shapes and the ``infshape`` attribute of the parameters they group.

* Base shapes file (mup 1.0.0 ``shape.py`` ``save_base_shapes``/``load_base_shapes``): the comment header below,
  then ``yaml.dump({name: [base dim, or null for a dimension that is not a width]}, indent=4)``; a file mup writes is
  read here and the other way round.
* Which dimensions are widths (``shape.py`` ``make_base_shapes``, ``infshape.py`` ``zip_infshape``): those whose
  size differs between the base model and a "delta" model (only wider); a width's multiplier is
  ``dim / base_dim``, a finite dimension's is 1.
* ``InfShape.width_mult``: the multiplier of the *last* width dimension (a matrix ``[fan_out, fan_in]`` with two: the
  fan-in's); ``fanin_fanout_mult_ratio``: fan-in's multiplier over fan-out's.
* ``optim.py``: MuAdam gives a matrix-like parameter (two width dimensions) ``lr / width_mult`` and
  ``weight_decay * width_mult``; MuSGD gives a vector-like one (one width dimension) ``lr * width_mult`` and
  ``weight_decay / width_mult``, a matrix-like one ``lr / ratio`` and ``weight_decay * ratio`` (``ratio`` the fan-in
  over fan-out multiplier); every other parameter keeps its group's values.
* ``init.py`` ``normal_``: a weight with two width dimensions is drawn with ``std / sqrt(width_mult)``, others with
  ``std`` (:func:`init_factor`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

BSH_COMMENT = '''\
# This is a base shape file encoded in yaml
# - `null` indicates a dimension is "finite", i.e. a non-"width" dimension
# - a number indicates the base dimension of an "infinite" dimension, i.e. some notion of "width"
'''
"""The header mup 1.0.0's ``save_base_shapes`` writes, kept verbatim so the files are byte-identical."""

BaseShape = list[int | None]
"""One parameter's base shape: the base size of each width dimension, None for the others."""


@dataclass(frozen=True, slots=True)
class InfDim:
    """One dimension of a parameter (mup's ``InfDim``): a width when ``base_dim`` is set."""

    base_dim: int | None
    dim: int

    def isinf(self) -> bool:
        return self.base_dim is not None

    def width_mult(self) -> float:
        """``dim / base_dim`` for a width, 1 otherwise."""
        return self.dim / self.base_dim if self.base_dim is not None else 1.0


@dataclass(frozen=True, slots=True)
class InfShape:
    """A parameter's dimensions (mup's ``InfShape``), attached to it as ``param.infshape``."""

    dims: tuple[InfDim, ...]

    def ninf(self) -> int:
        """How many of the dimensions are widths."""
        return sum(d.isinf() for d in self.dims)

    def width_mult(self) -> float:
        """The multiplier of the last width dimension (for a ``[fan_out, fan_in]`` matrix of two: the fan-in's)."""
        widths = [d for d in self.dims if d.isinf()]
        return widths[-1].width_mult() if widths else 1.0

    def fanin_fanout_mult_ratio(self) -> float:
        """Fan-in's multiplier over fan-out's (dimension 1 over dimension 0)."""
        assert len(self.dims) >= 2, "fan-in and fan-out are undefined for a 1-dimensional weight"
        return self.dims[1].width_mult() / self.dims[0].width_mult()

    def base_shape(self) -> BaseShape:
        return [d.base_dim for d in self.dims]


def zip_infshape(base: Sequence[int | None], shape: Sequence[int]) -> InfShape:
    """A parameter of ``shape`` against its base shape from the file (mup's ``zip_infshape`` of a loaded file): a
    dimension is a width exactly when the file gives it a base size."""
    assert len(base) == len(shape), f"base shape {list(base)} against shape {list(shape)}"
    return InfShape(tuple(InfDim(b, d) for b, d in zip(base, shape)))


# --- the base shapes file ----------------------------------------------------------------------------------------
def make_base_shapes(base: Mapping[str, Sequence[int]], delta: Mapping[str, Sequence[int]]) -> dict[str, BaseShape]:
    """mup's ``make_base_shapes`` of two models' shapes by parameter name: a dimension whose size differs in the
    ``delta`` model is a width with the base model's size; one of the same size is not a width (None)."""
    assert base.keys() == delta.keys(), (f"the base model has extra parameters {sorted(base.keys() - delta.keys())}, "
                                         f"the delta model {sorted(delta.keys() - base.keys())}")
    return {name: [b if b != d else None for b, d in zip(shape, delta[name])] for name, shape in base.items()}


def save_base_shapes(base_shapes: Mapping[str, BaseShape], path: str | Path) -> None:
    """Write ``base_shapes`` in mup's format (``shape.py save_base_shapes``: the header, then ``yaml.dump`` with
    ``indent=4``, keys sorted as yaml.dump sorts them)."""
    text = BSH_COMMENT + yaml.dump({name: list(shape) for name, shape in base_shapes.items()}, None, indent=4)
    Path(path).write_text(text)


def load_base_shapes(path: str | Path) -> dict[str, BaseShape]:
    """Read a base shapes file written by :func:`save_base_shapes` or by mup (``shape.py load_base_shapes``)."""
    loaded: dict[str, BaseShape] = yaml.safe_load(Path(path).read_text())
    return {str(name): list(shape) for name, shape in loaded.items()}


# --- the muP init and learning rates -----------------------------------------------------------------------------
def init_factor(infshape: InfShape) -> float:
    """What mup's ``init.normal_(std)`` draws, over ``normal(std)``: ``1 / sqrt(width_mult)`` for a weight with two
    width dimensions, 1 otherwise (mup 1.0.0 ``init.py constant_std_init_``)."""
    assert infshape.ninf() <= 2, "mup handles at most two width dimensions"
    return infshape.width_mult() ** -0.5 if infshape.ninf() == 2 else 1.0


Group = dict[str, Any]
"""A torch optimizer parameter group: ``params`` and its options (``lr``, ``weight_decay``, ...)."""


def _split(group: Group, key_of: Callable[[InfShape], tuple[str, float] | None]) -> dict[tuple[str, float], Group]:
    """``group``'s parameters into new groups (the same options) by ``key_of`` their infshape; None: unchanged."""
    made: dict[tuple[str, float], Group] = {}
    for param in group["params"]:
        infshape = getattr(param, "infshape", None)
        assert isinstance(infshape, InfShape), (
            f"a parameter of shape {tuple(param.shape)} has no muP infshape (megatron/model/mup.py apply_base_shapes)")
        if infshape.ninf() > 2:
            raise NotImplementedError("more than 2 width dimensions")
        key = key_of(infshape) or ("fixed", 1.0)
        made.setdefault(key, _empty(group))["params"].append(param)
    return made


def _defaults(groups: Iterable[Group], lr: float, weight_decay: float) -> list[Group]:
    """mup's ``process_param_groups``: each group's lr and weight_decay default to the optimizer's."""
    return [{"lr": lr, "weight_decay": weight_decay, **group} for group in groups]


def mu_adam_groups(groups: Iterable[Group], lr: float, weight_decay: float = 0.0) -> list[Group]:
    """mup's ``MuAdam`` (and ``MuAdamW``) groups: a matrix-like parameter (two width dimensions) of width multiplier
    ``m`` gets ``lr / m`` and ``weight_decay * m``; the others keep their group's values. Matrix groups come first,
    as mup orders them."""
    out: list[Group] = []
    for group in _defaults(groups, lr, weight_decay):
        made = _split(group, lambda s: ("matrix", s.width_mult()) if s.ninf() == 2 else None)
        for (kind, m), new in made.items():
            if kind == "matrix":
                new["lr"] /= m
                new["weight_decay"] *= m
        out += [g for (kind, _), g in made.items() if kind == "matrix"] + [made.get(("fixed", 1.0), _empty(group))]
    return out


def mu_sgd_groups(groups: Iterable[Group], lr: float, weight_decay: float = 0.0) -> list[Group]:
    """mup's ``MuSGD`` groups: a vector-like parameter (one width dimension) of multiplier ``m`` gets ``lr * m`` and
    ``weight_decay / m``; a matrix-like one with fan-in over fan-out multiplier ``r`` gets ``lr / r`` and
    ``weight_decay * r``; the others keep their group's values. Ordered matrix, vector, fixed as mup does."""
    out: list[Group] = []
    for group in _defaults(groups, lr, weight_decay):
        def key(s: InfShape) -> tuple[str, float] | None:
            if s.ninf() == 2:
                return ("matrix", s.fanin_fanout_mult_ratio())
            return ("vector", s.width_mult()) if s.ninf() == 1 else None

        made = _split(group, key)
        for (kind, m), new in made.items():
            if kind == "matrix":
                new["lr"] /= m
                new["weight_decay"] *= m
            elif kind == "vector":
                new["lr"] *= m
                new["weight_decay"] /= m
        out += ([g for (kind, _), g in made.items() if kind == "matrix"]
                + [g for (kind, _), g in made.items() if kind == "vector"]
                + [made.get(("fixed", 1.0), _empty(group))])
    return out


def _empty(group: Group) -> Group:
    """mup always appends its (possibly empty) group of unchanged parameters."""
    return {**{k: v for k, v in group.items() if k != "params"}, "params": []}
