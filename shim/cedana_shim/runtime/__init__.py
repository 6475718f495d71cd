"""Everything that touches the host: the runc driver, the reaper, mounts."""
