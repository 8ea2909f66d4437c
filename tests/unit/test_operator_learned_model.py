"""The latency model in force: a profile first, else a model the pods learned from their engine.

Pure: the reconciler, the model choice, the Status parsing and the simulated search's
subject, with no cluster and no sidecar.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from slipstream_operator import simsearch
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
from slipstream_operator.calibration import CalibrationParams
from slipstream_operator.modelchoice import LearnedParams, ModelInForce, choose_model
from slipstream_operator.observe import WindowStats
from slipstream_operator.reconcile_service import (
    ObjectRef,
    PodView,
    ServiceMemory,
    ServiceObserved,
    ServiceOutcome,
    reconcile_service,
)
from slipstream_operator.searchpool import BudgetSearches, SearchSubject
from slipstream_operator.settings import OperatorSettings
from slipstream_operator.sidecar_client import LearnedLatency, SidecarStatus, status_from_pb
from slipstream_operator.simsearch import SimSearchParams, SimulatedSearch
from slipstream_scheduler.latency import (
    FEATURE_NAMES,
    FeatureSet,
    LatencyModelMeta,
    LinearLatencyModel,
)
from slipstream_sidecar.proto import sidecar_pb2 as pb

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)
REF = ObjectRef("chat", "team-a", "uid-1", 3)
PARAMS = BudgetParams(min_samples=5)
PROFILE = LinearLatencyModel(
    feature_set=FeatureSet.CONTEXT,
    coefficients=(0.008, 6e-5, 0.0, 0.0, 1.5e-4, 0.0, 2e-8, 0.0),
)
LEARNED = LinearLatencyModel(
    feature_set=FeatureSet.CONTEXT,
    coefficients=(0.011, 7e-5, 0.0, 0.0, 1.7e-4, 0.0, 3e-8, 0.0),
)
REFIT = replace(LEARNED, coefficients=(0.013, *LEARNED.coefficients[1:]))


def spec(**overrides: Any) -> InferenceServiceSpec:
    doc: dict[str, Any] = {
        "model": "acme/Unprofiled-9b",
        "engine": {"image": "vllm/vllm-openai:v0.11.0", "args": ["--max-num-seqs", "128"]},
        "replicas": 2,
        "slo": {"tbt": {"p99": "100ms"}, "ttft": {"p99": "2s"}},
    }
    doc.update(overrides)
    return InferenceServiceSpec.model_validate(doc)


def learned(model: LinearLatencyModel | None = LEARNED, *, steps: int = 1234,
            mape: float = 0.031, revision: int = 3, source: str = "learned") -> LearnedLatency:
    return LearnedLatency(model, source=source, fit_steps=min(steps, 900), seen_steps=steps,
                          heldout_mape=mape, revision=revision, fitted_at=1.7e9)


def pod(name: str, report: LearnedLatency | None = None, *, generation: int = 0,
        ready: bool = True, predicted: float = 0.0, observed_s: float = 0.0) -> PodView:
    return PodView(name, "127.1.0.9", True, SidecarStatus(
        generation=generation, engine_ready=ready, draining=False, spare_capacity=0.5,
        budget_s=None, predicted_step_s=predicted, observed_step_s=observed_s,
        online_in_flight=3, learned=report))


def window() -> WindowStats:
    return WindowStats(
        observed=ObservedSLO(samples=100, tbt_p99_s=0.05, ttft_p99_s=0.8, tbt_mean_s=0.025,
                             ttft_mean_s=0.4),
        load=LoadStats(2.0, 1000.0, 200.0),
        span_s=60.0,
    )


def observed(pods: tuple[PodView, ...], *, profile: LinearLatencyModel | None = None,
             name: str = "shipped:latency_test_h100.json") -> ServiceObserved:
    return ServiceObserved(pods=pods, token="tok", window=window(), latency_model=profile,
                           profile=name if profile is not None else "")


class Recorder:
    """A search factory that records every subject and every search it answers."""

    def __init__(self) -> None:
        self.subjects: list[SearchSubject] = []
        self.searched: list[str] = []

    def __call__(self, subject: SearchSubject) -> BudgetSearch:
        self.subjects.append(subject)

        def search(targets: SLOTargets, load: LoadStats) -> SearchResult:
            self.searched.append(subject.profile)
            return AnalyticSearch(subject.calibrated, subject.limits)(targets, load)

        return search


def run(obs: ServiceObserved, memory: ServiceMemory | None = None, *,
        previous: dict[str, Any] | None = None, s: InferenceServiceSpec | None = None,
        at_s: float = 0.0, search: Recorder | None = None,
        learned_params: LearnedParams | None = None,
        calibration: CalibrationParams | None = None) -> ServiceOutcome:
    return reconcile_service(
        REF, s or spec(), obs, memory or ServiceMemory(), previous_status=previous or {},
        now=T0 + timedelta(seconds=at_s), now_s=at_s, params=PARAMS,
        search_for=search or Recorder(), calibration=calibration, learned=learned_params)


def conditions(out: ServiceOutcome) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in out.status["conditions"]}


def coefficients(model: LinearLatencyModel) -> dict[str, float]:
    return {n: c for n, c in zip(FEATURE_NAMES, model.coefficients, strict=True) if c != 0.0}


# ------------------------------------------------------------------ a learned model in force


def test_a_service_without_a_profile_gets_a_budget_from_the_learned_model() -> None:
    search = Recorder()
    pods = (pod("chat-0", learned(steps=900, mape=0.02, revision=1)),
            pod("chat-1", learned(steps=1234, mape=0.031, revision=3)))
    out = run(observed(pods), search=search)
    budget_ready = conditions(out)["BudgetReady"]
    assert budget_ready["reason"] == "Pushing"  # a budget, pushed to both pods
    assert "learned by pod chat-1 (revision 3, 1234 steps, held-out error 3.1 %)" in (
        budget_ready["message"])
    assert out.status["latencyModel"] == {"source": "learned", "name": "chat-1", "steps": 1234,
                                          "heldoutMAPE": 0.031, "revision": 3}
    assert InferenceServiceStatus.model_validate(out.status).latency_model is not None
    assert out.status["budget"]["profile"] == "learned:chat-1 r3"
    # The search ran with the learned model, uncalibrated, keyed by pod and revision.
    (subject,) = search.subjects
    assert subject.model is LEARNED and subject.scale == 1.0
    assert subject.profile == "learned:chat-1 r3"
    assert search.searched == ["learned:chat-1 r3"]
    # Every ready pod is configured with the model in force.
    assert [name for name, _ in out.pushes] == ["chat-0", "chat-1"]
    assert out.pushes[0][1].latency_coefficients == coefficients(LEARNED)
    assert out.pushes[0][1].budget_s == out.memory.budget.budget_s  # type: ignore[union-attr]
    learned_events = [e for e in out.events if e[1] == "LatencyModelLearned"]
    assert len(learned_events) == 1 and "chat-1" in learned_events[0][2]


def test_a_learned_model_never_reaches_the_configmap_or_the_pod_template() -> None:
    without = run(observed((pod("chat-0"),)))
    with_model = run(observed((pod("chat-0", learned()),)))
    assert with_model.status["latencyModel"]["source"] == "learned"
    # The pod template is unchanged (no rollout when a pod learns a model).
    assert with_model.children == without.children
    assert "latency.json" not in with_model.children[1]["data"]


def test_a_learned_model_is_not_calibrated() -> None:
    cal = CalibrationParams(window=3, threshold=0.1)
    memory = ServiceMemory()
    previous: dict[str, Any] = {}
    search = Recorder()
    for i in range(4):  # steps twice as slow as predicted, well past the window
        pods = (pod("chat-0", learned(), generation=i, predicted=0.04, observed_s=0.08),)
        out = run(observed(pods), memory, previous=previous, at_s=5.0 * i, search=search,
                  calibration=cal)
        memory, previous = out.memory, out.status
        assert all(e[1] != "LatencyModelRefit" for e in out.events)
    assert memory.calibration.scale == 1.0
    assert {s.scale for s in search.subjects} == {1.0}
    assert "scale" not in previous["latencyModel"]


def test_learned_models_of_pods_that_are_not_ready_are_ignored() -> None:
    out = run(observed((pod("chat-0", learned(), ready=False),)))
    assert conditions(out)["BudgetReady"]["reason"] == "NoLatencyModel"
    assert out.status["latencyModel"] == {"source": "none"}


# ------------------------------------------------------------------ not good enough yet


@pytest.mark.parametrize(("report", "message"), [
    (learned(steps=120), "learning from the engine: 120/200 steps (pod chat-0)"),
    (learned(mape=0.14), "learning from the engine: held-out error 14 % > 10 %"),
    (learned(None, steps=100), "learning from the engine: 100/200 steps (pod chat-0)"),
    (learned(steps=277, mape=0.26, revision=1, source="profiled"),
     "profiled at pod start on 277 rows, held-out error 26 %; the bar is 200 rows and 10 % "
     "(pod chat-0)"),
    (LearnedLatency(None, source="learned", fit_steps=0, seen_steps=5900, heldout_mape=1.22,
                    revision=0, fitted_at=0.0),
     "5900 steps seen, no fit has passed validation yet (the last one: held-out error 122 % "
     "on recent steps) (pod chat-0)"),
    (None, "learning from the engine: no ready pod reports a fitted model yet"),
])
def test_until_a_learned_model_is_good_enough_there_is_no_budget(
        report: LearnedLatency | None, message: str) -> None:
    search = Recorder()
    out = run(observed((pod("chat-0", report),)), search=search)
    budget_ready = conditions(out)["BudgetReady"]
    assert budget_ready["status"] == "False" and budget_ready["reason"] == "NoLatencyModel"
    assert budget_ready["message"].startswith(
        "no latency profile for acme/Unprofiled-9b on h100; ")
    assert message in budget_ready["message"]
    assert out.status["latencyModel"] == {"source": "none"}
    assert "budget" not in out.status and search.subjects == []
    assert all(e[1] != "LatencyModelLearned" for e in out.events)


def test_the_two_settings_decide_what_is_good_enough() -> None:
    settings = OperatorSettings()
    assert (settings.learned_max_mape, settings.learned_min_steps) == (0.10, 200)
    strict = LearnedParams(max_mape=0.02, min_steps=2000)
    loose = LearnedParams(max_mape=0.2, min_steps=100)
    pods = (pod("chat-0", learned(steps=1234, mape=0.14)),)
    assert conditions(run(observed(pods), learned_params=strict))["BudgetReady"][
        "reason"] == "NoLatencyModel"
    assert run(observed(pods), learned_params=loose).status["latencyModel"]["source"] == "learned"
    assert "1234/2000 steps" in conditions(run(observed(pods), learned_params=strict))[
        "BudgetReady"]["message"]


def test_the_settings_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_LEARNED_MAX_MAPE", "0.05")
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_LEARNED_MIN_STEPS", "500")
    settings = OperatorSettings()
    assert (settings.learned_max_mape, settings.learned_min_steps) == (0.05, 500)


# ------------------------------------------------------------------ which model wins


def test_a_profile_wins_over_a_learned_model() -> None:
    search = Recorder()
    out = run(observed((pod("chat-0", learned()),), profile=PROFILE), search=search)
    assert out.status["latencyModel"] == {"source": "shipped",
                                          "name": "shipped:latency_test_h100.json"}
    assert search.subjects[0].model is PROFILE
    assert out.status["budget"]["profile"] == "shipped:latency_test_h100.json"
    assert out.pushes[0][1].latency_coefficients == coefficients(PROFILE)
    assert "latency model shipped profile latency_test_h100.json" in (
        conditions(out)["BudgetReady"]["message"])
    assert all(e[1] != "LatencyModelLearned" for e in out.events)


def test_a_profile_timed_on_the_engine_reads_profiled_and_a_users_reads_user() -> None:
    timed = replace(PROFILE, meta=LatencyModelMeta(
        source="slipstream profile engine (vLLM 0.11.0, h100)"))
    profiled = run(observed((), profile=timed, name="user:latency_test_h100.json"))
    assert profiled.status["latencyModel"]["source"] == "profiled"
    user = run(observed((), profile=PROFILE, name="user:latency_test_h100.json"))
    assert user.status["latencyModel"]["source"] == "user"


def test_the_choice_among_pods_is_deterministic_and_sticky() -> None:
    params = LearnedParams()

    def chosen(reports: list[tuple[str, LearnedLatency | None]],
               held: ModelInForce | None = None) -> str:
        choice = choose_model(None, "", reports, params, held=held, what="m on g")
        assert choice.in_force is not None
        return choice.in_force.name

    most_steps = [("a", learned(steps=500)), ("b", learned(steps=900)), ("c", None)]
    assert chosen(most_steps) == chosen(list(reversed(most_steps))) == "b"
    tie = [("a", learned(mape=0.05)), ("b", learned(mape=0.02))]
    assert chosen(tie) == "b"
    assert chosen([("b", learned()), ("a", learned())]) == "a"
    # A pod whose model is too poor never wins, however many steps it has.
    assert chosen([("a", learned(steps=9000, mape=0.3)), ("b", learned(steps=300))]) == "b"
    # The model in force stays while its pod still reports a good one.
    held = choose_model(None, "", [("a", learned(steps=500))], params).in_force
    assert chosen(most_steps, held) == "a"
    assert chosen([("b", learned(steps=900))], held) == "b"  # its pod is gone


# ------------------------------------------------------------------ drift: new revisions


def test_a_new_revision_changes_the_model_key_and_searches_again() -> None:
    search = Recorder()
    first = run(observed((pod("chat-0", learned(revision=3)),)), search=search)
    same = run(observed((pod("chat-0", learned(revision=3), generation=1),)), first.memory,
               previous=first.status, at_s=5.0, search=search)
    assert search.searched == ["learned:chat-0 r3"]  # no new search for the same revision
    assert all(e[1] != "LatencyModelLearned" for e in same.events)
    assert same.pushes == ()
    drifted = run(observed((pod("chat-0", learned(REFIT, revision=4), generation=1),)),
                  same.memory, previous=same.status, at_s=10.0, search=search)
    assert search.searched == ["learned:chat-0 r3", "learned:chat-0 r4"]
    assert drifted.memory.budget is not None
    assert drifted.memory.budget.model_key == "learned:chat-0 r4"
    assert drifted.status["budget"]["profile"] == "learned:chat-0 r4"
    assert drifted.status["latencyModel"]["revision"] == 4
    events = [e for e in drifted.events if e[1] == "LatencyModelLearned"]
    assert len(events) == 1 and "revision 4" in events[0][2]
    # The refitted coefficients go to the pods at a new generation.
    ((_, call),) = drifted.pushes
    assert call.generation == 2 and call.latency_coefficients == coefficients(REFIT)


def test_a_pod_missing_one_reconcile_holds_its_model_and_does_not_announce_it_again() -> None:
    search = Recorder()
    first = run(observed((pod("chat-0", learned()),)), search=search)
    blip = run(observed((pod("chat-0", learned(), generation=1, ready=False),)), first.memory,
               previous=first.status, at_s=5.0, search=search)
    # The pods still run with the budget searched from it: it stays in force, and says why.
    assert blip.status["latencyModel"]["source"] == "learned"
    assert blip.status["latencyModel"]["held"] == (
        "learning from the engine: no ready pod reports a fitted model yet")
    assert blip.status["budget"]["profile"] == first.status["budget"]["profile"]
    assert "held: learning from the engine" in conditions(blip)["BudgetReady"]["message"]
    back = run(observed((pod("chat-0", learned(), generation=blip.memory.config_generation),)),
               blip.memory, previous=blip.status, at_s=10.0, search=search)
    assert back.status["latencyModel"]["source"] == "learned"
    assert "held" not in back.status["latencyModel"]
    assert all(e[1] != "LatencyModelLearned" for e in back.events)
    assert search.searched == ["learned:chat-0 r3"]


def test_a_newest_fit_that_does_not_pass_holds_the_model_in_force_until_one_does() -> None:
    search = Recorder()
    first = run(observed((pod("chat-0", learned()),)), search=search)
    worse = learned(REFIT, mape=0.25, revision=4)
    held = run(observed((pod("chat-0", worse, generation=1),)), first.memory,
               previous=first.status, at_s=5.0, search=search)
    model = held.status["latencyModel"]
    assert (model["revision"], model["heldoutMAPE"]) == (3, 0.031)  # the one that passed
    assert model["held"].startswith("learning from the engine: held-out error 25 % > 10 %")
    assert conditions(held)["BudgetReady"]["status"] == "True"
    assert held.pushes == () and search.searched == ["learned:chat-0 r3"]  # nothing re-searched
    better = learned(REFIT, mape=0.04, revision=5)
    fixed = run(observed((pod("chat-0", better, generation=1),)), held.memory,
                previous=held.status, at_s=10.0, search=search)
    assert fixed.status["latencyModel"]["revision"] == 5
    assert "held" not in fixed.status["latencyModel"]
    assert search.searched == ["learned:chat-0 r3", "learned:chat-0 r5"]


def test_turning_learned_models_off_does_not_hold_one() -> None:
    first = run(observed((pod("chat-0", learned()),)))
    off = run(observed((pod("chat-0", learned(), generation=1),)), first.memory,
              previous=first.status, at_s=5.0, s=spec(scheduling={"latencyModel": "profile"}))
    assert off.status["latencyModel"] == {"source": "none"}
    assert conditions(off)["BudgetReady"]["reason"] == "NoLatencyModel"


# ------------------------------------------------------------------ the simulated mode


def test_an_engine_mode_service_is_searched_in_the_simulators_in_engine_mode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    search = Recorder()
    run(observed((pod("chat-0", learned()),)), s=spec(scheduling={"enforcement": "engine"}),
        search=search)
    run(observed((pod("chat-0", learned()),)), search=search)
    engine_subject, sidecar_subject = search.subjects
    assert (engine_subject.mode, sidecar_subject.mode) == ("in-engine", "sidecar")
    assert engine_subject.key != sidecar_subject.key  # cached apart

    # The subject's mode reaches the search job and its SimConfig.
    jobs: list[SimulatedSearch] = []

    class Capture:
        def submit(self, job: SimulatedSearch, *args: Any) -> Future[SearchResult]:
            jobs.append(job)
            return Future()

    searches = BudgetSearches(SimSearchParams(), executor=Capture())  # type: ignore[arg-type]
    subject = replace(engine_subject, model_name="meta-llama/Llama-2-7b-hf", gpu="a100")
    assert searches.search_for(subject)(SLOTargets(tbt_p99_s=0.1), window().load).provisional
    (job,) = jobs
    assert job.mode == "in-engine"
    modes: list[str] = []

    def fake_simulate(workload: Any, config: Any, **kw: Any) -> Any:
        modes.append(config.mode)
        raise simsearch.SearchTimeoutError("enough")

    monkeypatch.setattr(simsearch, "simulate", fake_simulate)
    assert job(SLOTargets(tbt_p99_s=0.1), window().load).source == "analytic"
    assert modes == ["in-engine"]


def test_an_in_engine_search_runs_in_the_simulator() -> None:
    from slipstream_scheduler.engine.model import EngineConfig

    params = SimSearchParams(horizon_s=10.0, iterations=1, min_online_requests=10,
                             search_idle=False)
    result = SimulatedSearch(PROFILE, EngineConfig(model="llama-2-7b", gpu="a100"), params,
                             mode="in-engine")(SLOTargets(tbt_p99_s=0.1), window().load)
    assert result.source == "simulated" and result.trials


# ------------------------------------------------------------------ what the sidecar reports


def spec_pb(model: LinearLatencyModel) -> pb.LatencyModelSpec:
    return pb.LatencyModelSpec(kind=model.feature_set.value, coefficients=coefficients(model))


def test_status_carries_the_learned_model() -> None:
    reply = pb.StatusResponse(generation=2, engine_ready=True, learned_model=pb.LearnedModel(
        model=spec_pb(LEARNED), source="learned", fit_steps=1234, seen_steps=5000,
        heldout_mape=0.031, revision=3, fitted_at=1.7e9))
    report = status_from_pb(reply).learned
    assert report is not None and report.model is not None
    assert report.model.coefficients == LEARNED.coefficients
    assert (report.source, report.fit_steps, report.seen_steps, report.revision) == (
        "learned", 1234, 5000, 3)
    assert report.heldout_mape == pytest.approx(0.031) and report.fitted_at == 1.7e9
    assert status_from_pb(pb.StatusResponse(generation=2)).learned is None
    empty = status_from_pb(pb.StatusResponse(learned_model=pb.LearnedModel(seen_steps=40)))
    assert empty.learned is not None and empty.learned.model is None
    assert empty.learned.seen_steps == 40


@pytest.mark.parametrize("bad", [
    pb.LatencyModelSpec(kind="context", coefficients={"const": 0.01, "n_d": -1e-4}),
    pb.LatencyModelSpec(kind="context", coefficients={"const": 0.01, "warp": 1.0}),
    pb.LatencyModelSpec(kind="no-such-set", coefficients={"const": 0.01}),
    pb.LatencyModelSpec(kind="context", coefficients={"const": math.inf}),
])
def test_a_malformed_learned_model_is_ignored(bad: pb.LatencyModelSpec) -> None:
    reply = pb.StatusResponse(generation=2, engine_ready=True, learned_model=pb.LearnedModel(
        model=bad, source="learned", fit_steps=1234, heldout_mape=0.01, revision=7))
    status = status_from_pb(reply)  # no exception
    assert status.learned is not None and status.learned.model is None
    out = run(observed((PodView("chat-0", "127.1.0.9", True, status),)))
    assert conditions(out)["BudgetReady"]["reason"] == "NoLatencyModel"
    assert out.status["latencyModel"] == {"source": "none"}


# ------------------------------------------------------------------ spec.scheduling.latencyModel


@pytest.mark.parametrize(("policy", "message"), [
    ("none", "spec.scheduling.latencyModel is none: offline work fills free capacity"),
    ("profile", "spec.scheduling.latencyModel is profile (learned models off)"),
])
def test_the_service_can_turn_learned_models_or_every_model_off(
        policy: str, message: str) -> None:
    search = Recorder()
    s = spec(scheduling={"latencyModel": policy})
    out = run(observed((pod("chat-0", learned()),)), s=s, search=search)
    budget_ready = conditions(out)["BudgetReady"]
    assert budget_ready["reason"] == "NoLatencyModel" and message in budget_ready["message"]
    assert out.status["latencyModel"] == {"source": "none"} and search.subjects == []
    assert all(p[1].latency_coefficients == {} for p in out.pushes)


def test_latency_model_profile_still_uses_a_profile() -> None:
    s = spec(scheduling={"latencyModel": "profile"})
    out = run(observed((pod("chat-0", learned()),), profile=LEARNED), s=s)
    assert out.status["latencyModel"]["source"] != "learned"
    assert conditions(out)["BudgetReady"]["reason"] != "NoLatencyModel"
    none = run(observed((pod("chat-0", learned()),), profile=LEARNED),
               s=spec(scheduling={"latencyModel": "none"}))
    assert conditions(none)["BudgetReady"]["reason"] == "NoLatencyModel"
