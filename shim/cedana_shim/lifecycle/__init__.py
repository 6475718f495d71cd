"""One process's checkpoint life, below both front ends (task/ for containerd, slurm/
for Slurm jobs): the process state table under one lock per process, checkpoints on
stop, periodic and on demand, and what follows a checkpoint once it is durable. See
docs/architecture.md ("Layers")."""
