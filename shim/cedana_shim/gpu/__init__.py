"""gpu layer (see ../shared/DESIGN.md)."""
