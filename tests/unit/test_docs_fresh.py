"""The committed key reference (configs/neox_arguments.md) must match what the schema generates."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from megatron.neox_arguments.arguments import GROUPS, NeoXArgs
from megatron.neox_arguments.docs import render_markdown, support_note, type_name

REFERENCE = Path(__file__).resolve().parents[2] / "configs" / "neox_arguments.md"
REGENERATE = "python -m megatron.neox_arguments.docs > configs/neox_arguments.md"


def test_committed_reference_is_fresh() -> None:
    committed = REFERENCE.read_text()
    generated = render_markdown()
    if committed != generated:
        old, new = committed.splitlines(), generated.splitlines()
        first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        raise AssertionError(
            f"configs/neox_arguments.md is stale (first difference at line {first + 1}); "
            f"regenerate it with: {REGENERATE}"
        )


def test_reference_lists_every_key_once_under_its_group() -> None:
    text = render_markdown()
    for name in NeoXArgs.field_names():
        assert text.count(f"| `{name}` |") == 1, name
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert [h.split()[1] for h in headings] == list(NeoXArgs.groups())
    assert list(NeoXArgs.groups())[: len(GROUPS)] == list(GROUPS)  # the fixed groups first, then plug-ins'
    # a row carries the type, default, doc and support flag
    row = next(line for line in text.splitlines() if line.startswith("| `te_mha` |"))
    assert row.startswith("| `te_mha` | bool | `False` | Build each block's self-attention as Transformer Engine's ")
    assert row.endswith(" | needs Transformer Engine on an NVIDIA GPU (pip package `transformer-engine`) |")
    row = next(line for line in text.splitlines() if line.startswith("| `pipe_partition_method` |"))
    assert "`'type:transformer\\|mlp'`" in row  # pipes inside cells are escaped


def test_support_notes(key_not_supported_yet: str) -> None:
    assert support_note("hidden_size") == ""
    assert support_note("moe_num_experts") == ""
    assert support_note("use_mup") == "not supported yet"
    assert support_note("norm") == ("needs Transformer Engine on an NVIDIA GPU (values `te_rmsnorm`, `te_layernorm`; "
                                    "pip package `transformer-engine`)")
    assert "obsolete types `bigbird`" in support_note("attention_config")


def test_no_gpt_neox_key_is_left_not_supported_yet() -> None:
    """Issue 47: every key is built, or refused with a reason (obsolete: why and what instead; a CUDA-only
    library: where it is missing); none is left at "not supported yet", and the header then says nothing of it."""
    left = {name: support_note(name) for name in NeoXArgs.field_names()
            if support_note(name) and not support_note(name).startswith(("obsolete", "needs "))}
    assert left == {}
    assert "not supported yet" not in render_markdown()


def test_header_explains_not_supported_yet_only_when_a_key_is(key_not_supported_yet: str) -> None:
    assert "marked *not supported yet* is accepted only at its default" in render_markdown()


def test_type_names_are_readable() -> None:
    cases: list[tuple[Any, str]] = [
        (int | None, "int | None"),
        (Literal["a", "b"], '"a" | "b"'),
        (list[int] | Literal["all"] | None, 'list[int] | "all" | None'),
        (dict[str, Any], "dict[str, Any]"),
        (Any, "Any"),
    ]
    for annotation, expected in cases:
        assert type_name(annotation) == expected
