"""The layer catalogue: which layers this control plane knows, how they were
built, which ``name:version`` tags point at them, and which builds are cached.

It lives in the state database (tables in corral/state/db.py) so that
several gateways can share it later; the layer bytes live in the node's
LayerStore. At start the catalogue takes in what the store already holds
(the base images that setup built before any server existed).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from corral.api.errors import Conflict, InvalidRequest, NotFound
from corral.api.models import ImageConfig
from corral.images.registry import Reference, is_registry_reference, parse_reference
from corral.images.store import (
    DEFAULT_VERSION,
    ImageOrigin,
    ImageRecord,
    LayerRecord,
    LayerStore,
    check_name,
    parse_ref,
)
from corral.state.db import build_cache, image_tags, layers

__all__ = ["Catalogue", "CatalogueLayer", "input_key"]


@dataclass(frozen=True)
class CatalogueLayer:
    digest: str
    size_bytes: int
    kind: str
    parents: tuple[str, ...]
    source: dict[str, Any]
    labels: dict[str, str]
    created_at: float


def _tag_key(ref: str) -> tuple[str, str]:
    """(name, version) of a local ref (``name[:version]``) or a registry reference (``host/repo[:tag|@digest]``)."""
    if is_registry_reference(ref):
        reference = parse_reference(ref)
        return reference.name, reference.version
    return parse_ref(ref)


def input_key(inputs: dict[str, Any]) -> str:
    """A build's cache key: the sha256 of its inputs in canonical JSON."""
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


