"""Subcommands of the slipstream CLI."""
