"""Trace-driven simulation: dispatcher and planner against the engine model, in virtual time.

``workload`` holds the request values a replay feeds in, ``metrics`` what it
measures, ``simulator`` the discrete-event loop and the named policies (the
sidecar deployment: the dispatcher in front of vLLM's own scheduler),
``inengine`` the in-engine mode (``PlannedEngine``: the ITERATION-mode planner
picks each engine iteration's batch, what an engine plugin would do; never
what the sidecar achieves), and ``fleet`` many engines behind one router.
"""
