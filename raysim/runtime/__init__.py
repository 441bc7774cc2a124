"""Execution backends: `local` (in-process, sequential) and `ray` (tasks + server actor)."""
