"""containerd.task.v2.Task: the service, containers, the process state table and
checkpoints of a container. See docs/architecture.md for the states."""
