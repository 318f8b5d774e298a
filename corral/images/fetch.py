"""Layers a node lacks, from the shared layer store (a gateway serving layer blobs over HTTP).

Two ways, chosen by the setting ``layer_fetch``:

- ``on_demand`` (lazy.py): the layer is mounted at once from a FUSE file and
  its chunks are fetched, verified and kept as sandboxes read them.
- ``eager``: the whole blob is downloaded first. A layer is named by the
  sha256 of its bytes, so the file is hashed as it arrives and refused unless
  it hashes to the name asked for; only then is it imported (atomically) into
  this node's store. This is also the fallback where FUSE is not available.

Either way, concurrent sandboxes that need the same missing layer wait for one
fetch (or one mount), and what was fetched stays in the node's layer cache
(cache.py) under its disk budget.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Collection, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import httpx

from corral.api.errors import InternalError, NotFound, ServerUnavailable
from corral.config import Settings
from corral.images.cache import NodeLayerCache, fetched_layers
from corral.images.lazy import AuditSink, LayerSource, OnDemandLayers, build_lazyfs
from corral.images.store import LayerStore

__all__ = ["LayerFetcher", "layer_fetcher"]

log = logging.getLogger("corral.images")

_CHUNK = 1 << 20
_RECHECK_BUDGET_PART = 16  # on-demand chunks adding this part of the cache budget make the next create check it


def layer_fetcher(
    settings: Settings, store: LayerStore, api_key: str, *, audit: AuditSink | None = None
) -> LayerFetcher | None:
    """The node's fetcher as the settings say (None when there is no layer source)."""
    if not settings.layer_source_url:
        return None
    key = settings.layer_source_key or api_key
    on_demand = None
    if settings.layer_fetch == "on_demand":
        helper = build_lazyfs(settings.node_dir)
        if helper is None:
            log.warning("layer_fetch=on_demand needs /dev/fuse, pkg-config and libfuse3-dev: fetching layers whole")
        else:
            source = LayerSource(settings.layer_source_url, key, timeout_s=settings.layer_chunk_timeout_s)
            on_demand = OnDemandLayers(
                store, source, helper=helper, mount_root=settings.data_dir / "mnt" / "lazy",
                read_timeout_s=settings.layer_read_timeout_s, orphan_s=settings.layer_helper_orphan_s, audit=audit,
                node_name=f"node-{settings.edge_id}",
            )  # fmt: skip
    budget_mb = settings.layer_cache_budget_mb if settings.layer_cache_budget_mb is not None else \
        settings.layer_disk_budget_mb  # fmt: skip
    cache = None
    if budget_mb is not None:
        cache = NodeLayerCache(store, budget_mb << 20, discard=on_demand.discard if on_demand is not None else None)
    return LayerFetcher(store, settings.layer_source_url, key, on_demand=on_demand, cache=cache)


class LayerFetcher:
    def __init__(
        self,
        store: LayerStore,
        source_url: str,
        api_key: str,
        *,
        timeout_s: float = 600.0,
        on_demand: OnDemandLayers | None = None,
        cache: NodeLayerCache | None = None,
    ) -> None:
        """``cache``: keeps what is fetched under the node's disk budget (None: unbounded)."""
        self._store = store
        self._source_url = source_url.rstrip("/")
        self._api_key = api_key
        self._timeout_s = timeout_s
        self._inflight: dict[str, asyncio.Future[Path]] = {}
        self.on_demand = on_demand
        self.cache = cache
        self.downloads = 0  # layers actually fetched whole (not found locally)
        self._added = False  # a layer came since the cache was last checked
        self._checked_at_bytes = 0  # on-demand chunk bytes fetched when it was

    def path(self, digest: str) -> Path:
        """The layer's file on this node now: the store's, or the on-demand file of one being filled."""
        try:
            return self._store.layer_path(digest)
        except NotFound:
            filling = self.on_demand.path(digest) if self.on_demand is not None else None
            if filling is None:
                raise
            return filling

    def close(self, in_use: Collection[str] | None = ()) -> None:
        """Stop the on-demand helpers, but for those of the layers ``in_use`` by sandboxes left running (None:
        not known, all of them): they keep serving them, for the next server to reattach to (lazy.py)."""
        if self.on_demand is not None:
            self.on_demand.close(keep_serving=in_use)

    def hold(self, digests: Iterable[str]) -> AbstractContextManager[None]:
        """Keep these layers in the node's cache while a create that needs them runs (until it is recorded)."""
        return self.cache.hold(digests) if self.cache is not None else nullcontext()

    def cache_bytes(self) -> int:
        """What the layers this node fetched take on its disk now (what the cache budget bounds)."""
        return sum(layer.disk_bytes for layer in fetched_layers(self._store))

    async def enforce_cache_budget(self, in_use: Callable[[], set[str]]) -> list[str]:
        """Evict fetched layers nothing uses, least recently used first, if the cache grew past its budget.

        Looks only when a layer came since the last look, or on-demand chunks added a sixteenth of the budget,
        so a warm create costs nothing. ``in_use``: the layers this node's sandboxes run on."""
        cache = self.cache
        if cache is None:
            return []
        fetched = self.on_demand.fetched_bytes if self.on_demand is not None else 0
        if not self._added and fetched - self._checked_at_bytes < cache.budget_bytes // _RECHECK_BUDGET_PART:
            return []
        self._added, self._checked_at_bytes = False, fetched
        return await asyncio.to_thread(cache.evict, in_use)

    async def ensure(self, digest: str) -> Path:
        """The layer's file on this node, fetching it (or mounting it on demand) first if it is not there."""
        if self.cache is not None:
            self.cache.used(digest)
        try:
            return self.path(digest)
        except NotFound:
            pass
        self._added = True
        pending = self._inflight.get(digest)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Path] = asyncio.get_running_loop().create_future()
        self._inflight[digest] = future
        try:
            if self.on_demand is not None:
                path = await asyncio.to_thread(self.on_demand.open, digest)
            else:
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
