"""Slipstream inside vLLM: the scheduler plugin and the in-process harness of vLLM's scheduler.

The only package of the project that imports ``vllm`` (import-linter enforces it). It runs in
vLLM's own environment: in a vLLM pod (``--scheduler-cls slipstream_vllm.SlipstreamScheduler``)
and in the ``.venv-vllm`` environment of the tests and benchmarks.
"""
