"""Slipstream operator: kopf handlers for InferenceService and OfflineJob.

The pydantic models in ``api`` are the source of truth for the CRDs. The
reconcilers are pure functions ``(spec, observed, now) -> (children, status)``;
``handlers`` is the thin kopf shell that applies them. See ``docs/operator.md``.
"""

from slipstream_operator.api import (
    API_VERSION,
    GROUP,
    VERSION,
    Condition,
    InferenceService,
    InferenceServiceSpec,
    InferenceServiceStatus,
    OfflineJob,
    OfflineJobSpec,
    OfflineJobStatus,
    format_duration,
    parse_duration,
)
from slipstream_operator.budgets import AnalyticSearch, BudgetParams, decide
from slipstream_operator.errors import (
    InputError,
    OperatorError,
    OutputError,
    SidecarError,
    SpecError,
)
from slipstream_operator.reconcile_job import reconcile_job
from slipstream_operator.reconcile_service import reconcile_service
from slipstream_operator.settings import OperatorSettings
from slipstream_operator.shards import Plan, PlanOptions, merge_outputs, plan_input

__all__ = [
    "API_VERSION",
    "GROUP",
    "VERSION",
    "AnalyticSearch",
    "BudgetParams",
    "Condition",
    "InferenceService",
    "InferenceServiceSpec",
    "InferenceServiceStatus",
    "InputError",
    "OfflineJob",
    "OfflineJobSpec",
    "OfflineJobStatus",
    "OperatorError",
    "OperatorSettings",
    "OutputError",
    "Plan",
    "PlanOptions",
    "SidecarError",
    "SpecError",
    "decide",
    "format_duration",
    "merge_outputs",
    "parse_duration",
    "plan_input",
    "reconcile_job",
    "reconcile_service",
]
