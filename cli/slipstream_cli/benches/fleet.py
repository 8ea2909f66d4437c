"""``slipstream bench fleet``: the operator at fleet scale, and the simulator at fleet size.

Two parts, each optional:

* **cluster** -- for each node count (``--nodes 100,250,500,1000``) a fresh local
  cluster of that many kwok GPU nodes (own state dir and ports, so it never
  meets the test cluster), the issue's ratios of InferenceServices (4 pods
  each) and OfflineJobs (500 shards each), the real operator process and the
  stand-in for the sidecars (:mod:`slipstream_testbed.fleet`). Measures time to
  all Ready and all shards placed, status lag, the operator's CPU, RSS and API
  requests per second. A scale that fails (time-out) ends the escalation; the
  scales reached are reported as a trend.
* **sim** -- 64 engine models, the Azure conversation trace (rate-scaled) routed
  to them and MMLU offline jobs cut into shards and placed on them
  (:mod:`slipstream_scheduler.sim.fleet`), under the baseline
  (round-robin + even) and Slipstream's (least-work + spare) decisions; the
  per-request cost of the fleet decisions is timed here (wall clock), at 8 to
  64 engines, next to the whole replay's cost per request.

Writes ``--json`` (keys ``nodes``, ``services``, ``pods``, ``shards``,
``ready_s``, ``status_lag_p99_s``, ``operator_cpu_cores``, ``operator_rss_mb``,
``api_rps`` for the largest scale reached, ``scales`` for all, ``sim``), a
Markdown table (``--md``) and a PNG of the trend (``--png``).

Deliberately left out: assertions (the e2e test checks correctness) and
re-running a scale to average (one run per scale; the trend is the result).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
DOCS = REPO / "docs" / "benchmarks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=DOCS / "fleet.json", help="results JSON")
    parser.add_argument("--md", type=Path, default=DOCS / "fleet.md",
                        help="Markdown file whose results block (between the markers) is "
                        "rewritten; created with only that block when missing")
    parser.add_argument("--png", type=Path, default=DOCS / "fleet.png", help="trend plot")
    parser.add_argument("--nodes", default="100,250,500,1000",
                        help="comma-separated node counts, smallest first")
    parser.add_argument("--interval", type=float, default=5.0,
                        help="operator reconcile interval, s (default 5, the operator's)")
    parser.add_argument("--label", default="",
                        help="tag each scale row with this operator label (kept in the JSON)")
    parser.add_argument("--operator-threads", type=int, default=0,
                        help="experiment: the operator's default thread pool size "
                        "(0: unchanged, min(32, CPUs + 4))")
    parser.add_argument("--operator-shards", type=int, default=1,
                        help="run this many operators, each watching its own share of the "
                        "run's namespaces (round-robin); CPU, RSS and API requests are summed "
                        "(default 1: one cluster-wide operator)")
    parser.add_argument("--no-status-counters", dest="status_counters", action="store_false",
                        help="experiment: the stand-in answers Status without online_counters, "
                        "as sidecars before them did, so the operator scrapes every pod's "
                        "/metrics each tick (the earlier rows' cost)")
    parser.add_argument("--bumps", type=int, default=3, help="status-lag probes per scale")
    parser.add_argument("--lag-probe", choices=("watch", "list"), default="watch",
                        help="how the bench sees a status change: a watch (stamped on arrival) "
                        "or LIST polling (adds up to one LIST period)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds a scale may take to become ready")
    parser.add_argument("--state-dir", type=Path,
                        default=Path.home() / ".cache" / "slipstream" / "fleet-cluster",
                        help="cluster state dir for the bench (not the tests')")
    parser.add_argument("--port-base", type=int, default=24000,
                        help="first of the 6 loopback ports of the bench cluster")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/slipstream-fleet"),
                        help="job inputs/outputs and process logs")
    parser.add_argument("--data", type=Path, default=None,
                        help="shared data folder (default $SLIPSTREAM_DATA or ../shared/data)")
    parser.add_argument("--control-plane-profiling", action="store_true",
                        help="serve /debug/pprof on kube-apiserver and the controllers (admin "
                        "credentials), to profile the control plane during a run")
    parser.add_argument("--skip-cluster", action="store_true", help="only the simulation")
    parser.add_argument("--skip-sim", action="store_true", help="only the cluster runs")
    parser.add_argument("--sim-engines", type=int, default=64, help="engines in the simulation")
    parser.add_argument("--sim-horizon", type=float, default=60.0,
                        help="virtual seconds replayed per engine (default 60)")
    parser.add_argument("--sim-rate", type=float, default=3.0,
                        help="online requests/s per engine (the Azure trace is rate-scaled)")


def _data_dir(args: argparse.Namespace) -> Path:
    import os

    if args.data is not None:
        return Path(args.data)
    return Path(os.environ.get("SLIPSTREAM_DATA", REPO.parent / "shared" / "data"))


# ---------------------------------------------------------------------------- cluster part


def run_cluster(args: argparse.Namespace, on_scale: Any) -> list[dict[str, Any]]:
    from slipstream_testbed.cluster import ClusterConfig, ClusterError, Ports
    from slipstream_testbed.fleet.benchcluster import BenchCluster
    from slipstream_testbed.fleet.clusterrun import FleetRun, FleetRunError
    from slipstream_testbed.fleet.workload import plan_for_nodes

    results: list[dict[str, Any]] = []
    for nodes in [int(x) for x in str(args.nodes).split(",") if x.strip()]:
        plan = plan_for_nodes(nodes)
        cluster = BenchCluster(ClusterConfig(state_dir=args.state_dir, nodes=nodes,
                                             ports=Ports.from_base(args.port_base),
                                             profiling=args.control_plane_profiling))
        workdir = args.workdir / f"nodes-{nodes}"
        shutil.rmtree(workdir, ignore_errors=True)
        began = time.monotonic()
        row: dict[str, Any] = dict(plan.to_dict())
        try:
            if (args.state_dir / "cluster.json").exists():
                cluster.down()  # a fresh control plane for every scale: nothing left over
            cluster.up(build=False, timeout=600.0)
            row["cluster_up_s"] = round(time.monotonic() - began, 1)
            run = FleetRun(cluster, plan, workdir, data_dir=_data_dir(args),
                           interval_s=args.interval, bumps=args.bumps, timeout_s=args.timeout,
                           operator_threads=args.operator_threads, lag_probe=args.lag_probe,
                           status_counters=args.status_counters,
                           operator_shards=args.operator_shards)
            row.update(run.run().to_dict())
            row["status_counters"] = args.status_counters
            row["operator_threads"] = args.operator_threads or None
            row["lag_probe"] = args.lag_probe
            if args.label:
                row["operator"] = args.label
            row["ok"] = True
        except (ClusterError, FleetRunError, OSError) as exc:
            logger.warning("scale %d nodes failed: %s", nodes, exc)
            row.update({"ok": False, "error": str(exc)[:500],
                        "partial": getattr(exc, "partial", {})})
        finally:
            try:
                cluster.down()
            except ClusterError as exc:
                logger.warning("cluster down: %s", exc)
        results.append(row)
        print(json.dumps(row), flush=True)
        on_scale(results)
        if not row["ok"]:
            break
    return results


# ---------------------------------------------------------------------------- sim part


def run_sim(args: argparse.Namespace) -> dict[str, Any]:
    from slipstream_cli.workloads import azure, mmlu
    from slipstream_scheduler.sim.fleet import (
        FleetConfig,
        Shard,
        make_shards,
        plan_fleet,
        simulate_fleet,
    )
    from slipstream_scheduler.sim.simulator import SimConfig, profile_latency_model
    from slipstream_scheduler.sim.workload import scale_rate, window

    data = _data_dir(args)
    trace = azure.load(data / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.dev.csv")
    base_rate = len(trace) / max(trace[-1].arrival_s, 1e-9)
    engines, horizon = args.sim_engines, args.sim_horizon
    factor = engines * args.sim_rate / base_rate
    online = window(scale_rate(trace, factor), 0.0, horizon)
    offline = mmlu.load(data / "mmlu", output_tokens=16)
    jobs = 16
    per_job = min(len(offline) // jobs, engines * 40)
    shards: list[Shard] = []
    for j in range(jobs):
        shards.extend(make_shards(f"job-{j:02d}", offline[j * per_job:(j + 1) * per_job], 16))
    sim_config = SimConfig(policy="budget", budget_s=0.3)
    model = profile_latency_model(sim_config.engine)

    decisions: list[dict[str, Any]] = []
    for n in (8, 16, 32, 64, engines):
        if any(d["engines"] == n for d in decisions) or n > engines:
            continue
        cfg = FleetConfig(engines=n, sim=sim_config)
        sub = window(scale_rate(trace, n * args.sim_rate / base_rate), 0.0, horizon)
        t0 = time.perf_counter()
        plan_fleet(sub, shards, cfg, horizon)
        spent = time.perf_counter() - t0
        decisions.append({"engines": n, "requests": len(sub), "shards": len(shards),
                          "decision_us_per_request": round(1e6 * spent / max(1, len(sub)), 1),
                          "decision_ms_total": round(1e3 * spent, 1)})
        print(json.dumps(decisions[-1]), flush=True)

    variants: list[dict[str, Any]] = []
    for router, placement in (("round-robin", "even"), ("least-work", "spare")):
        cfg = FleetConfig(engines=engines, router=router, placement=placement, sim=sim_config)
        t0 = time.perf_counter()
        outcome = simulate_fleet(online, shards, cfg, horizon, latency_model=model)
        wall = time.perf_counter() - t0
        requests = outcome.online_requests + sum(len(s.requests) for s in shards)

        def num(x: float) -> float | None:
            return None if math.isnan(x) else round(x, 4)

        variants.append({
            "router": router, "placement": placement, "engines": engines,
            "online_requests": outcome.online_requests,
            "online_finished": outcome.online_finished,
            "ttft_p99_s": num(outcome.online_ttft.p99),
            "ttft_mean_s": num(outcome.online_ttft.mean),
            "tbt_p99_s": num(outcome.online_tbt.p99),
            "offline_tokens_per_s": round(outcome.offline_tokens_per_s, 1),
            "offline_finished": outcome.offline_finished,
            "busy_min": round(outcome.busy_fraction_min, 3),
            "busy_max": round(outcome.busy_fraction_max, 3),
            "replay_wall_s": round(wall, 1),
            "replay_ms_per_request": round(1e3 * wall / max(1, requests), 3),
        })
        print(json.dumps(variants[-1]), flush=True)
    return {"engines": engines, "horizon_s": horizon, "online_rate_per_engine": args.sim_rate,
            "shards": len(shards), "offline_requests": sum(len(s.requests) for s in shards),
            "decisions": decisions, "variants": variants}


# ---------------------------------------------------------------------------- output


def summary(scales: list[dict[str, Any]], sim: dict[str, Any] | None) -> dict[str, Any]:
    """The issue's keys from the largest scale reached (rows marked ``baseline``, kept for
    comparison, never count), and every row under ``scales``."""
    reached = [s for s in scales if s.get("ok") and not s.get("baseline")]
    top = reached[-1] if reached else {}
    keys = ("nodes", "services", "pods", "shards", "ready_s", "status_lag_p99_s",
            "operator_cpu_cores", "operator_rss_mb", "api_rps")
    out: dict[str, Any] = {k: top.get(k) for k in keys}
    out["scales"] = scales
    if sim is not None:
        out["sim"] = sim
    return out


def markdown(result: dict[str, Any]) -> str:
    labelled = any(s.get("operator") for s in result["scales"])
    lines = [("| operator " if labelled else "")
             + "| nodes | services | pods | jobs | shards | pods Running s | ready s | "
             "lag p50 s | lag p99 s | lag p99 as read s | op CPU steady | op CPU ramp | RSS MB | "
             "API rps steady | API rps ramp |", "|" + "---|" * (16 if labelled else 15)]
    for s in result["scales"]:
        first = f"| {s.get('operator') or ''} " if labelled else ""
        if not s.get("ok"):
            lines.append(f"{first}| {s['nodes']} | {s['services']} | {s['pods']} | {s['jobs']} | "
                         f"{s['shards']} | failed: {s.get('error', '')[:80]} ||||||||||")
            continue
        lines.append(
            f"{first}| {s['nodes']} | {s['services']} | {s['pods']} | {s['jobs']} | "
            f"{s['shards']} | "
            f"{s['pods_running_s']} | {s['ready_s']} | {s['status_lag_p50_s']} | "
            f"{s['status_lag_p99_s']} | {_blank(s.get('status_lag_p99_arrival_s'))} | "
            f"{s['operator_cpu_cores']} | {s['ramp']['cpu_cores']} | "
            f"{s['operator_rss_mb']} | {s['api_rps']} | {s['ramp']['api_rps']} |")
    per_bump = [(s, b) for s in result["scales"] if s.get("ok")
                 for b in s.get("status_lag_bumps") or ()]
    if per_bump:
        lines += ["", ("| operator " if labelled else "")
                  + "| nodes | bump | services seen | timeouts | lag p50 s | lag p99 s | "
                  "lag max s | lag p99 as read s |", "|" + "---|" * (9 if labelled else 8)]
        lines += [(f"| {s.get('operator') or ''} " if labelled else "")
                  + f"| {s['nodes']} | {b['bump']} | {b['samples']} | {b['timeouts']} | "
                  f"{b['p50_s']} | {b['p99_s']} | {b['max_s']} | "
                  f"{_blank(b.get('p99_arrival_s'))} |" for s, b in per_bump]
    sim = result.get("sim")
    if sim:
        lines += ["", "| engines | requests | shards | decision µs/request | decision ms total |",
                  "|---|---|---|---|---|"]
        lines += [f"| {d['engines']} | {d['requests']} | {d['shards']} | "
                  f"{d['decision_us_per_request']} | {d['decision_ms_total']} |"
                  for d in sim["decisions"]]
        lines += ["", "| router | placement | online req | TTFT p99 s | TBT p99 s | "
                  "offline tok/s | offline done | busy min-max | replay ms/request |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {v['router']} | {v['placement']} | {v['online_requests']} | "
                  f"{v['ttft_p99_s']} | {v['tbt_p99_s']} | {v['offline_tokens_per_s']} | "
                  f"{v['offline_finished']} | {v['busy_min']}-{v['busy_max']} | "
                  f"{v['replay_ms_per_request']} |" for v in sim["variants"]]
    return "\n".join(lines) + "\n"


def _blank(value: Any) -> str:
    """A cell for a key older rows lack."""
    return "" if value is None else str(value)


BEGIN = "<!-- fleet results: generated by slipstream bench fleet -->"
END = "<!-- /fleet results -->"


def splice(existing: str, table: str) -> str:
    """``existing`` with its results block replaced by ``table`` (appended when absent)."""
    block = f"{BEGIN}\n{table}{END}"
    if BEGIN in existing and END in existing:
        head, rest = existing.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1]
    return (existing.rstrip("\n") + "\n\n" if existing else "") + block + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The current operator's trend: rows kept for comparison (``baseline``) are left out,
    # unless there is nothing else to show.
    ok = ([s for s in result["scales"] if s.get("ok") and not s.get("baseline")]
          or [s for s in result["scales"] if s.get("ok")])
    if not ok:
        return
    nodes = [s["nodes"] for s in ok]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = (
        ("operator CPU (cores)", [s["operator_cpu_cores"] for s in ok],
         [s["ramp"]["cpu_cores"] for s in ok], 1.0),
        ("operator API requests/s", [s["api_rps"] for s in ok],
         [s["ramp"]["api_rps"] for s in ok], None),
        ("status lag (s)", [s["status_lag_p99_s"] for s in ok],
         [s["status_lag_p50_s"] for s in ok], 10.0),
        ("apply to ready (s)", [s["ready_s"] for s in ok],
         [s["pods_running_s"] for s in ok], None),
    )
    labels = (("steady", "ramp"), ("steady", "ramp"), ("p99", "p50"), ("all ready", "pods Running"))
    for ax, (title, a, b, goal), (la, lb) in zip(axes, panels, labels, strict=True):
        ax.plot(nodes, a, "o-", label=la)
        ax.plot(nodes, b, "s--", label=lb)
        if goal is not None:
            ax.axhline(goal, color="grey", linestyle=":", label="goal")
        ax.set_title(title)
        ax.set_xlabel("GPU nodes (pods = 2x)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write(args: argparse.Namespace, scales: list[dict[str, Any]],
           sim: dict[str, Any] | None) -> dict[str, Any]:
    result = summary(scales, sim)
    if args.json.exists():  # keep the other part's results when only one part ran
        try:
            old = json.loads(args.json.read_text())
        except (OSError, json.JSONDecodeError):
            old = {}
        if args.skip_cluster:
            result.update({k: v for k, v in old.items() if k != "sim"})
            result["sim"] = sim
        elif args.skip_sim and "sim" in old:
            result["sim"] = old["sim"]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    existing = args.md.read_text() if args.md.exists() else ""
    args.md.write_text(splice(existing, markdown(result)))
    plot(result, args.png)
    return result


def run(args: argparse.Namespace) -> int:
    scales: list[dict[str, Any]] = []
    sim: dict[str, Any] | None = None
    if not args.skip_sim:
        sim = run_sim(args)
        _write(args, scales, sim) if args.skip_cluster else None
    if not args.skip_cluster:
        scales = run_cluster(args, lambda done: _write(args, done, sim))
    result = _write(args, scales, sim)
    print(json.dumps({k: v for k, v in result.items() if k not in ("scales", "sim")}))
    return 0 if all(s.get("ok") for s in scales) else 1
