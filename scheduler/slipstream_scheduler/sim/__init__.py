"""Trace-driven simulation: dispatcher and planner against the engine model, in virtual time.

``workload`` holds the request values a replay feeds in, ``metrics`` what it
measures, ``simulator`` the discrete-event loop and the named policies.
"""
