"""task layer (see ../shared/DESIGN.md)."""
