"""Real vLLM in the testbed: a tiny model built from a seed, and ``vllm serve`` on CPU.

See :mod:`.tiny_model` (``ensure()`` builds or reuses the model) and :mod:`.server`;
:mod:`.bench_serve` runs vLLM's own load generator, ``vllm bench serve``, round after round
(imported by name only: it is also the child process's ``__main__``).
These import no vllm: the server runs in the real-vLLM environment (``make vllm-env``) as a
separate process. :mod:`.inprocess` (vLLM's scheduler stepped in-process) and
:mod:`.simplugin` (Slipstream's plugin in it, for the simulator) do, and are imported by
name, from that environment only.
"""

from slipstream_testbed.vllm.server import (
    DEFAULT_SERVED_NAME,
    VllmServer,
    VllmServerOptions,
    VllmStartError,
    VllmUnavailableError,
    free_port,
    running,
    vllm_python,
)
from slipstream_testbed.vllm.tiny_model import TinyModelSpec, ensure, model_dir

__all__ = [
    "DEFAULT_SERVED_NAME",
    "TinyModelSpec",
    "VllmServer",
    "VllmServerOptions",
    "VllmStartError",
    "VllmUnavailableError",
    "ensure",
    "free_port",
    "model_dir",
    "running",
    "vllm_python",
]
