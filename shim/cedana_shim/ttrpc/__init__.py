"""ttrpc layer (see ../shared/DESIGN.md)."""
