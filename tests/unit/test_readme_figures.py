"""README.md states what its recipes give (issue 42, item 18: its DPO figures, 0.70/0.90, 0.280 and 1.91, were
not what the recipe gives, and its console transcript came from older code).

``tools/bench/readme_figures.py`` runs the recipes as written and records what they gave in
``tests/e2e/readme_figures.json``; these tests hold the README to that record without training (a fraction of a
second), and ``tests/e2e/test_quick_start.py`` holds the code to it (its 60-step run against the recorded one).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tools.bench import readme_figures as figures


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    return json.loads(figures.RECORD.read_text())


@pytest.fixture(scope="module")
def readme() -> str:
    return figures.README.read_text(encoding="utf-8")


def test_the_readme_states_the_recorded_figures(readme: str, record: dict[str, Any]) -> None:
    assert figures.differences(readme, record) == []


def test_every_figure_of_the_dpo_paragraph_and_the_transcript_is_compared(readme: str, record: dict[str, Any]) -> None:
    stated = figures.stated_figures(readme)
    assert set(stated) == set(record["dpo"]) == {"accuracy_200", "accuracy_100", "loss_200", "margin_200",
                                                 "other_accuracy_200", "other_loss_200"}
    shown = figures.transcript(readme)
    assert len(shown) >= 20 and any(line.startswith("done: 200 steps") for line in shown)
    # what the masks leave to compare: the losses, learning rates and gradient norms of every row shown
    rows = [figures.masked(line) for line in shown if line.startswith("iteration ") and "| loss " in line]
    assert rows and all("| lr " in row and "| grad norm " in row and "tokens/s <t>" in row for row in rows)


@pytest.mark.parametrize(("old", "new", "named"), [
    ("`eval/rewards/accuracy` **0.825**", "`eval/rewards/accuracy` **0.900**", "accuracy_200: the README says 0.900"),
    ("reward margin 1.71.", "reward margin 1.91.", "margin_200: the README says 1.91"),
    ("| loss 8.872804 |", "| loss 8.899609 |", "the README shows 'iteration 10/200 | loss 8.899609"),
    ("  last        train loss 6.2948,", "  last        train loss 6.3256,", "train loss 6.3256"),
])
def test_a_figure_the_run_did_not_give_is_named(readme: str, record: dict[str, Any], old: str, new: str,
                                                named: str) -> None:
    assert readme.count(old) == 1, old
    found = figures.differences(readme.replace(old, new), record)
    assert len(found) == 1 and named in found[0], found


def test_lines_out_of_order_are_named(readme: str, record: dict[str, Any]) -> None:
    """The README showed the evaluation before the checkpoint save of the same step; the loop saves first."""
    shown = figures.transcript(readme)
    save = next(i for i, line in enumerate(shown) if line.startswith("saved step checkpoint"))
    swapped = [*shown[:save], shown[save + 1], shown[save], *shown[save + 2:]]
    found = figures.transcript_differences(swapped, record["quick_start_console"])
    assert found and "before the line above it" in found[0], found


def test_the_record_holds_the_tests_shortened_run(record: dict[str, Any]) -> None:
    short = record["quick_start_60"]
    assert sorted(map(int, short["train/lm_loss"])) == list(range(10, figures.ITERS + 1, 10))
    assert sorted(map(int, short["eval/lm_loss"])) == [30, 60] and list(short["test/lm_loss"]) == ["60"]
