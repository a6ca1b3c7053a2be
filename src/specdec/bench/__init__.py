"""Benchmarks (never timed tests): speed belongs here, measured side by side in one run."""
