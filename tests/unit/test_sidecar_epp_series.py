"""``epp_series``: the engine's vLLM series an endpoint picker reads, as the sidecar serves them."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slipstream_sidecar.metrics import EPP_FAMILIES, epp_series

pytestmark = pytest.mark.unit

ENGINE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:num_requests_waiting_by_reason Requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="",num_gpu_blocks="100"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 42.0
"""


def parsed(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {f.name: [(dict(s.labels), s.value) for s in f.samples]
            for f in text_string_to_metric_families(text)}


def test_waiting_adds_the_held_online_requests_to_each_engine() -> None:
    out = parsed(epp_series(ENGINE, 3, now=1.7e9))
    assert out["vllm:num_requests_waiting"] == [
        ({"engine": "0", "model_name": "m"}, 4.0), ({"engine": "1", "model_name": "m"}, 3.0)]
    assert out["vllm:num_requests_running"] == [
        ({"engine": "0", "model_name": "m"}, 2.0), ({"engine": "1", "model_name": "m"}, 1.0)]
    assert out["vllm:kv_cache_usage_perc"] == [({"engine": "0", "model_name": "m"}, 0.25)]
    assert out["vllm:cache_config_info"] == [
        ({"block_size": "16", "engine": "", "num_gpu_blocks": "100"}, 1.0)]


def test_only_the_pickers_families_and_a_lora_series_without_lora() -> None:
    text = epp_series(ENGINE, 0, now=1.7e9)
    out = parsed(text)
    assert list(out) == list(EPP_FAMILIES)
    assert out["vllm:lora_requests_info"] == [
        ({"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}, 1.7e9)]
    assert "waiting_by_reason" not in text and "prompt_tokens" not in text


def test_an_engines_own_lora_series_is_kept() -> None:
    lora = ('# HELP vllm:lora_requests_info Running stats on lora requests.\n'
            '# TYPE vllm:lora_requests_info gauge\n'
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a",'
            'waiting_lora_adapters=""} 1.7e+09\n')
    out = parsed(epp_series(ENGINE + lora, 0))
    assert out["vllm:lora_requests_info"] == [
        ({"max_lora": "4", "running_lora_adapters": "a", "waiting_lora_adapters": ""}, 1.7e9)]


def test_an_engine_without_these_families_gets_only_the_lora_series() -> None:
    # Nothing is made up for a family the engine does not serve, except the LoRA series
    # that vLLM without --enable-lora lacks.
    assert set(parsed(epp_series("# nothing here\n", 2, now=1.0))) == {"vllm:lora_requests_info"}
