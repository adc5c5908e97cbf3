"""Command line: coordinator, worker and launch."""
