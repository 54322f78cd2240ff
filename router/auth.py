"""API keys (``spec.router.auth``): ``Authorization: Bearer <key>`` on every route but the open ones.

The keys are a file, one a line (blank lines and ``#`` comments ignored), which the operator mounts
from the deployment's Secret as a read-only volume. A volume rather than an environment variable:
the kubelet swaps a mounted Secret's files in place when the Secret changes, and the router re-reads
the file when it changes (checked every second), so adding a key, moving clients over and removing
the old one (rotation) needs no restart and drops no stream. (A ``subPath`` mount would not be
updated: the operator mounts the whole volume.)

Keys are held only as SHA-256 digests and compared with :func:`hmac.compare_digest` against every
key, whatever matched, so neither the time taken nor a log line says anything about them. A file
that cannot be read keeps the keys last read; a file with no keys refuses every request (fails
closed). Nothing here logs a key or what a client sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os

from disagg.api import metrics as m
from disagg.api.contract import ROUTER_LIVE_PATH, ROUTER_READY_PATH

log = logging.getLogger("disagg.router")

# Open without a key: the kubelet's probes. Everything else needs one, /metrics included where the serving
# port has it (a router without a metrics port, router/app.py): Prometheus scrapes the metrics ports, which
# serve nothing but /metrics and /livez.
OPEN_PATHS = frozenset({ROUTER_READY_PATH, ROUTER_LIVE_PATH})
RELOAD_INTERVAL_S = 1.0


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def parse(text: bytes) -> list[bytes]:
    """The keys of a keys file: one a line, surrounding whitespace dropped, blank and # lines skipped."""
    keys = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(b"#"):
            keys.append(line)
    return keys


class ApiKeys:
    def __init__(self, path: str, metrics) -> None:
        self.path = path
        self.metrics = metrics
        self._digests: tuple[bytes, ...] = ()
        self._seen: tuple | None = None
        # at start the file must be there: a router told to authenticate never starts open
        self._load(os.stat(path))
        metrics.api_keys.set_function(lambda: len(self._digests))

    def _load(self, st: os.stat_result) -> None:
        with open(self.path, "rb") as f:
            keys = parse(f.read())
        self._digests = tuple(_digest(k) for k in keys)
        self._seen = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        if keys:
            log.info("API keys loaded from %s: %d", self.path, len(keys))
        else:
            log.warning("no API keys in %s: every request that needs one is refused", self.path)

    def reload_if_changed(self) -> bool:
        """Re-reads the file when it changed (the kubelet swaps a Secret volume's files: new inode)."""
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size) == self._seen:
                return False
            self._load(st)
            return True
        except OSError as e:
            log.warning("API keys file %s unreadable (%s); keeping the %d keys last read",
                        self.path, e.strerror, len(self._digests))
            return False

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_INTERVAL_S)
            self.reload_if_changed()

    def failure(self, authorization: str | None) -> str | None:
        """None when the header carries a valid key, else why not (a metric label)."""
        scheme, _, presented = (authorization or "").strip().partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            return m.AUTH_MISSING
        digest = _digest(presented.encode("utf-8", "surrogateescape"))
        ok = False
        for d in self._digests:           # every key compared, whichever matches
            ok |= hmac.compare_digest(d, digest)
        return None if ok else m.AUTH_INVALID
