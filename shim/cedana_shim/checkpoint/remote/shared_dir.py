"""A directory every node mounts (NFS, Lustre, CephFS) as the shared checkpoint store.

The node config's ``registry`` set to an absolute path selects it. It holds what a
registry would, laid out like one, and answers the same calls
(:class:`cedana_shim.registry.Registry`), so pushes, the in-flight markers, listing,
pulls with their checks, and retention are the registry's code, unchanged::

    <dir>/<repository>/blobs/sha256/<hex>   blobs and manifests, content-addressed
    <dir>/<repository>/tags/<tag>           a hard link to its manifest's blob
    <dir>/<repository>/uploads/             blobs being written (``<hex>.<random>``)

Nodes coordinate only through atomic renames and links, never a lock: a file is
written under a name of its own in ``uploads/``, fsynced, verified against its
digest, then renamed to its content address (two nodes writing one blob rename the
same bytes over each other); a tag appears by a rename of a fresh link to its
manifest, after every blob it names. flock(2) is not coherent across the nodes of
every shared filesystem (Lustre without ``-o flock``, NFS mounted ``local_lock``), so
the node-local store, which uses it, stays on local disk (``store_path``).

What the directory holds is trusted no more than a registry's answers: every read
checks sizes before and digests after, no name from outside becomes a path without
the registry grammar's checks (one component per repository part, no ``..``), and
nothing is opened through a symbolic link. Files are 0600 and directories 0700;
the directory itself is the operator's (root's, not writable by others).

Deleting a checkpoint (retention) removes its manifest and tags; blobs stay, as in a
registry until its garbage collection: a chunk may be named by a newer checkpoint or
by a push that found it present a moment ago. ``cedana checkpoints gc --remote`` is
not built; remove unreferenced blobs with the cluster quiet.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import secrets
import stat
import time
from collections.abc import Iterator, Sequence
from typing import IO, Final

from cedana_shim import errors, untrusted_json
from cedana_shim.checkpoint.store import fsutil
from cedana_shim.registry import (
    BLOCK_SIZE,
    MANIFEST_MEDIA_TYPES,
    MAX_MANIFEST_BYTES,
    OpenSource,
    ProgressCallback,
    PushResult,
    Tap,
    check_digest,
    check_ref,
    check_repository,
    check_tag,
    repository_for,
)

__all__ = ["SharedDirectory", "check_shared_dir", "names_shared_dir"]

# A blob being written that is older than this was left by a writer that died.
STALE_UPLOAD_S: Final = 24 * 3600
DEFAULT_MAX_TAGS: Final = 100_000


def names_shared_dir(registry: str) -> bool:
    """Whether the node config's ``registry`` names a shared directory (a path), not
    a registry (``host[:port]/prefix``)."""
    return registry.startswith("/")


def check_shared_dir(path: str) -> str:
    """``path`` if it can name the shared directory: absolute, normalised, not ``/``."""
    if not os.path.isabs(path) or os.path.normpath(path) != path or path == "/":
        raise errors.InvalidArgument(
            f"registry {path!r}: a shared directory is an absolute, normalised path "
            "other than / (no '..', no trailing '/')"
        )
    return path


class SharedDirectory:
    """Blobs, manifests and tags under one directory (see the module doc)."""

    def __init__(self, path: str) -> None:
        self.path = check_shared_dir(path)

    @property
    def host(self) -> str:
        return self.path

    def repository_for(self, namespace: str) -> str:
        return repository_for("", namespace)

    # -- blobs ----------------------------------------------------------------------

    def push_blob(
        self,
        repo: str,
        digest: str,
        size: int,
        open_source: OpenSource,
        progress: ProgressCallback | None = None,
    ) -> PushResult:
        """Write a blob unless the directory has it; verified before it gets its name.

        Nothing is resumed: a writer killed half way leaves a file in ``uploads/``
        (removed a day later by the next push to the repository) and the next push
        writes the blob again; checkpoint chunks are small blobs of their own.
        """
        check_repository(repo)
        check_digest(digest)
        if size < 0:
            raise errors.InvalidArgument(f"blob {digest}: negative size {size}")
        what = f"write of blob {digest} to {repo}"
        with self._repo_dirs(repo, "blobs", "sha256", create=True) as blobs:
            present = _regular_size(blobs, digest[7:])
            if present is not None:
                if present != size:
                    raise errors.DataLoss(
                        f"registry {self.path}: blob {digest} in {repo} has {present} bytes, "
                        f"but it has {size} here: one of the two copies is damaged"
                    )
                return PushResult(existed=True, resumed_from=size, sent=0)
            with self._repo_dirs(repo, "uploads", create=True) as uploads:
                _sweep_stale(uploads)
                temp = f"{digest[7:]}.{secrets.token_hex(8)}"
                try:
                    self._write_verified(uploads, temp, digest, size, open_source, progress, what)
                    os.rename(temp, digest[7:], src_dir_fd=uploads, dst_dir_fd=blobs)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(temp, dir_fd=uploads)
            os.fsync(blobs)
        return PushResult(existed=False, resumed_from=0, sent=size, digest=digest)

    def push_blob_by_content(
        self,
        repo: str,
        key: str,
        size: int,
        open_source: OpenSource,
        progress: ProgressCallback | None = None,
        tap: Tap | None = None,
    ) -> PushResult:
        """Write a blob named by its hash, learned as it is written (``key`` names
        nothing here: nothing is resumed); a blob already there is kept."""
        check_repository(repo)
        if size < 0:
            raise errors.InvalidArgument(f"blob by content {key}: negative size {size}")
        what = f"write of a blob by content to {repo}"
        with self._repo_dirs(repo, "blobs", "sha256", create=True) as blobs:
            with self._repo_dirs(repo, "uploads", create=True) as uploads:
                _sweep_stale(uploads)
                temp = f"by-content.{secrets.token_hex(8)}"
                try:
                    digest = self._write_verified(
                        uploads, temp, None, size, open_source, progress, what, tap
                    )
                    os.rename(temp, digest[7:], src_dir_fd=uploads, dst_dir_fd=blobs)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(temp, dir_fd=uploads)
            os.fsync(blobs)
        tapped = tap.digest() if tap is not None else b""
        return PushResult(existed=False, resumed_from=0, sent=size, digest=digest, tap=tapped)

    def pull_blob(
        self,
        repo: str,
        digest: str,
        size: int,
        dest: IO[bytes],
        max_size: int,
        progress: ProgressCallback | None = None,
    ) -> None:
        """Copy a blob into ``dest``, its size checked first and its sha256 on the way.

        On any error ``dest`` may hold part of the blob: write to a temporary file and
        keep it only when this returns.
        """
        check_repository(repo)
        check_digest(digest)
        what = f"read of blob {digest} from {repo}"
        if size > max_size:
            raise errors.ResourceExhausted(
                f"registry {self.path}: {what}: it has {size} bytes, more than the "
                f"{max_size} allowed"
            )
        with self._repo_dirs(repo, "blobs", "sha256") as blobs:
            fd = self._open(blobs, digest[7:], f"{repo}/blobs/{digest}", what)
        try:
            found = os.fstat(fd).st_size
            if found != size:
                raise errors.DataLoss(
                    f"registry {self.path}: {what}: the file has {found} bytes, expected "
                    f"{size}; not read"
                )
            hasher = hashlib.sha256()
            received = 0
            while block := os.read(fd, min(BLOCK_SIZE, size - received + 1)):
                received += len(block)
                if received > size:
                    raise errors.DataLoss(f"registry {self.path}: {what}: it grew while read")
                hasher.update(block)
                dest.write(block)
                if progress is not None:
                    progress(received)
        finally:
            os.close(fd)
        if received != size:
            raise errors.DataLoss(f"registry {self.path}: {what}: got {received} of {size} bytes")
        if "sha256:" + hasher.hexdigest() != digest:
            raise errors.DataLoss(
                f"registry {self.path}: {what}: the bytes hash to sha256:{hasher.hexdigest()}: "
                "the copy there is damaged; delete it (or push it again from a node that has it)"
            )

    # -- manifests --------------------------------------------------------------------

    def put_manifest(self, repo: str, ref: str, manifest: bytes, media_type: str) -> str:
        """Store a manifest as a blob, then under its tag (an atomic rename); its digest."""
        check_repository(repo)
        if len(manifest) > MAX_MANIFEST_BYTES:
            raise errors.InvalidArgument(
                f"manifest for {repo}:{ref} has {len(manifest)} bytes, more than "
                f"{MAX_MANIFEST_BYTES}"
            )
        digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        if check_ref(ref).startswith("sha256:") and ref != digest:
            raise errors.InvalidArgument(f"manifest for {repo}@{ref} hashes to {digest}")
        _check_manifest(manifest, media_type, (media_type,), f"manifest for {repo}:{ref}")
        self.push_blob(repo, digest, len(manifest), lambda offset: io.BytesIO(manifest[offset:]))
        if ref.startswith("sha256:"):
            return digest
        with (
            self._repo_dirs(repo, "blobs", "sha256") as blobs,
            self._repo_dirs(repo, "tags", create=True) as tags,
        ):
            # The tag's name is taken by a rename (atomic, replaces as a registry's PUT
            # does); a link of its own first, since a link cannot replace a name.
            temp = f".{ref}.{secrets.token_hex(8)}"
            os.link(digest[7:], temp, src_dir_fd=blobs, dst_dir_fd=tags, follow_symlinks=False)
            try:
                os.rename(temp, ref, src_dir_fd=tags, dst_dir_fd=tags)
            finally:
                # Gone after a rename, except when the tag already was this manifest's
                # link: then rename(2) leaves both names.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp, dir_fd=tags)
            os.fsync(tags)
        return digest

    def get_manifest(
        self,
        repo: str,
        ref: str,
        *,
        max_size: int = MAX_MANIFEST_BYTES,
        accept: Sequence[str] = MANIFEST_MEDIA_TYPES,
    ) -> tuple[bytes, str, str]:
        """A manifest by tag or digest: ``(bytes, media type, digest)``, all verified."""
        check_repository(repo)
        by_digest = check_ref(ref).startswith("sha256:")
        what = f"read of manifest {repo}:{ref}"
        where = ("blobs", "sha256") if by_digest else ("tags",)
        name = ref[7:] if by_digest else ref
        with self._repo_dirs(repo, *where) as parent:
            try:
                body = fsutil.read_file_at(parent, name, max_size, path=f"{self.path}/{repo}")
            except FileNotFoundError:
                raise errors.NotFound(f"registry {self.path}: {what}: not there") from None
            except fsutil.TooLarge:
                raise errors.DataLoss(
                    f"registry {self.path}: {what}: more than the {max_size} bytes a "
                    "manifest may have; not read"
                ) from None
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if by_digest and digest != ref:
            raise errors.DataLoss(f"registry {self.path}: {what}: the manifest hashes to {digest}")
        media_type = _check_manifest(body, None, accept, f"registry {self.path}: {what}")
        return body, media_type, digest

    def delete_manifest(self, repo: str, digest: str) -> bool:
        """Remove a manifest and every tag that names it (blobs stay: module doc)."""
        check_repository(repo)
        check_digest(digest)
        with self._repo_dirs(repo, "blobs", "sha256") as blobs:
            try:
                target = os.lstat(digest[7:], dir_fd=blobs)
            except FileNotFoundError:
                raise errors.NotFound(
                    f"registry {self.path}: no manifest {digest} in {repo}"
                ) from None
            with self._repo_dirs(repo, "tags", create=True) as tags:
                for name in os.listdir(tags):
                    with contextlib.suppress(FileNotFoundError):
                        found = os.lstat(name, dir_fd=tags)
                        if (found.st_dev, found.st_ino) == (target.st_dev, target.st_ino):
                            os.unlink(name, dir_fd=tags)
                os.fsync(tags)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(digest[7:], dir_fd=blobs)
        return True

    # -- tags -------------------------------------------------------------------------

    def list_tags(
        self, repo: str, *, page_size: int = 1000, max_tags: int = DEFAULT_MAX_TAGS
    ) -> Iterator[str]:
        """The repository's tags, sorted; NotFound for a repository never written."""
        check_repository(repo)
        if not 0 < page_size <= 10_000:
            raise errors.InvalidArgument(f"tag page size {page_size}: give 1 to 10000")
        with self._repo_dirs(repo, "tags") as tags:
            names = os.listdir(tags)
        found = sorted(n for n in names if _is_tag(n))
        if len(found) > max_tags:
            raise errors.ResourceExhausted(
                f"registry {self.path}: {repo} has more than {max_tags} tags"
            )
        return iter(found)

    # -- helpers ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _repo_dirs(self, repo: str, *names: str, create: bool = False) -> Iterator[int]:
        """The fd of ``<dir>/<repo>/<names...>``, reached without following a symlink
        below the shared directory; NotFound when missing (and not to be created)."""
        where = os.path.join(self.path, repo, *names)
        try:
            root = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise errors.FailedPrecondition(
                f"registry {self.path}: the shared directory does not exist: mount it "
                "(every node mounts the same one) or create it, root-owned, 0700"
            ) from None
        try:
            _check_owner(root, self.path)
            with fsutil.opened_dir(root, *repo.split("/"), *names, path=where, create=create) as fd:
                yield fd
        except FileNotFoundError:
            raise errors.NotFound(f"registry {self.path}: {where} does not exist") from None
        finally:
            os.close(root)

    def _open(self, dir_fd: int, name: str, rel: str, what: str) -> int:
        try:
            return fsutil.open_file(dir_fd, name, path=os.path.join(self.path, rel))
        except FileNotFoundError:
            raise errors.NotFound(f"registry {self.path}: {what}: not there") from None

    def _write_verified(
        self,
        dir_fd: int,
        name: str,
        digest: str | None,
        size: int,
        open_source: OpenSource,
        progress: ProgressCallback | None,
        what: str,
        tap: Tap | None = None,
    ) -> str:
        """Write ``size`` bytes of the source, fsynced; their digest, which must be
        ``digest`` when given."""
        hasher = hashlib.sha256()
        written = 0
        fd = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
            dir_fd=dir_fd,
        )  # fmt: skip
        try:
            with open_source(0) as source:
                while written <= size and (block := source.read(BLOCK_SIZE)):
                    hasher.update(block)
                    if tap is not None:
                        tap.update(block)
                    fsutil.write_all(fd, block)
                    written += len(block)
                    if progress is not None:
                        progress(min(written, size))
            os.fsync(fd)
        finally:
            os.close(fd)
        actual = "sha256:" + hasher.hexdigest()
        if written != size or actual != (digest or actual):
            raise errors.DataLoss(
                f"registry {self.path}: {what}: the source gave {written} bytes hashing to "
                f"{actual}, not {size} bytes of {digest or 'the blob'} (it changed "
                "underneath); not written"
            )
        return actual


