"""The engine channel's documents: round trips, and bad input named by field."""

from __future__ import annotations

import math

import pytest

from slipstream_scheduler.enginecontrol import (
    ClassCounts,
    ControlFormatError,
    CumulativeHistogram,
    EngineControl,
    EngineReport,
    decode_control,
    decode_report,
)

pytestmark = pytest.mark.unit


def test_control_round_trips_with_an_unbounded_idle_budget() -> None:
    doc = EngineControl(generation=7, budget_s=0.03, idle_budget_s=math.inf, ordering="gittins")
    back = decode_control(doc.encode())
    assert back == doc and math.isinf(back.idle_budget_s or 0.0)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"generation": -1}', "generation"),
        ('{"generation": 1, "budget_s": 0}', "budget_s"),
        ('{"generation": 1, "idle_budget_s": -2}', "idle_budget_s"),
        ('{"generation": 1, "offline_order": "lifo"}', "offline_order"),
        ('{"generation": 1, "surprise": true}', "surprise"),
        ('{"version": 2, "generation": 1}', "version"),
    ],
)
def test_a_bad_control_document_names_its_field(text: str, field: str) -> None:
    with pytest.raises(ControlFormatError) as exc:
        decode_control(text)
    assert exc.value.field == field
    assert str(exc.value).startswith(field)


def test_not_json_or_not_an_object_is_refused() -> None:
    for text in ("{", "[1, 2]", ""):
        with pytest.raises(ControlFormatError):
            decode_control(text)


def test_report_round_trips_with_histograms() -> None:
    h = CumulativeHistogram(upper_bounds=(0.1, math.inf), cumulative_counts=(2.0, 3.0),
                            sum=0.4, count=3.0)
    rep = EngineReport(generation=2, online_counts=ClassCounts(ttft=h, finished_ok=3.0))
    back = decode_report(rep.model_dump_json())
    assert back.online_counts.ttft.upper_bounds[-1] == math.inf
    assert back == rep
