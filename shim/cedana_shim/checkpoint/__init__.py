"""checkpoint layer (see ../shared/DESIGN.md)."""
