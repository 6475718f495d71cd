"""Checkpoint and restore: who opts in (policy), the pipeline that dumps a container
into the store, the one restore owner (restore.py), the store and the rootfs diff.
See docs/architecture.md for the flows."""
