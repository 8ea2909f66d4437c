"""The testbed: what stands in for GPUs and a cluster in tests, benchmarks and the demo.

* :mod:`~slipstream_testbed.engine_server`: the engine model behind vLLM's HTTP API;
* :mod:`~slipstream_testbed.vllm`: real ``vllm serve`` on CPU with a tiny model built from a seed;
* :mod:`~slipstream_testbed.cluster`: a real local control plane (etcd, kube-apiserver, kwok);
* :mod:`~slipstream_testbed.podrunner`: the processes of a pod (sidecar, engine) on its loopback IP;
* :mod:`~slipstream_testbed.fleet`: fake sidecars for thousands of pods;
* :mod:`~slipstream_testbed.prometheus`, :mod:`~slipstream_testbed.faults`: a real Prometheus,
  fault injection.

Nothing here is part of a production deployment; the ``slipstream`` command (``cli/``) drives it.
"""
