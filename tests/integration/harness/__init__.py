"""Harness for the integration suite: private containerd instances, test images,
ctr and CRI clients, and /proc and mountinfo probes.

Everything here drives real binaries; nothing is faked.
"""
