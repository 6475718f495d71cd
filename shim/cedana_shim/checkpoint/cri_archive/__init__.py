"""Kubernetes checkpoint archives (KEP-2008), in and out of the store.

The kubelet's ``checkpoint`` endpoint, ``crictl checkpoint --export`` (containerd 2.x,
CRI-O) and Podman write one archive: a tar holding ``checkpoint/`` (CRIU's images as
CRIU wrote them), ``config.dump`` (the container: id, name, image), ``spec.dump`` (its OCI
spec: the CRI annotations name the pod and namespace), ``status.dump``, CRIU's
``stats-dump`` and ``dump.log``, and the writable layer's changes as ``rootfs-diff.tar``
(containerd: an OCI layer, gzip, deletions as whiteouts; CRI-O and Podman: a plain tar,
deletions listed in ``deleted.files``), plus ``devshm-checkpoint.tar`` for the pod's
``/dev/shm``. ``checkpointctl`` reads it.

:mod:`.export` writes a stored checkpoint in that form; :mod:`.importer` turns such an
archive, treated as hostile input, into a checkpoint of the store (restorable with
``CEDANA_RESTORE``); :mod:`.documents` builds and reads the JSON files; :mod:`.rootfs`
converts the writable layer both ways; :mod:`.images` checks CRIU images before they
are listed; :mod:`.oci_image` pushes an export as a one-layer checkpoint image.
"""
