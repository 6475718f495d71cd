"""``cedana node``: put cedana-shim on a Kubernetes node and keep the node honest.

- ``install`` / ``uninstall`` / ``status``: the self-contained Python environment
  under ``/opt/cedana``, the shim on containerd's PATH, CRIU, the node config and
  the containerd runtime registration (a drop-in through ``imports``, or a marked,
  backed-up edit of the config), a containerd restart only when something changed,
  and a CRI check that the ``cedana`` handler answers. Every path is relative to
  ``--host-root`` so the DaemonSet can work on the host mounted at ``/host``.
- ``run``: the DaemonSet helper: taint the node ``cedana.ai/not-ready:NoSchedule``,
  install, then keep the taint in step with the readiness of the node's helper and
  health-check pods (``taint.py`` decides, ``kube.py`` talks to the API server).

Heavy imports (grpc, kubernetes) happen only in the commands that need them: the
shim's own start path never imports this package.
"""
