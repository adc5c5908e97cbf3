"""Fault injection a user points at their own job: plans, injection, verdicts."""
