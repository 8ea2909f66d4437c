"""Benchmarks behind ``slipstream bench <name>``.

One module per benchmark, each with ``add_arguments(parser)`` and
``run(args) -> int``; ``slipstream_cli.commands.bench`` lists them in an
explicit table and imports only the one chosen. Benchmarks print and record
numbers (timings as ratios against a baseline measured in the same run); they
never assert on them.
"""
