"""A real, small filesystem that fills up: a tmpfs of a few MB seen by one process only.

The disk-full test needs writes that the kernel refuses with ENOSPC, the way a
full disk refuses them, without touching the machine's own disks or mounts.
``SmallDisk.prefix`` starts a process in a mount namespace of its own
(``unshare --mount``, with ``--map-root-user`` when not root) where a tmpfs of
``size_mb`` is mounted at ``path``; nobody else sees that mount. The test
fills the disk with a filler file reached through ``/proc/<pid>/root``, then
deletes it to free the space, and runs operator commands inside the same
namespace (``enter``): SQLite resolves ``/proc/<pid>/root`` to ``/`` and
would open another file, so the database is only ever opened from inside.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

from tests.support.waits import HANG_S

__all__ = ["SmallDisk"]

_MOUNT = 'mount -t tmpfs -o size={size}m,mode=0700 tmpfs "$0" && exec "$@"'


class SmallDisk:
    def __init__(self, path: Path, size_mb: int = 16) -> None:
        self.path = path
        self.size_mb = size_mb
        self.pid: int | None = None
        path.mkdir(parents=True, exist_ok=True)

    @property
    def prefix(self) -> tuple[str, ...]:
        unshare = shutil.which("unshare")
        if unshare is None:
            raise AssertionError("the disk-full test needs unshare(1) (util-linux)")
        flags = ["--mount"] if os.geteuid() == 0 else ["--mount", "--map-root-user"]
        return (unshare, *flags, "sh", "-c", _MOUNT.format(size=self.size_mb), str(self.path))

    @staticmethod
    def works() -> str | None:
        """Why a private tmpfs cannot be mounted here, or None when it can."""
        probe = SmallDisk(Path("/tmp"), 1)
        try:
            out = subprocess.run(
                [*probe.prefix, "true"], capture_output=True, text=True, timeout=HANG_S, check=False
            )
        except AssertionError as exc:
            return str(exc)
        return None if out.returncode == 0 else out.stderr.strip() or "unshare failed"

    def enter(self) -> tuple[str, ...]:
        """A command prefix that runs a command in the owner's mount namespace."""
        assert self.pid is not None, "start the process first and set .pid"
        nsenter = shutil.which("nsenter")
        if nsenter is None:
            raise AssertionError("the disk-full test needs nsenter(1) (util-linux)")
        spaces = ["--mount"] if os.geteuid() == 0 else ["--user", "--mount"]
        return (nsenter, f"--target={self.pid}", *spaces, "--")

    def seen_from_outside(self) -> Path:
        """The mount as this (the test's) process reaches it: through the owner's root."""
        assert self.pid is not None, "start the process first and set .pid"
        return Path(f"/proc/{self.pid}/root") / self.path.relative_to("/")

    def fill(self) -> int:
        """Write a filler file until the disk is full; the bytes it took."""
        fd = os.open(self.seen_from_outside() / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        written = 0
        try:
            for size in (1 << 20, 65536, 4096, 512, 1):  # the last bytes too
                block = b"\0" * size
                while True:
                    try:
                        n = os.write(fd, block)
                    except OSError as exc:
                        assert exc.errno == errno.ENOSPC, exc
                        break
                    written += n
                    if n < size:
                        break
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        (self.seen_from_outside() / "filler").unlink()
