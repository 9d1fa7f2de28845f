"""Dry run of a plan at its real world size on the fake process-group backend."""
