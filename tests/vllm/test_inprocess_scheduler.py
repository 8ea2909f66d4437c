"""vLLM's own v1 scheduler, stepped in-process (``slipstream_testbed.vllm.inprocess``), beside
the engine model.

The same request stream goes to both: they must finish every request, and vLLM's priority
policy must serve a better priority first, as the engine model does.
"""

from __future__ import annotations

import pytest

from slipstream_scheduler.engine.model import EngineConfig, EngineModel, EngineRequest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def _requests(n: int) -> list[EngineRequest]:
    shared = tuple(("system", j) for j in range(3))
    return [
        EngineRequest(f"r{i}", 100 + 7 * i, 64, priority=i % 3, arrival_s=i * 0.01,
                      block_hashes=shared, output_len=20 + i)
        for i in range(n)
    ]


def _run(engine: object, reqs: list[EngineRequest]) -> tuple[list[str], int]:
    for r in reqs:
        engine.add(r)  # type: ignore[attr-defined]
    order: list[str] = []
    steps = 0
    while engine.has_work():  # type: ignore[attr-defined]
        res = engine.step()  # type: ignore[attr-defined]
        steps += 1
        order += [rid for rid, _ in res.finished]
        assert steps < 10_000
    return order, steps


def test_vllm_scheduler_serves_the_stream_like_the_engine_model(tiny_model: object) -> None:
    from slipstream_testbed.vllm.inprocess import VllmEngine

    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, num_gpu_blocks=64, noise_cv=0.0)
    reqs = _requests(12)
    _model_order, model_steps = _run(EngineModel(cfg), reqs)
    vllm = VllmEngine(cfg)
    vllm_order, vllm_steps = _run(vllm, reqs)
    assert sorted(vllm_order) == sorted(r.request_id for r in reqs)
    assert vllm.stats().generation_tokens == sum(r.output_len or 0 for r in reqs)
    # Shared system-prompt blocks are found in vLLM's prefix cache.
    assert vllm.stats().prefix_cache_hits > 0
    # The first eight fill the slots; of the four that wait, r9 is the only priority 0.
    late = [rid for rid in vllm_order if int(rid[1:]) >= 8]
    assert late[0] in {"r9"}
    assert abs(vllm_steps - model_steps) <= max(2, model_steps // 10)


def test_vllm_scheduler_preempts_under_kv_pressure(tiny_model: object) -> None:
    from slipstream_testbed.vllm.inprocess import VllmEngine

    cfg = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, num_gpu_blocks=24,
                       noise_cv=0.0)
    vllm = VllmEngine(cfg)
    reqs = [EngineRequest(f"p{i}", 60, 200, priority=i, arrival_s=float(i), output_len=120)
            for i in range(6)]
    order, _ = _run(vllm, reqs)
    assert sorted(order) == sorted(r.request_id for r in reqs)
    assert vllm.stats().preemptions > 0
    assert vllm.stats().generation_tokens == 6 * 120


def test_without_a_cap_the_kv_cache_bounds_a_prompt_as_in_the_engine_model(
    tiny_model: object,
) -> None:
    """Long-context traces (Mooncake's prompts pass 80k tokens): with no max_model_len
    configured both engines take any prompt the KV cache holds, and refuse the same ones."""
    from slipstream_scheduler.engine.errors import RequestError
    from slipstream_testbed.vllm.inprocess import VllmEngine

    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=8192, num_gpu_blocks=3000,
                       noise_cv=0.0)
    room = 3000 * cfg.block_size
    long = [EngineRequest("long", 40_000, 8, arrival_s=0.0, output_len=4)]
    for engine in (EngineModel(cfg), VllmEngine(cfg)):
        order, _ = _run(engine, long)
        assert order == ["long"]
        assert engine.stats().generation_tokens == 4
        says = f"max_model_len {room}" if isinstance(engine, VllmEngine) else "the KV cache"
        with pytest.raises(RequestError, match=says):
            engine.add(EngineRequest("too-long", room, 8, arrival_s=1.0))
