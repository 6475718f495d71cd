"""cedana-shim: a containerd runtime shim with transparent checkpoint/restore."""

__version__ = "0.1.0"
