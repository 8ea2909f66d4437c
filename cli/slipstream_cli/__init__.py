"""The `slipstream` command line: simulator, benchmarks, local cluster, engine model and shells."""
