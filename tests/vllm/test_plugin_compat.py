"""The plugin's start-up check against vLLM's real scheduler (slipstream_vllm.compat).

The vLLM of this environment passes; a renamed attribute and a changed signature are each
named in the one error the plugin raises when vLLM loads it.
"""

from __future__ import annotations

from typing import Any

import pytest

from slipstream_scheduler.engine.model import EngineConfig

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PLUGIN = "slipstream_vllm.scheduler.SlipstreamScheduler"
CFG = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, num_gpu_blocks=64, noise_cv=0.0)


def _scheduler(cls: str | None = None) -> Any:
    from slipstream_testbed.vllm.inprocess import VllmEngine

    return VllmEngine(CFG, scheduler_cls=cls).scheduler


def test_this_vllm_has_everything_the_plugin_uses() -> None:
    from vllm.v1.request import Request

    from slipstream_vllm import compat
    from vllm import __version__

    assert compat.check(_scheduler(), Request) == []
    assert compat.tested(__version__), __version__
    assert type(_scheduler(PLUGIN)).__name__ == "SlipstreamScheduler"


def test_a_renamed_attribute_is_named() -> None:
    from vllm.v1.request import Request

    from slipstream_vllm import compat

    sched = _scheduler()
    sched.kv_holding_queue = sched.__dict__.pop("kv_holding_waiting")
    assert compat.check(sched, Request) == ["scheduler.kv_holding_waiting is missing"]


def test_a_request_field_vllm_no_longer_sets_is_named() -> None:
    from slipstream_vllm import compat

    class Request:  # a vLLM that renamed num_computed_tokens
        def __init__(self) -> None:
            self.request_id = self.prompt_token_ids = self.sampling_params = None
            self.priority = self.arrival_time = self.status = self.block_hashes = None
            self.max_tokens = self.num_tokens = self.num_prompt_tokens = None
            self.num_output_tokens = self.is_finished = None
            self.computed_tokens = 0

    assert compat._request_problems(Request) == ["Request.num_computed_tokens is missing"]


def test_a_changed_signature_stops_the_plugin_at_load_with_the_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from slipstream_vllm.compat import IncompatibleVllmError
    from vllm import __version__

    def _preempt_request(self: Any, req: Any, now: float) -> None:  # parameters renamed
        raise AssertionError("never called")

    monkeypatch.setattr(Scheduler, "_preempt_request", _preempt_request)
    with pytest.raises(IncompatibleVllmError) as err:
        _scheduler(PLUGIN)
    message = str(err.value)
    assert f"vLLM {__version__}" in message
    assert "_preempt_request() takes (req, now), the plugin passes (request, timestamp)" in message


def test_an_output_field_vllm_renamed_is_named() -> None:
    import msgspec

    from slipstream_vllm import compat

    class EngineCoreOutput(msgspec.Struct):  # a vLLM that renamed new_token_ids
        request_id: str
        token_ids: list[int]
        finish_reason: int | None = None

    assert compat.output_problems({"vllm.v1.engine.EngineCoreOutput": EngineCoreOutput}) == [
        "EngineCoreOutput.new_token_ids is missing"
    ]
