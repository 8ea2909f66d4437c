"""InferenceService reconciler: children, conditions, budget pushes and generations."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from slipstream_operator.api import DEFAULT_SIDECAR_IMAGE, InferenceServiceSpec
from slipstream_operator.budgets import (
    AnalyticSearch,
    BudgetParams,
    BudgetSearch,
    LoadStats,
    ObservedSLO,
    SearchResult,
    SLOTargets,
    TrialRecord,
)
from slipstream_operator.calibration import CalibrationParams
from slipstream_operator.observe import WindowStats
from slipstream_operator.reconcile_service import (
    ObjectRef,
    PodView,
    ServiceMemory,
    ServiceObserved,
    _fingerprint,
    reconcile_service,
)
from slipstream_operator.searchpool import SearchSubject
from slipstream_operator.settings import OperatorSettings
from slipstream_operator.sidecar_client import SidecarStatus
from slipstream_scheduler.latency import FeatureSet, LinearLatencyModel

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)
MODEL = LinearLatencyModel(
    feature_set=FeatureSet.CONTEXT,
    coefficients=(0.008, 6e-5, 0.0, 0.0, 1.5e-4, 0.0, 2e-8, 0.0),
)
REF = ObjectRef("chat", "team-a", "uid-1", 3)
PARAMS = BudgetParams(min_samples=5)


def spec(**overrides: Any) -> InferenceServiceSpec:
    doc: dict[str, Any] = {
        "model": "meta-llama/Llama-2-7b-hf",
        "engine": {"image": "vllm/vllm-openai:v0.11.0", "args": ["--max-num-seqs", "128"]},
        "replicas": 2,
        "slo": {"tbt": {"p99": "100ms"}, "ttft": {"p99": "2s"}},
    }
    doc.update(overrides)
    return InferenceServiceSpec.model_validate(doc)


def pod(name: str, generation: int = 0, ready: bool = True) -> PodView:
    return PodView(name, f"127.1.0.{len(name)}", True,
                   SidecarStatus(generation=generation, engine_ready=ready, draining=False,
                                 spare_capacity=0.5, budget_s=None))


def window(samples: int = 100, tbt_p99: float = 0.05, ttft_p99: float = 0.8) -> WindowStats:
    return WindowStats(
        observed=ObservedSLO(samples=samples, tbt_p99_s=tbt_p99, ttft_p99_s=ttft_p99,
                             tbt_mean_s=tbt_p99 / 2, ttft_mean_s=ttft_p99 / 2),
        load=LoadStats(2.0, 1000.0, 200.0),
        span_s=60.0,
    )


def search_for(subject: SearchSubject) -> BudgetSearch:
    return AnalyticSearch(subject.calibrated)


def run(observed: ServiceObserved, memory: ServiceMemory | None = None,
        previous: dict[str, Any] | None = None, s: InferenceServiceSpec | None = None,
        at: datetime = T0, at_s: float = 0.0) -> Any:
    return reconcile_service(REF, s or spec(), observed, memory or ServiceMemory(),
                             previous_status=previous or {},
                             now=at, now_s=at_s, params=PARAMS, search_for=search_for)


def observed(pods: tuple[PodView, ...], win: WindowStats | None = None,
             model: LinearLatencyModel | None = MODEL) -> ServiceObserved:
    return ServiceObserved(pods=pods, token="tok", window=win, latency_model=model,
                           profile="shipped:test.json" if model else "")


def test_children_are_owned_and_wire_the_pod_as_the_issue_says() -> None:
    out = run(observed(()))
    kinds = [c["kind"] for c in out.children]
    assert kinds == ["Secret", "ConfigMap", "Deployment", "Service"]
    for child in out.children:
        owner = child["metadata"]["ownerReferences"][0]
        assert owner["uid"] == "uid-1" and owner["controller"] is True
        assert owner["apiVersion"] == "slipstream.dev/v1alpha1"
        assert child["metadata"]["namespace"] == "team-a"
    deployment = out.children[2]
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    args = containers["vllm"]["args"]
    assert args[args.index("--scheduling-policy") + 1] == "priority"
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--port") + 1] == "8001"
    assert args[-2:] == ["--max-num-seqs", "128"]
    assert containers["vllm"]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    ports = {p["name"]: p["containerPort"] for p in containers["sidecar"]["ports"]}
    assert ports == {"http": 8000, "grpc": 9000}
    assert deployment["spec"]["replicas"] == 2
    assert out.children[0]["stringData"]["token"] == "tok"
    assert "latency.json" in out.children[1]["data"]
    service = out.children[3]
    assert service["spec"]["ports"][0]["port"] == 8000


def test_children_are_rendered_again_only_when_what_they_come_from_changes() -> None:
    first = run(observed(()))
    again = run(observed(()), memory=first.memory)
    assert again.children is first.children  # the same objects: nothing rebuilt
    other_token = run(replace(observed(()), token="tok-2"), memory=first.memory)
    assert other_token.children is not first.children
    assert other_token.children[0]["stringData"]["token"] == "tok-2"
    bigger = run(observed(()), memory=first.memory, s=spec(replicas=3))
    assert bigger.children[2]["spec"]["replicas"] == 3
    no_model = run(observed((), model=None), memory=first.memory)
    assert "latency.json" not in no_model.children[1]["data"]
    # A rendering that is reused is equal to one made from scratch.
    assert again.children == run(observed(())).children


def test_no_pods_no_statistics() -> None:
    out = run(observed(()))
    conds = {c["type"]: c for c in out.status["conditions"]}
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "NoReplicasReady"
    assert conds["SLOMet"]["status"] == "Unknown"
    assert conds["SLOMet"]["reason"] == "InsufficientSamples"
    assert conds["BudgetReady"]["reason"] == "AwaitingLoadStatistics"
    assert out.pushes == () and "budget" not in out.status
    assert out.status["observedGeneration"] == 3


def test_budget_is_searched_and_pushed_to_ready_pods_behind_the_generation() -> None:
    pods = (pod("a"), pod("b"), pod("c", ready=False))
    out = run(observed(pods, window()))
    assert [name for name, _ in out.pushes] == ["a", "b"]
    call = out.pushes[0][1]
    assert call.generation == 1 and call.budget_s is not None and 0 < call.budget_s <= 0.09 + 1e-9
    assert call.tbt_p99_s == pytest.approx(0.1) and call.ordering == "gittins"
    assert call.latency_kind == "context" and call.latency_coefficients["const"] == 0.008
    status = out.status
    assert status["budget"]["reason"] == "Searched"
    assert status["budget"]["configGeneration"] == 1
    assert status["readyReplicas"] == 2 and status["replicas"] == 3
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Ready"]["status"] == "True"
    assert conds["BudgetReady"]["status"] == "False" and conds["BudgetReady"]["reason"] == "Pushing"
    assert conds["SLOMet"]["status"] == "True" and conds["SLOMet"]["reason"] == "WithinTarget"
    assert status["observed"]["tbtP99"] == "50ms" and status["observed"]["ttftP99"] == "800ms"
    assert out.events[0][:2] == ("Normal", "BudgetSearched")

    # Next tick: the pods acknowledged generation 1; nothing changed, nothing to push.
    acked = (pod("a", 1), pod("b", 1), pod("c", ready=False))
    again = run(observed(acked, window()), out.memory, out.status, at=T0 + timedelta(seconds=5),
                at_s=5.0)
    assert again.pushes == ()
    conds = {c["type"]: c for c in again.status["conditions"]}
    assert conds["BudgetReady"]["status"] == "True"
    assert again.status["budget"]["configGeneration"] == 1


def test_a_missed_slo_tightens_bumps_the_generation_and_flags_the_metric() -> None:
    pods = (pod("a"), pod("b"))
    first = run(observed(pods, window()))
    acked = (pod("a", 1), pod("b", 1))
    missed = run(observed(acked, window(tbt_p99=0.14)), first.memory, first.status,
                 at=T0 + timedelta(seconds=5), at_s=5.0)
    conds = {c["type"]: c for c in missed.status["conditions"]}
    assert conds["SLOMet"]["status"] == "False"
    assert conds["SLOMet"]["reason"] == "TBTP99Exceeded"
    assert missed.status["sloSummary"] == "tbt-p99 140ms/100ms"
    assert missed.status["budget"]["reason"] == "Tightened"
    assert [c.generation for _, c in missed.pushes] == [2, 2]
    assert missed.pushes[0][1].budget_s == pytest.approx(first.pushes[0][1].budget_s * 0.7)
    assert ("Warning", "SLOMissed") in [e[:2] for e in missed.events]


def test_after_an_operator_restart_generations_continue_from_the_pods() -> None:
    pods = (pod("a", 7), pod("b", 7))
    out = run(observed(pods, window()), ServiceMemory(), {"budget": {"configGeneration": 5}})
    assert {c.generation for _, c in out.pushes} == {8}


def test_no_latency_profile_means_no_budget() -> None:
    out = run(observed((pod("a"),), window(), model=None))
    conds = {c["type"]: c for c in out.status["conditions"]}
    assert conds["BudgetReady"]["reason"] == "NoLatencyModel"
    assert out.pushes[0][1].budget_s is None  # SLOs and ordering still go out
    assert "latency.json" not in out.children[1]["data"]


def test_scaled_to_zero_is_ready() -> None:
    out = run(observed(()), s=spec(replicas=0))
    conds = {c["type"]: c for c in out.status["conditions"]}
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["reason"] == "ScaledToZero"


def test_co_location_off_pushes_a_zero_budget() -> None:
    out = run(observed((pod("a"),), window()),
              s=spec(scheduling={"ordering": "fcfs", "coLocation": False}))
    call = out.pushes[0][1]
    assert call.budget_s == 0.0 and call.ordering == "fcfs"


def test_the_pushed_latency_model_carries_its_hinge_knee() -> None:
    # The shipped profiles use the hinge feature set; without its knee the sidecar
    # would rebuild a different (more conservative) model than the operator fitted.
    hinged = LinearLatencyModel(
        FeatureSet.CONTEXT_CHUNK_HINGE,
        (0.008, 3e-05, 1e-09, 0.0, 0.0003, 0.0, 2e-07, 1e-10, 2e-05),
        knee_tokens=192,
    )
    out = run(observed((pod("a"),), window(), model=hinged))
    call = out.pushes[0][1]
    assert call.latency_kind == "context+chunk+hinge"
    assert call.latency_knee_tokens == 192
    assert call.latency_coefficients["tokens_over_knee"] == pytest.approx(2e-05)


def test_the_pushed_latency_model_carries_the_shipped_token_curve() -> None:
    # The shipped profiles are token-curve models (schema 3): the sidecar refuses a
    # curve kind without its curve, so the operator must send the knots and their
    # step, and a change of curve alone must be a new configuration.
    from slipstream_operator.profiles import find_profile

    profile = find_profile("meta-llama/Llama-2-7b-hf", "a100")
    assert profile is not None
    curved = profile.model
    assert curved.token_curve, "the shipped profile is expected to carry a token curve"
    out = run(observed((pod("a"),), window(), model=curved))
    call = out.pushes[0][1]
    assert call.latency_kind == curved.feature_set.value
    assert tuple(call.latency_token_curve) == tuple(curved.token_curve)
    assert call.latency_curve_step_tokens == curved.curve_step_tokens > 0
    bent = replace(curved, token_curve=(*curved.token_curve[:-1], curved.token_curve[-1] * 2))
    again = run(observed((pod("a"),), window(), model=bent))
    assert again.pushes[0][1].latency_token_curve != call.latency_token_curve
    assert _fingerprint(again.pushes[0][1]) != _fingerprint(call)


def test_storage_roots_reach_the_sidecar_only_when_configured() -> None:
    def sidecar_env(obs: ServiceObserved) -> dict[str, str]:
        deployment = run(obs).children[2]
        containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
        return {e["name"]: e["value"] for e in containers["sidecar"]["env"]}

    assert "SLIPSTREAM_SIDECAR_STORAGE_ROOTS" not in sidecar_env(observed(()))
    roots = ("file:///store", "s3://batch")
    env = sidecar_env(replace(observed(()), storage_roots=roots))
    assert json.loads(env["SLIPSTREAM_SIDECAR_STORAGE_ROOTS"]) == list(roots)


def sidecar_container(out: Any) -> dict[str, Any]:
    deployment = next(c for c in out.children if c["kind"] == "Deployment")
    (sidecar,) = [c for c in deployment["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "sidecar"]
    return sidecar


def test_the_sidecar_image_is_the_services_else_the_operators_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Unset everywhere: the shipped default, as before the setting existed.
    assert sidecar_container(run(observed(())))["image"] == DEFAULT_SIDECAR_IMAGE
    assert spec().sidecar.image is None
    # The operator's setting (the chart's sidecar.image) as the handler passes it on.
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_SIDECAR_IMAGE", "registry.local/slipstream:7")
    settings = OperatorSettings()
    defaults = replace(observed(()), sidecar_image=settings.sidecar_image)
    assert sidecar_container(run(defaults))["image"] == "registry.local/slipstream:7"
    # A service that names its own image keeps it.
    pinned = spec(sidecar={"image": "team-a.local/sidecar:debug"})
    assert sidecar_container(run(defaults, s=pinned))["image"] == "team-a.local/sidecar:debug"
    with pytest.raises(ValidationError):
        spec(sidecar={"image": ""})


def test_the_sidecar_resources_are_the_services_else_the_operators_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert sidecar_container(run(observed(())))["resources"] == {
        "requests": {}, "limits": {}}
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_SIDECAR_RESOURCES",
                       '{"requests": {"cpu": "500m", "memory": "512Mi"}, '
                       '"limits": {"memory": "1Gi"}}')
    settings = OperatorSettings()
    defaults = replace(observed(()), sidecar_resources=settings.sidecar_resources)
    assert sidecar_container(run(defaults))["resources"] == {
        "requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
    # Any request or limit of the service's own replaces the default whole (never merged:
    # a limit below the default's request would make an invalid pod).
    own = spec(sidecar={"resources": {"limits": {"cpu": "2"}}})
    assert sidecar_container(run(defaults, s=own))["resources"] == {
        "requests": {}, "limits": {"cpu": "2"}}


def timed_pod(name: str, generation: int, predicted: float, observed_s: float) -> PodView:
    return PodView(name, "127.1.0.9", True,
                   SidecarStatus(generation=generation, engine_ready=True, draining=False,
                                 spare_capacity=0.5, budget_s=None, predicted_step_s=predicted,
                                 observed_step_s=observed_s, online_in_flight=3))


def test_slow_steps_refit_the_model_push_scaled_coefficients_and_search_again() -> None:
    cal = CalibrationParams(window=4, threshold=0.2)
    searched: list[float] = []

    def recording(subject: SearchSubject) -> BudgetSearch:
        searched.append(subject.scale)
        return AnalyticSearch(subject.calibrated)

    def tick(pods: tuple[PodView, ...], memory: ServiceMemory, previous: dict[str, Any],
             at_s: float) -> Any:
        return reconcile_service(REF, spec(), observed(pods, window()), memory,
                                 previous_status=previous, now=T0 + timedelta(seconds=at_s),
                                 now_s=at_s, params=PARAMS, search_for=recording,
                                 calibration=cal)

    first = tick((pod("a"), pod("b")), ServiceMemory(), {}, 0.0)
    slow = (timed_pod("a", 1, 0.040, 0.060), timed_pod("b", 1, 0.040, 0.060))
    second = tick(slow, first.memory, first.status, 5.0)  # 2 of 4 ratios: not yet
    assert second.memory.calibration.scale == 1.0 and second.pushes == ()
    third = tick(slow, second.memory, second.status, 10.0)
    assert third.memory.calibration.scale == pytest.approx(1.5)
    assert ("Normal", "LatencyModelRefit") in [e[:2] for e in third.events]
    assert third.status["budget"]["reason"] == "Searched"
    assert "x1.5 (refit)" in third.status["budget"]["profile"]
    assert searched[-1] == pytest.approx(1.5)
    call = third.pushes[0][1]
    assert call.generation == 2
    assert call.latency_coefficients["const"] == pytest.approx(0.008 * 1.5)
    assert third.memory.calibration.since_generation == 2
    # Pods still on generation 1 (old coefficients) do not count towards the next refit.
    fourth = tick(slow, third.memory, third.status, 15.0)
    assert fourth.memory.calibration.ratios == ()


class Unattainable:
    def __call__(self, targets: SLOTargets, load: LoadStats) -> SearchResult:
        return SearchResult(budget_s=0.03, floor_s=0.03, ceiling_s=0.15, source="simulated",
                            feasible=False,
                            trials=(TrialRecord(0.15, False, "tbt-p99 170ms/100ms"),
                                    TrialRecord(0.03, False, "tbt-p99 104ms/100ms")))


def test_an_unattainable_slo_pushes_the_online_only_budget_and_says_so() -> None:
    def search(subject: SearchSubject) -> BudgetSearch:
        return Unattainable()

    def tick(pods: tuple[PodView, ...], memory: ServiceMemory, previous: dict[str, Any]) -> Any:
        return reconcile_service(REF, spec(), observed(pods, window()), memory,
                                 previous_status=previous, now=T0, now_s=0.0, params=PARAMS,
                                 search_for=search)

    first = tick((pod("a"),), ServiceMemory(), {})
    assert first.pushes[0][1].budget_s == pytest.approx(0.03)
    kinds = [e[:2] for e in first.events]
    assert ("Normal", "BudgetSearched") in kinds and ("Warning", "SLOUnattainable") in kinds
    searched = next(e[2] for e in first.events if e[1] == "BudgetSearched")
    assert "2 trials" in searched and "tbt-p99 104ms/100ms" in searched
    done = tick((pod("a", 1),), first.memory, first.status)
    conds = {c["type"]: c for c in done.status["conditions"]}
    assert conds["BudgetReady"]["status"] == "True"
    assert conds["BudgetReady"]["reason"] == "SLOUnattainable"
    assert "no budget meets the SLOs" in conds["BudgetReady"]["message"]


def test_the_sidecar_gets_the_engine_batching_flags_the_spec_sets() -> None:
    def sidecar_env(args: list[str]) -> dict[str, str]:
        deployment = run(observed(()), s=spec(engine={"image": "vllm/vllm-openai:v0.11.0",
                                                      "args": args})).children[2]
        containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
        return {e["name"]: e["value"] for e in containers["sidecar"]["env"]
                if e["name"].startswith("SLIPSTREAM_SIDECAR_")}

    env = sidecar_env(["--max-num-seqs", "64", "--max-num-batched-tokens=4096",
                       "--long-prefill-token-threshold", "512", "--max-num-seqs=128"])
    assert env["SLIPSTREAM_SIDECAR_MAX_NUM_SEQS"] == "128"  # the last one wins, as in vLLM
    assert env["SLIPSTREAM_SIDECAR_MAX_NUM_BATCHED_TOKENS"] == "4096"
    assert env["SLIPSTREAM_SIDECAR_LONG_PREFILL_TOKEN_THRESHOLD"] == "512"
    assert "SLIPSTREAM_SIDECAR_BLOCK_SIZE" not in env
    # Flags the spec leaves out keep vLLM's defaults on both sides.
    assert not {k for k in sidecar_env(["--enable-prefix-caching"]) if "MAX_NUM" in k}


class TwoKnobs:
    def __call__(self, targets: SLOTargets, load: LoadStats) -> SearchResult:
        return SearchResult(budget_s=0.04, floor_s=0.03, ceiling_s=0.15, source="simulated",
                            trials=(TrialRecord(0.04, True, "tbt-p99 90ms/100ms", 0.2),),
                            idle_budget_s=0.2)


def test_the_searched_idle_budget_is_pushed_and_a_change_of_it_is_a_new_generation() -> None:
    def tick(s: InferenceServiceSpec, memory: ServiceMemory, search: Any) -> Any:
        return reconcile_service(REF, s, observed((pod("a"),), window()), memory,
                                 previous_status={}, now=T0, now_s=0.0, params=PARAMS,
                                 search_for=lambda subject: search)

    first = tick(spec(), ServiceMemory(), TwoKnobs())
    call = first.pushes[0][1]
    assert call.budget_s == pytest.approx(0.04) and call.idle_budget_s == pytest.approx(0.2)
    # The analytic answer has no idle budget: 0 is sent, so a pod drops one it had.
    analytic = tick(spec(), ServiceMemory(), AnalyticSearch(MODEL))
    assert analytic.pushes[0][1].idle_budget_s == 0.0
    # Co-location off: no offline work, idle or not.
    off = tick(spec(scheduling={"ordering": "fcfs", "coLocation": False}), ServiceMemory(),
               TwoKnobs())
    assert off.pushes[0][1].budget_s == 0.0 and off.pushes[0][1].idle_budget_s == 0.0


def test_the_services_max_wait_is_pushed_and_a_change_of_it_is_a_new_generation() -> None:
    def tick(s: InferenceServiceSpec, memory: ServiceMemory, status: dict[str, Any],
             acked: int) -> Any:
        return reconcile_service(REF, s, observed((pod("a", acked),), window()), memory,
                                 previous_status=status, now=T0, now_s=0.0, params=PARAMS,
                                 search_for=lambda subject: TwoKnobs())

    unset = tick(spec(), ServiceMemory(), {}, 0)
    assert unset.pushes[0][1].max_wait_s is None  # the pod derives it from the SLO
    same = tick(spec(), unset.memory, unset.status, 1)
    assert same.pushes == ()
    guarded = spec(scheduling={"ordering": "gittins", "maxWait": "1m30s"})
    changed = tick(guarded, unset.memory, unset.status, 1)
    assert [c.generation for _, c in changed.pushes] == [2]
    assert changed.pushes[0][1].max_wait_s == pytest.approx(90.0)
    off = tick(spec(scheduling={"ordering": "gittins", "maxWait": "0s"}), ServiceMemory(), {}, 0)
    assert off.pushes[0][1].max_wait_s == 0.0
