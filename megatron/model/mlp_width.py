"""How wide the MLP is: GPT-NeoX's width rules, as pure arithmetic on the keys (no torch).

GPT-NeoX (``megatron/model/transformer.py`` ``ParallelMLP.__init__``, lines 117-143 at ea7aefd8) sizes
the two projections of a dense MLP separately:

* ``F`` = ``intermediate_size``, else ``int(expansion_factor * hidden_size)``, else ``4 * hidden_size``
  (setting both keys is an assertion error there, line 106);
* a gated activation (``Gated_Activation``) first scales ``F`` to ``int(F * 2 / 3)`` and gives the
  second projection half of that, ``F // 2``;
* the first projection's width is rounded up to a multiple of ``2 * mlp_multiple_of``, the second
  projection's input to a multiple of ``mlp_multiple_of``.

The gated activation splits the first projection's output in two equal halves, so the model only
works when ``first == 2 * second`` (``first == second`` without gating); otherwise GPT-NeoX fails at
the first forward (``mistral/7B.yml``: 14336 with ``mlp_multiple_of`` 1 gives halves of 4779 against
a 4778-wide second projection). Deepy refuses those configs before launch and says which
``intermediate_size`` gives the width meant (:func:`intermediate_size_for`).

``mlp_type: llama`` is GPT-NeoX's spelling before September 2024 (``LLaMAParallelMLP``, removed by
#1212/#1276): ``intermediate_size`` was the width of each half, as given, or ``int(8 * hidden / 3)``
rounded up to 256 (:func:`legacy_llama_width`).

Mixture-of-experts layers use another rule (``megatron/model/moe_mlp.py`` ``ParallelGroupedMLP``, lines
159-166): each expert is ``intermediate_size`` wide, else ``4 * hidden_size`` rounded up to 256, with
no 2/3 scaling (:func:`expert_width`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.model.activations import ACTIVATIONS

GATED_ACTIVATIONS = frozenset(name for name, entry in ACTIVATIONS.items() if entry.gated)
"""Activations GPT-NeoX runs through ``Gated_Activation`` (``megatron/model/activations.py``
``get_activation``: ``is_gated = True``): the registry's gated entries (``megatron/model/activations.py``)."""

LEGACY_LLAMA_MULTIPLE = 256
"""``LLaMAParallelMLP``'s ``multiple_of`` (its width when ``intermediate_size`` is unset)."""

EXPERT_MULTIPLE = 256
"""``ParallelGroupedMLP``'s ``multiple_of`` (an expert's width when ``intermediate_size`` is unset)."""


def _round_up(value: int, multiple: int) -> int:
    return multiple * math.ceil(value / multiple)


@dataclass(frozen=True, slots=True)
class MLPWidths:
    """The widths GPT-NeoX's rules give one dense MLP."""

    first: int
    """Output rows of the first projection (``linear1``; Deepy's ``dense_h_to_4h``): both halves
    when gated."""
    second: int
    """Input columns of the second projection (``linear2``; Deepy's ``dense_4h_to_h``): the width
    the activation hands on."""
    gated: bool

    @property
    def buildable(self) -> bool:
        """The activation's output fits the second projection (GPT-NeoX fails at its first forward
        otherwise)."""
        return self.first == (2 * self.second if self.gated else self.second)


def base_width(hidden_size: int, intermediate_size: int | None, expansion_factor: float | None) -> int:
    """``F`` before any gating or rounding (transformer.py:117-123)."""
    if intermediate_size:
        return intermediate_size
    if expansion_factor:
        return int(expansion_factor * hidden_size)
    return 4 * hidden_size


def neox_mlp_widths(hidden_size: int, intermediate_size: int | None, expansion_factor: float | None,
                    multiple_of: int, gated: bool) -> MLPWidths:
    """GPT-NeoX's ``ParallelMLP`` widths (transformer.py:117-143 at ea7aefd8)."""
    first = base_width(hidden_size, intermediate_size, expansion_factor)
    second = first
    if gated:
        first = int(first * 2 / 3)
        second = first // 2
    multiple = max(1, multiple_of)
    return MLPWidths(first=_round_up(first, 2 * multiple), second=_round_up(second, multiple), gated=gated)


def legacy_llama_width(hidden_size: int, intermediate_size: int | None) -> int:
    """Each half of ``mlp_type: llama``'s MLP (``LLaMAParallelMLP`` before #1212)."""
    if intermediate_size is not None:
        return intermediate_size
    return _round_up(int(2 * hidden_size * 4 / 3), LEGACY_LLAMA_MULTIPLE)


def expert_width(hidden_size: int, intermediate_size: int | None) -> int:
    """One expert's width (``ParallelGroupedMLP``, moe_mlp.py:159-166 at ea7aefd8)."""
    if intermediate_size is not None:
        return intermediate_size
    return _round_up(4 * hidden_size, EXPERT_MULTIPLE)


def intermediate_size_for(width: int, gated: bool) -> int | None:
    """The ``intermediate_size`` that gives a ``width``-wide MLP (each half ``width`` wide when gated)
    under GPT-NeoX's rules with ``mlp_multiple_of: 1``; None when there is none (an odd ungated width:
    the first projection is rounded to an even width, the second is not).

    Gated: ``3 * width``, since ``int(3w * 2 / 3) = 2w`` exactly (``6w`` is an integer below 2^53 and
    divides by 3) and ``2w // 2 = w``. This is how a Hugging Face ``intermediate_size`` (the width of
    each half of Llama's MLP) is written in GPT-NeoX's keys."""
    if gated:
        return 3 * width
    return width if width % 2 == 0 else None


def width_problem(widths: MLPWidths, hidden_size: int, intermediate_size: int | None,
                  expansion_factor: float | None, multiple_of: int) -> str | None:
    """Why GPT-NeoX cannot build these widths, and what to set instead; None when it can."""
    if widths.buildable:
        return None
    got = (f"gate halves of {widths.first // 2} against a {widths.second}-wide second projection" if widths.gated
           else f"a {widths.first}-wide first projection against a {widths.second}-wide second one")
    meant = base_width(hidden_size, intermediate_size, expansion_factor)
    advice = []
    for width in dict.fromkeys((meant, widths.second)):
        size = intermediate_size_for(width, widths.gated)
        if size is not None:
            half = " (each half)" if widths.gated else ""
            advice.append(f"intermediate_size: {size} with mlp_multiple_of: 1 for a {width}-wide MLP{half}")
    return (f"GPT-NeoX's MLP width rule (ParallelMLP: F, x2/3 when gated, first projection rounded to "
            f"2 x mlp_multiple_of={multiple_of}, second to mlp_multiple_of) gives {got}, which GPT-NeoX cannot "
            f"run; set " + (" or ".join(advice) if advice else "an even intermediate_size"))
