"""The engine's KV cache in the operator: the pods report it, the budget search simulates it,
``status.kvCache`` shows it."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from slipstream_operator.api import InferenceServiceSpec, InferenceServiceStatus
from slipstream_operator.budgets import (
    AnalyticSearch,
    BudgetParams,
    BudgetSearch,
    LoadStats,
    ObservedSLO,
    SearchResult,
    SLOTargets,
)
from slipstream_operator.observe import WindowStats
from slipstream_operator.reconcile_service import (
    ObjectRef,
    PodView,
    ServiceMemory,
    ServiceObserved,
    reconcile_service,
)
from slipstream_operator.searchpool import SearchSubject
from slipstream_operator.sidecar_client import (
    KvCacheReport,
    LearnedLatency,
    SidecarStatus,
    status_from_pb,
)
from slipstream_operator.simsearch import KvSize, SimSearchParams, service_kv, simulated_engine
from slipstream_scheduler.latency import FeatureSet, LinearLatencyModel
from slipstream_scheduler.types import EngineLimits
from slipstream_sidecar.proto import sidecar_pb2 as pb

pytestmark = pytest.mark.unit

MODEL = LinearLatencyModel(
    feature_set=FeatureSet.CONTEXT,
    coefficients=(0.011, 7e-5, 0.0, 0.0, 1.7e-4, 0.0, 3e-8, 0.0),
)
PARAMS = SimSearchParams(horizon_s=10.0, iterations=2, min_online_requests=10, search_idle=False)
LOAD = LoadStats(arrival_rate_rps=2.0, mean_prompt_tokens=1000.0, mean_output_tokens=200.0)


def test_a_status_reply_carries_the_pods_kv_cache() -> None:
    msg = pb.StatusResponse(
        kv_cache=pb.KvCache(
            num_blocks=8192, block_size=128, num_blocks_source="engine", block_size_source="engine"
        )
    )
    kv = status_from_pb(msg).kv_cache
    assert kv == KvCacheReport(8192, 128, "engine", "engine") and kv.from_engine
    assert status_from_pb(pb.StatusResponse()).kv_cache is None  # a sidecar before the field
    assert status_from_pb(pb.StatusResponse(kv_cache=pb.KvCache())).kv_cache is None


def test_the_pods_engines_win_then_the_args() -> None:
    args = ["--num-gpu-blocks-override", "3000", "--block-size", "32"]
    assert service_kv(args, [(8192, 128), (9000, 128)]) == KvSize(8192, 128, "engine")
    assert service_kv(args, [(1000, 128), (4000, 16)]) == KvSize(4000, 16, "engine")  # tokens
    assert service_kv(args, []) == KvSize(3000, 32, "args")
    assert service_kv(["--num-gpu-blocks-override=70"], []) == KvSize(70, 16, "args")
    assert service_kv([], []) is None


def test_the_simulated_engine_takes_the_engines_blocks_with_or_without_a_gpu_profile() -> None:
    limits = EngineLimits(block_size=128)
    profiled, timed = simulated_engine(
        "meta-llama/Llama-2-7b-hf", "h100", limits, PARAMS, kv_blocks=8192
    )
    assert not timed and profiled.num_gpu_blocks == 8192 and profiled.block_size == 128
    sized, _ = simulated_engine("meta-llama/Llama-2-7b-hf", "h100", limits, PARAMS)
    assert sized.num_gpu_blocks is None  # the GPU profile sizes it from memory
    learned, timed = simulated_engine("acme/Unprofiled-9b", "h100", limits, PARAMS, kv_blocks=8192)
    assert timed and learned.num_gpu_blocks == 8192 and learned.block_size == 128


class Recorder:
    def __init__(self) -> None:
        self.subjects: list[SearchSubject] = []

    def __call__(self, s: SearchSubject) -> BudgetSearch:
        self.subjects.append(s)

        def search(targets: SLOTargets, load: LoadStats) -> SearchResult:
            return AnalyticSearch(s.calibrated, s.limits)(targets, load)

        return search


def pod(name: str, kv: KvCacheReport | None, *, ready: bool = True) -> PodView:
    report = LearnedLatency(
        MODEL,
        source="learned",
        fit_steps=1234,
        seen_steps=1300,
        heldout_mape=0.031,
        revision=3,
        fitted_at=1.7e9,
    )
    status = SidecarStatus(
        generation=0,
        engine_ready=ready,
        draining=False,
        spare_capacity=0.5,
        budget_s=None,
        learned=report,
        kv_cache=kv,
    )
    return PodView(name, "127.1.0.9", True, status)


def reconcile(
    args: list[str], pods: tuple[PodView, ...]
) -> tuple[SearchSubject, dict[str, object]]:
    spec = InferenceServiceSpec.model_validate(
        {
            "model": "acme/Unprofiled-9b",
            "engine": {"image": "vllm/vllm-openai:v0.11.0", "args": args},
            "replicas": len(pods),
            "slo": {"tbt": {"p99": "100ms"}},
        }
    )
    window = WindowStats(observed=ObservedSLO(samples=100, tbt_p99_s=0.05), load=LOAD, span_s=60.0)
    observed = ServiceObserved(
        pods=pods, token="tok", window=window, latency_model=None, profile=""
    )
    search = Recorder()
    outcome = reconcile_service(
        ObjectRef("chat", "team-a", "uid-1", 3),
        spec,
        observed,
        ServiceMemory(),
        previous_status={},
        now=datetime(2026, 1, 1, tzinfo=UTC),
        now_s=0.0,
        params=BudgetParams(min_samples=5),
        search_for=search,
    )
    (subject,) = search.subjects
    InferenceServiceStatus.model_validate(outcome.status)  # what the CRD's schema takes
    return subject, outcome.status


def test_the_budget_search_simulates_the_kv_cache_the_pods_read_from_their_engines() -> None:
    pods = (
        pod("chat-0", KvCacheReport(8192, 128, "engine", "engine")),
        pod("chat-1", KvCacheReport(7000, 128, "engine", "engine")),
        pod("chat-2", KvCacheReport(8192, 16, "default", "default")),  # not read: ignored
        pod("chat-3", KvCacheReport(10, 128, "engine", "engine"), ready=False),  # not ready
        pod("chat-4", None),  # a sidecar that predates the field
    )
    subject, status = reconcile(["--num-gpu-blocks-override", "3000"], pods)
    assert subject.kv_blocks == 7000 and subject.limits.block_size == 128
    assert status["kvCache"] == {"blocks": 7000, "blockSize": 128, "source": "engine"}


def test_without_a_pod_report_the_args_say_and_else_nothing_does() -> None:
    subject, status = reconcile(["--num-gpu-blocks-override", "3000"], (pod("chat-0", None),))
    assert subject.kv_blocks == 3000 and subject.limits.block_size == 16
    assert status["kvCache"] == {"blocks": 3000, "blockSize": 16, "source": "args"}
    subject, status = reconcile([], (pod("chat-0", None),))
    assert subject.kv_blocks is None and "kvCache" not in status
