"""hooks layer (see ../shared/DESIGN.md)."""
