"""Condition bookkeeping (metav1.Condition semantics) on plain status dicts.

Conditions are keyed by ``type``. :func:`set_condition` replaces one in a list
and returns whether anything a reader cares about changed; it moves
``lastTransitionTime`` only when ``status`` flips, so a condition that stays
True for a week keeps the time it became True even though the operator
rewrites it every few seconds.

Deliberately left out: sorting (order of first appearance is kept) and
pruning of unknown types (the CRD bounds the list to eight).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from slipstream_operator.api import ConditionStatus


def rfc3339(moment: datetime) -> str:
    """The wire form of a timestamp: UTC, whole seconds, ``Z`` suffix."""
    utc = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    return utc.strftime("%Y-%m-%dT%H:%M:%SZ")


def find_condition(conditions: list[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    """The condition of ``type_``, or None."""
    return next((c for c in conditions if c.get("type") == type_), None)


def set_condition(
    conditions: list[dict[str, Any]],
    type_: str,
    status: ConditionStatus | bool,
    *,
    reason: str,
    message: str,
    now: datetime,
    observed_generation: int,
) -> bool:
    """Set one condition in place. Returns True when status, reason, message or generation changed.

    ``status`` may be a bool (True/False). ``lastTransitionTime`` is set to
    ``now`` only when the condition is new or its status flips.
    """
    if isinstance(status, bool):
        status = ConditionStatus.TRUE if status else ConditionStatus.FALSE
    wanted = {
        "type": type_,
        "status": status.value,
        "reason": reason,
        "message": message,
        "observedGeneration": observed_generation,
    }
    current = find_condition(conditions, type_)
    if current is None:
        conditions.append({**wanted, "lastTransitionTime": rfc3339(now)})
        return True
    flipped = current.get("status") != wanted["status"]
    changed = flipped or any(current.get(k) != v for k, v in wanted.items())
    current.update(wanted)
    if flipped or "lastTransitionTime" not in current:
        current["lastTransitionTime"] = rfc3339(now)
    return changed


def is_true(conditions: list[dict[str, Any]], type_: str) -> bool:
    found = find_condition(conditions, type_)
    return found is not None and found.get("status") == ConditionStatus.TRUE.value
