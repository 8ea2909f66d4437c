"""Every Python client of vLLM's HTTP server here drops an idle connection before vLLM does.

vLLM closes a keep-alive connection after ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` seconds idle. A
client that keeps one for longer can send a request on it at the moment vLLM closes it; the
request fails (a reset, a disconnect) and vLLM never sees it. On a loaded host the client's
event loop notices the close late, which widens that moment: three of 2,594 requests sent
straight to vLLM failed so in an engine-mode soak (docs/reliability.md, "Soak"). The sidecar's
front checks its own limit in Go (``TestAnIdleEngineConnectionIsDroppedBeforeTheEnginesKeepAlive``).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_clients_drop_idle_connections_before_this_vllm_does() -> None:
    import vllm.envs as envs

    from slipstream_cli import loadgen
    from slipstream_sidecar import engine

    vllm_keepalive_s = envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    assert vllm_keepalive_s > loadgen.KEEPALIVE_S
    assert vllm_keepalive_s > engine.KEEPALIVE_S
