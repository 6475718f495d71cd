"""Slurm: the SPANK plugin's installer and the job runner it hands opted-in batch steps to."""
