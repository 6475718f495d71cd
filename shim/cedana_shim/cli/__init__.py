"""Bootstrap and tools: the shim's `start`/`delete` commands, the daemon and its
composition root, the warm fork server, the `cedana` admin CLI."""
