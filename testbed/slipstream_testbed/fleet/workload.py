"""What a fleet run applies: namespaces, InferenceServices and OfflineJobs at a given scale.

Pure builders (no I/O). The shape follows the issue's fleet: per 1,000 GPU nodes,
500 InferenceServices of 4 replicas (2,000 pods, one GPU each) and 200
OfflineJobs of 500 one-line shards (100,000 shards), spread over teams
(namespaces of 50 services and 20 jobs). Inside a namespace, services form pools
of 10 (a label) and each job selects one pool, so a job's shards land on the 40
pods of its pool and four jobs share a pool. Smaller fleets keep the ratios
(:func:`plan_for_nodes`).

Deliberately left out: the job input file itself (the caller writes it) and
anything the operator creates (Deployments, Services, Secrets).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

GROUP_VERSION = "slipstream.dev/v1alpha1"
POOL_LABEL = "slipstream.dev/pool"
MODEL = "llama-2-7b"


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """How many of each object a run creates."""

    nodes: int
    services: int
    replicas: int
    jobs: int
    shards_per_job: int
    shard_size: int = 1
    services_per_namespace: int = 50
    pool_size: int = 10

    def __post_init__(self) -> None:
        if min(self.nodes, self.services, self.replicas, self.jobs, self.shards_per_job) < 1:
            raise ValueError(f"every count of a fleet plan must be >= 1: {self}")

    @property
    def pods(self) -> int:
        return self.services * self.replicas

    @property
    def shards(self) -> int:
        return self.jobs * self.shards_per_job

    @property
    def lines_per_job(self) -> int:
        return self.shards_per_job * self.shard_size

    def to_dict(self) -> dict[str, int]:
        return {"nodes": self.nodes, "services": self.services, "pods": self.pods,
                "jobs": self.jobs, "shards": self.shards}


def plan_for_nodes(nodes: int) -> FleetPlan:
    """The issue's ratios: services = nodes/2 (4 replicas), jobs = nodes/5, 500 shards a job."""
    return FleetPlan(nodes=nodes, services=max(1, nodes // 2), replicas=4,
                     jobs=max(1, nodes // 5), shards_per_job=500)


def namespace_names(plan: FleetPlan, prefix: str) -> list[str]:
    count = -(-plan.services // plan.services_per_namespace)
    return [f"{prefix}-team-{i:02d}" for i in range(count)]


def _pool(index_in_namespace: int, plan: FleetPlan) -> str:
    return f"pool-{index_in_namespace // plan.pool_size}"


def service_manifests(plan: FleetPlan, prefix: str) -> list[dict[str, Any]]:
    """The InferenceServices, ``services_per_namespace`` per namespace, pooled by label."""
    spaces = namespace_names(plan, prefix)
    out = []
    for i in range(plan.services):
        ns, local = divmod(i, plan.services_per_namespace)
        out.append({
            "apiVersion": GROUP_VERSION,
            "kind": "InferenceService",
            "metadata": {"name": f"svc-{i:04d}", "namespace": spaces[ns],
                         "labels": {POOL_LABEL: _pool(local, plan)}},
            "spec": {
                "model": MODEL,
                "engine": {"image": "vllm/vllm-openai:v0.11.0", "gpus": 1, "gpuType": "h100"},
                "replicas": plan.replicas,
                "slo": {"ttft": {"p99": "2s", "mean": "600ms"},
                        "tbt": {"p99": "150ms", "mean": "60ms"}},
                "scheduling": {"ordering": "gittins", "coLocation": True},
                "sidecar": {"httpPort": 8000, "grpcPort": 9000},
            },
        })
    return out


def job_manifests(plan: FleetPlan, prefix: str, input_uri: str,
                  output_dir: str) -> list[dict[str, Any]]:
    """The OfflineJobs, spread over namespaces in proportion, each selecting one pool there."""
    spaces = namespace_names(plan, prefix)
    per_ns = [0] * len(spaces)
    for i in range(plan.services):
        per_ns[i // plan.services_per_namespace] += 1
    out = []
    for j in range(plan.jobs):
        ns = j % len(spaces)
        pools = -(-per_ns[ns] // plan.pool_size)
        pool = (j // len(spaces)) % pools
        out.append({
            "apiVersion": GROUP_VERSION,
            "kind": "OfflineJob",
            "metadata": {"name": f"job-{j:04d}", "namespace": spaces[ns]},
            "spec": {
                "model": MODEL,
                "input": {"uri": input_uri},
                "output": {"uri": f"file://{output_dir}/{spaces[ns]}/job-{j:04d}.jsonl"},
                "serviceSelector": {"matchLabels": {POOL_LABEL: f"pool-{pool}"}},
                "priority": j % 3,
                "shardSize": plan.shard_size,
                "requestDefaults": {"maxTokens": 64},
            },
        })
    return out


def batch_lines(questions: list[str], lines: int) -> list[str]:
    """OpenAI Batch API input lines asking ``MODEL`` the given questions (cycled).

    Each prompt starts with its line number, so no two lines share the planner's prefix key
    and a job of ``n`` lines with ``shardSize: 1`` is cut into exactly ``n`` shards.
    """
    if not questions:
        raise ValueError("no questions to build a batch from")
    return [
        json.dumps({"custom_id": f"q-{i:06d}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": MODEL,
                             "prompt": f"Question {i}: {questions[i % len(questions)]}"}})
        for i in range(lines)
    ]


def shards_per_pod_needed(plan: FleetPlan, prefix: str) -> int:
    """The most shards any pool's pods must hold at once for every shard to be placed."""
    pods: dict[tuple[str, str], int] = {}
    for svc in service_manifests(plan, prefix):
        key = (svc["metadata"]["namespace"], svc["metadata"]["labels"][POOL_LABEL])
        pods[key] = pods.get(key, 0) + plan.replicas
    shards: dict[tuple[str, str], int] = {}
    for job in job_manifests(plan, prefix, "file:///in.jsonl", "/out"):
        key = (job["metadata"]["namespace"], job["spec"]["serviceSelector"]["matchLabels"][
            POOL_LABEL])
        shards[key] = shards.get(key, 0) + plan.shards_per_job
    return max(-(-n // pods[key]) for key, n in shards.items())
