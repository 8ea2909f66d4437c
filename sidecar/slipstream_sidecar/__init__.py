"""Slipstream sidecar: the in-pod enforcer in front of vLLM (HTTP proxy + gRPC control)."""
