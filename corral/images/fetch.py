"""Layers a node lacks, fetched once from the shared layer store (a gateway serving layer blobs over HTTP).

A layer is named by the sha256 of its bytes, so a fetched file is hashed as
it arrives and refused unless it hashes to the name asked for; only then is it
imported (atomically) into this node's store. Concurrent sandboxes that need
the same missing layer wait for one download.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path

import httpx

from corral.images.store import LayerStore
from corral.sdk._exceptions import InternalError, NotFound, ServerUnavailable

__all__ = ["LayerFetcher"]

log = logging.getLogger("corral.images")

_CHUNK = 1 << 20


class LayerFetcher:
    def __init__(self, store: LayerStore, source_url: str, api_key: str, *, timeout_s: float = 600.0) -> None:
        self._store = store
        self._source_url = source_url.rstrip("/")
        self._api_key = api_key
        self._timeout_s = timeout_s
        self._inflight: dict[str, asyncio.Future[Path]] = {}
        self.downloads = 0  # layers actually fetched (not found locally)

    async def ensure(self, digest: str) -> Path:
        """The layer's path in this node's store, fetching it first if it is not there."""
        try:
            return self._store.layer_path(digest)
        except NotFound:
            pass
        pending = self._inflight.get(digest)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Path] = asyncio.get_running_loop().create_future()
        self._inflight[digest] = future
        try:
            path = await self._fetch(digest)
            future.set_result(path)
            return path
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters get it, nobody else has to
            raise
        finally:
            del self._inflight[digest]

    async def _fetch(self, digest: str) -> Path:
        started = time.monotonic()
        url = f"{self._source_url}/v1/layers/{digest}/blob"
        headers = {"Authorization": f"Bearer {self._api_key}"}
        fd, tmp_name = tempfile.mkstemp(prefix=".fetch-", dir=self._store.root)
        tmp = Path(tmp_name)
        try:
            hasher = hashlib.sha256()
            size = 0
            async with httpx.AsyncClient(timeout=httpx.Timeout(self._timeout_s)) as client:
                async with client.stream("GET", url, headers=headers) as response:
                    if response.status_code == 404:
                        raise NotFound(f"layer {digest} is neither on this node nor in the layer store {url}")
                    if response.status_code != 200:
                        raise ServerUnavailable(f"the layer store answered {response.status_code} for {url}")
                    kind = response.headers.get("x-corral-layer-kind", "base")
                    with os.fdopen(fd, "wb") as out:
                        fd = -1
                        async for chunk in response.aiter_bytes(_CHUNK):
                            hasher.update(chunk)
                            size += len(chunk)
                            out.write(chunk)
            if f"sha256:{hasher.hexdigest()}" != digest:
                raise InternalError(
                    f"layer {digest} fetched from {url} hashes to sha256:{hasher.hexdigest()[:12]}…: refused"
                )
            record = await asyncio.to_thread(
                self._store.import_layer, tmp, kind=kind, labels={"fetched_from": self._source_url}, move=True
            )
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"cannot fetch layer {digest} from {url}: {exc!r}") from exc
        finally:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
        self.downloads += 1
        log.info("fetched layer %s (%.1f MB) from %s in %.2f s", digest[:19], size / 1e6, self._source_url,
                 time.monotonic() - started)  # fmt: skip
        return self._store.layer_path(record.digest)
