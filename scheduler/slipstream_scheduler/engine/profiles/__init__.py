"""Package data: GPU profiles (``<model>_<gpu>.json``) and fitted latency models
(``latency_<model>_<gpu>.json``), written by ``slipstream profile gpu`` and
``slipstream profile latency``. Derived from Vidur (MIT), ML.ENERGY
(Apache-2.0) and Splitwise (MIT) measurements; see each file's attribution.
"""