def _is_tag(name: str) -> bool:
    try:
        check_tag(name)
    except errors.InvalidArgument:
        return False  # a link being renamed into place (".<tag>.<random>"), or a stranger
    return True


def _regular_size(dir_fd: int, name: str) -> int | None:
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise errors.DataLoss(f"blob {name} in the shared directory is not a regular file")
    return st.st_size


def _sweep_stale(uploads: int) -> None:
    cutoff = time.time() - STALE_UPLOAD_S
    for name in os.listdir(uploads):
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(name, dir_fd=uploads).st_mtime < cutoff:
                os.unlink(name, dir_fd=uploads)


def _check_owner(fd: int, path: str) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise errors.PermissionDenied(
            f"registry {path}: the shared directory must be owned by uid {os.geteuid()} "
            f"and writable by it alone (it is uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}): checkpoints hold process memory. "
            f"chown {os.geteuid()} {path}; chmod 0700 {path}"
        )


def _check_manifest(body: bytes, media_type: str | None, accept: Sequence[str], what: str) -> str:
    """The manifest's declared media type, which must be one of ``accept``."""
    try:
        document = untrusted_json.loads(body)
    except ValueError as err:
        raise errors.DataLoss(f"{what}: not valid JSON: {err}") from None
    declared = document.get("mediaType") if isinstance(document, dict) else None
    if not isinstance(declared, str) or declared not in accept:
        raise errors.DataLoss(f"{what}: mediaType {declared!r} is not one of {list(accept)}")
    if media_type is not None and declared != media_type:
        raise errors.DataLoss(f"{what}: given as {media_type!r} but declares {declared!r}")
    return declared