class Catalogue:
    def __init__(self, engine: Engine, store: LayerStore) -> None:
        self._engine = engine
        self.store = store
        self.generation = 0  # moves on with every tag or layer change made here (resolution caches check it)

    def sync_from_store(self) -> None:
        """Register the store's layers and seed tags that the catalogue lacks."""
        known = {row.digest for row in self._rows(select(layers.c.digest))}
        for record in self.store.layers():
            if record.digest not in known:
                self.add_layer(record, parents=(), source={"builder": "store"})
        tagged = {(row.name, row.version) for row in self._rows(select(image_tags.c.name, image_tags.c.version))}
        for image in self.store.images():
            if (image.name, image.version) not in tagged and all(self._has_layer(d) for d in image.layers):
                self.tag(image.name, image.layers, version=image.version)

    # -- layers ---------------------------------------------------------

    def add_layer(self, record: LayerRecord, *, parents: Sequence[str], source: dict[str, Any]) -> CatalogueLayer:
        values = {
            "digest": record.digest,
            "size_bytes": record.size_bytes,
            "kind": record.kind,
            "parents": list(parents),
            "source": source,
            "labels": record.labels,
            "created_at": record.created_at,
        }
        try:
            with self._engine.begin() as conn:
                conn.execute(insert(layers).values(**values))
        except IntegrityError:
            pass  # the same bytes were added before: keep the first record
        return self.layer(record.digest)

    def _has_layer(self, digest: str) -> bool:
        return bool(self._rows(select(layers.c.digest).where(layers.c.digest == digest)))

    def layer(self, digest: str) -> CatalogueLayer:
        rows = self._rows(select(layers).where(layers.c.digest == digest))
        if not rows:
            raise NotFound(f"layer {digest} is not in the catalogue (see `corral images ls --layers`)")
        row = rows[0]
        return CatalogueLayer(
            digest=row.digest,
            size_bytes=row.size_bytes,
            kind=row.kind,
            parents=tuple(row.parents),
            source=row.source,
            labels=row.labels,
            created_at=row.created_at,
        )

    def layer_from_oci(self, oci_digest: str) -> CatalogueLayer | None:
        """The layer pulled from this OCI layer digest, if it is still here (catalogue and store)."""
        rows = self._rows(select(layers.c.digest).where(layers.c.source["oci_digest"].as_string() == oci_digest))
        for row in rows:
            try:
                self.store.layer_path(row.digest)
            except NotFound:
                continue
            return self.layer(row.digest)
        return None

    def layers(self) -> list[CatalogueLayer]:
        return [self.layer(row.digest) for row in self._rows(select(layers.c.digest).order_by(layers.c.created_at))]

    def remove_layer(self, digest: str, *, in_use: bool) -> None:
        """Forget a layer and delete its file; refused while a tag or a sandbox uses it."""
        self.layer(digest)
        users = [image.ref for image in self.images() if digest in image.layers]
        if users or in_use:
            holders = ", ".join(users) if users else "running sandboxes"
            raise Conflict(f"layer {digest} is in use by {holders}: untag or kill them first")
        stale_builds = [row.input_key for row in self._rows(select(build_cache)) if digest in row.layers]
        with self._engine.begin() as conn:
            conn.execute(delete(layers).where(layers.c.digest == digest))
            conn.execute(delete(build_cache).where(build_cache.c.input_key.in_(stale_builds)))
        self.generation += 1
        self.store.remove(digest)

    def touch(self, digests: Sequence[str]) -> None:
        """Record that a sandbox was just created on these layers."""
        with self._engine.begin() as conn:
            conn.execute(update(layers).where(layers.c.digest.in_(list(digests))).values(last_used_at=time.time()))

    def evict(self, budget_bytes: int, *, in_use: set[str]) -> list[str]:
        """Delete untagged layers nothing uses, least recently used first, until the total fits the budget."""
        rows = self._rows(select(layers.c.digest, layers.c.size_bytes, layers.c.created_at, layers.c.last_used_at))
        total = sum(row.size_bytes for row in rows)
        tagged = {digest for image in self.images() for digest in image.layers}
        candidates = sorted(
            (row for row in rows if row.digest not in tagged and row.digest not in in_use),
            key=lambda row: row.last_used_at or row.created_at,
        )
        evicted = []
        for row in candidates:
            if total <= budget_bytes:
                break
            self.remove_layer(row.digest, in_use=False)
            total -= row.size_bytes
            evicted.append(row.digest)
        return evicted

    # -- tags -----------------------------------------------------------

    def tag(
        self,
        name: str,
        layer_digests: Sequence[str],
        *,
        version: str = DEFAULT_VERSION,
        config: ImageConfig | None = None,
        origin: ImageOrigin | None = None,
    ) -> ImageRecord:
        """Point ``name:version`` at layers (bottom first) with their image config; a tag may move (and takes the
        new config, none if not given), a digest never changes. ``origin``: the registry pull it came from."""
        check_name(name, "image name")
        check_name(version, "image version")
        return self._tag(name, version, layer_digests, config, origin)

    def tag_pulled(
        self, reference: Reference, layer_digests: Sequence[str], config: ImageConfig, origin: ImageOrigin
    ) -> ImageRecord:
        """Record a pulled image under its registry reference (``host/repo`` and its tag or digest)."""
        return self._tag(reference.name, reference.version, layer_digests, config, origin)

    def _tag(
        self,
        name: str,
        version: str,
        layer_digests: Sequence[str],
        config: ImageConfig | None,
        origin: ImageOrigin | None,
    ) -> ImageRecord:
        if isinstance(layer_digests, str) or not layer_digests:
            raise InvalidRequest("an image needs a non-empty list of layer digests, bottom first")
        for digest in layer_digests:
            self.layer(digest)
            self.store.layer_path(digest)
        now = time.time()
        stored_config = config.model_dump() if config is not None else None
        origin_json = origin.to_json() if origin is not None else None
        self.generation += 1
        with self._engine.begin() as conn:
            moved = conn.execute(
                update(image_tags)
                .where(image_tags.c.name == name, image_tags.c.version == version)
                .values(layers=list(layer_digests), updated_at=now, config=stored_config, origin=origin_json)
            ).rowcount
            if not moved:
                conn.execute(
                    insert(image_tags).values(
                        name=name,
                        version=version,
                        layers=list(layer_digests),
                        created_at=now,
                        updated_at=now,
                        config=stored_config,
                        origin=origin_json,
                    )  # fmt: skip
                )
        return self._resolve_key(name, version)

    def untag(self, ref: str) -> ImageRecord:
        image = self.resolve(ref)
        self.generation += 1
        with self._engine.begin() as conn:
            conn.execute(
                delete(image_tags).where(image_tags.c.name == image.name, image_tags.c.version == image.version)
            )
        return image

    def resolve(self, ref: str) -> ImageRecord:
        """``name`` (meaning ``name:latest``), ``name:version`` or a pulled registry reference to its record."""
        return self._resolve_key(*_tag_key(ref))

    def _resolve_key(self, name: str, version: str) -> ImageRecord:
        rows = self._rows(select(image_tags).where(image_tags.c.name == name, image_tags.c.version == version))
        if not rows:
            available = ", ".join(image.ref for image in self.images()) or "none: run scripts/setup.sh"
            wanted = f"{name}@{version}" if version.startswith("sha256:") else f"{name}:{version}"
            raise NotFound(f"image {wanted} not found; available: {available}")
        return self._image(rows[0])

    def images(self) -> list[ImageRecord]:
        rows = self._rows(select(image_tags).order_by(image_tags.c.name, image_tags.c.version))
        return [self._image(row) for row in rows]

    def _image(self, row: Any) -> ImageRecord:
        sizes = {
            r.digest: r.size_bytes
            for r in self._rows(select(layers.c.digest, layers.c.size_bytes).where(layers.c.digest.in_(row.layers)))
        }
        return ImageRecord(
            name=row.name,
            version=row.version,
            layers=tuple(row.layers),
            created_at=row.created_at,
            size_bytes=sum(sizes.get(d, 0) for d in row.layers),
            config=ImageConfig.model_validate(row.config or {}),
            origin=ImageOrigin.from_json(row.origin) if row.origin else None,
        )

    # -- build cache ----------------------------------------------------

    def cached_build(self, key: str) -> tuple[tuple[str, ...], ImageConfig | None] | None:
        """Layers (and image config, if it made one) an identical earlier build produced, if the layers are all
        still here."""
        rows = self._rows(select(build_cache.c.layers, build_cache.c.config).where(build_cache.c.input_key == key))
        if not rows:
            return None
        digests = tuple(rows[0].layers)
        try:
            for digest in digests:
                self.layer(digest)
                self.store.layer_path(digest)
        except NotFound:
            return None
        config = rows[0].config
        return digests, ImageConfig.model_validate(config) if config is not None else None

    def remember_build(self, key: str, layer_digests: Sequence[str], config: ImageConfig | None = None) -> None:
        stored_config = config.model_dump() if config is not None else None
        with self._engine.begin() as conn:
            conn.execute(delete(build_cache).where(build_cache.c.input_key == key))
            conn.execute(insert(build_cache).values(input_key=key, layers=list(layer_digests), created_at=time.time(),
                                                    config=stored_config))  # fmt: skip

    def _rows(self, query: Any) -> list[Any]:
        with self._engine.connect() as conn:
            return list(conn.execute(query))
