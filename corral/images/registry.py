"""A client of the OCI distribution API v2: references, manifests, auth and verified blob downloads.

What it trusts: nothing a registry sends. Every manifest fetched by digest and
every blob is hashed as it streams in and refused unless it hashes to the
digest asked for, so a registry (or a redirect target, or anything in between
on plain HTTP) can at worst make a pull fail, never put other bytes under a
digest. Plain HTTP is used only for the registries listed in
``CORRAL_INSECURE_REGISTRIES``, and for them only: a listed registry is never
spoken to over https, verified or not, so listing one cannot turn a failed
certificate check into an unverified connection. Any other registry is reached
over https, its certificate checked against the system's trust store plus the
CAs of ``CORRAL_REGISTRY_CA_FILE``. Each mismatch is refused with a message
naming the setting to change: a registry that only speaks HTTP and is not
listed, a certificate that is not trusted (and why: unknown issuer, wrong
host, expired), a listed registry that answers with TLS.

Auth follows the registry's ``WWW-Authenticate`` challenge: ``Basic`` answers
with the configured credentials for that host; ``Bearer`` gets a token from the
challenge's realm (with the credentials, or anonymously) for the scope asked
and caches it per repository. Blobs follow redirects (registries hand them to
object storage; httpx drops the Authorization header when a redirect leaves
the registry's origin) and resume with an HTTP Range request after a broken
connection, so a multi-GB layer does not start over.

Every request (manifests, indexes, tokens, blobs) is tried again after a
transient failure: a connection error, 408, 429 or a 5xx, after an exponential
backoff (with jitter, capped) or the ``Retry-After`` the registry sent (capped
too), at most ``retries`` times. An answer that will not change by asking
again (401 after the challenge was answered, 403, 404, any other 4xx, a
certificate that is not trusted) surfaces at once.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import random
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx

from corral.api.errors import InvalidRequest, NotFound, PermissionDenied, ServerUnavailable
from corral.api.models import is_registry_reference

__all__ = [
    "MANIFEST_ACCEPT",
    "Descriptor",
    "ImageManifest",
    "Reference",
    "RegistryClient",
    "RegistryConfig",
    "is_registry_reference",
    "load_auth_file",
    "parse_reference",
    "registry_trust",
]

log = logging.getLogger("corral.images")

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_ACCEPT = ", ".join((OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST))
_INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
PLATFORM = ("linux", "amd64")
MAX_MANIFEST_BYTES = 4 << 20
MAX_CONFIG_BYTES = 16 << 20
MAX_INDEX_DEPTH = 4
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_RETRIES = 5
RETRY_BACKOFF_S = 0.2  # before the first retry; doubled for each next one
MAX_RETRY_DELAY_S = 10.0  # the longest wait between two attempts, the registry's Retry-After included
_RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_ERROR_BODY_BYTES = 4096  # of a refusal's body, read to tell a TLS port answering plain HTTP
_T = TypeVar("_T")

_HOST_RE = (
    r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:]+\])"
)
_COMPONENT_RE = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REFERENCE_RE = re.compile(
    rf"^(?P<registry>{_HOST_RE}(?::[0-9]{{1,5}})?)/(?P<repository>{_COMPONENT_RE}(?:/{_COMPONENT_RE})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_CHALLENGE_RE = re.compile(r'(\w+)=(?:"((?:[^"\\]|\\.)*)"|([^,\s]*))')
MAX_REPOSITORY_CHARS = 128  # the catalogue's name column


@dataclass(frozen=True)
class Reference:
    """``registry/repository[:tag][@digest]``; a digest, when given, is what is pulled."""

    registry: str  # host[:port]
    repository: str  # ns/img
    tag: str | None
    digest: str | None

    @property
    def name(self) -> str:
        """Where the image is listed in the catalogue: ``registry/repository``."""
        return f"{self.registry}/{self.repository}"

    @property
    def version(self) -> str:
        """What is asked of the registry and the catalogue version: the digest when pinned by one, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        return f"{self.name}@{self.digest}" if self.digest else f"{self.name}:{self.tag or 'latest'}"


def parse_reference(ref: str) -> Reference:
    match = _REFERENCE_RE.match(ref) if isinstance(ref, str) else None
    if match is None:
        raise InvalidRequest(
            f"malformed registry reference {ref!r}: expected host[:port]/repository[:tag][@sha256:<64 hex>], "
            "repository components in lower case"
        )
    reference = Reference(match["registry"], match["repository"], match["tag"], match["digest"])
    if len(reference.name) > MAX_REPOSITORY_CHARS:
        raise InvalidRequest(f"registry reference {ref!r}: host and repository exceed {MAX_REPOSITORY_CHARS} chars")
    return reference


def load_auth_file(path: Path) -> dict[str, tuple[str, str]]:
    """Credentials from a docker-style ``auth.json`` / ``config.json``: ``{"auths": {host: {"auth": b64}}}``.

    Each entry gives ``auth`` (base64 of ``user:password``) or ``username`` and ``password``. Keys may be
    URLs (``https://host:port/v1/``); they are reduced to host[:port].
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidRequest(f"registry auth file {path} does not exist (CORRAL_REGISTRY_AUTH_FILE)") from None
    except ValueError as exc:
        raise InvalidRequest(f"registry auth file {path} is not valid JSON: {exc}") from None
    auths = data.get("auths") if isinstance(data, dict) else None
    if not isinstance(auths, dict):
        raise InvalidRequest(f'registry auth file {path} has no "auths" object')
    credentials = {}
    for key, entry in auths.items():
        if not isinstance(entry, dict):
            continue
        host = re.sub(r"^[a-z]+://", "", str(key)).split("/", 1)[0]
        if isinstance(entry.get("auth"), str) and entry["auth"]:
            try:
                user, sep, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                raise InvalidRequest(
                    f"registry auth file {path}: the auth of {host} is not base64 user:password"
                ) from None
            if not sep:
                raise InvalidRequest(
                    f"registry auth file {path}: the auth of {host} has no ':' between user and password"
                )
            credentials[host] = (user, password)
        elif isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
            credentials[host] = (entry["username"], entry["password"])
    return credentials


def registry_trust(ca_file: Path | None = None) -> ssl.SSLContext:
    """What https certificates of registries must chain to: the system's trust store, plus the CA certificates
    in the PEM bundle ``ca_file`` (``CORRAL_REGISTRY_CA_FILE``) if given."""
    context = ssl.create_default_context()
    if ca_file is not None:
        try:
            context.load_verify_locations(cafile=str(ca_file))
        except FileNotFoundError:
            raise InvalidRequest(f"registry CA file {ca_file} does not exist (CORRAL_REGISTRY_CA_FILE)") from None
        except ssl.SSLError as exc:
            raise InvalidRequest(
                f"registry CA file {ca_file} holds no PEM certificate OpenSSL can read (CORRAL_REGISTRY_CA_FILE): {exc}"
            ) from None
    return context


@dataclass(frozen=True)
class RegistryConfig:
    """How registries are reached: which speak plain HTTP, which CAs are trusted, whose credentials, how patient
    to be (``retries`` more attempts after a transient failure, waiting ``backoff_s``, then twice that ..., at
    most ``max_delay_s``)."""

    insecure: frozenset[str] = frozenset()  # host:port served over plain HTTP
    credentials: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # host[:port] -> (user, password)
    trust: ssl.SSLContext = field(default_factory=registry_trust)
    timeout_s: float = DEFAULT_TIMEOUT_S
    retries: int = DEFAULT_RETRIES
    backoff_s: float = RETRY_BACKOFF_S
    max_delay_s: float = MAX_RETRY_DELAY_S

    def base_url(self, registry: str) -> str:
        return f"{'http' if registry in self.insecure else 'https'}://{registry}"

    def retry_delay_s(self, retry: int, retry_after_s: float | None) -> float:
        """How long to wait before retry number ``retry`` (from 1): the registry's Retry-After if it sent one,
        else exponential backoff with jitter (half to all of it, so many pullers do not retry in step); capped."""
        if retry_after_s is not None:
            return min(self.max_delay_s, retry_after_s)
        backoff_s = min(self.max_delay_s, self.backoff_s * 2 ** (retry - 1))
        return float(backoff_s * random.uniform(0.5, 1.0))


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size_bytes: int

    @classmethod
    def parse(cls, data: Any, what: str) -> Descriptor:
        if not isinstance(data, dict):
            raise ServerUnavailable(f"{what} descriptor is not a JSON object")
        digest, size = data.get("digest"), data.get("size")
        if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
            raise ServerUnavailable(f"{what} descriptor has a missing or unsupported digest {digest!r} (sha256 only)")
        if not isinstance(size, int) or size < 0:
            raise ServerUnavailable(f"{what} descriptor {digest} has no valid size")
        return cls(media_type=str(data.get("mediaType", "")), digest=digest, size_bytes=size)


@dataclass(frozen=True)
class ImageManifest:
    """An image manifest for linux/amd64 and where it came from."""

    reference: Reference
    digest: str  # of the image manifest itself (the platform's, when the reference named an index)
    index_digest: str | None  # of the index or manifest list it was picked from, if any
    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]  # bottom first


class _Auth:
    """What answers one registry's challenges: basic credentials and cached bearer tokens per scope."""

    def __init__(self, credentials: tuple[str, str] | None) -> None:
        self.credentials = credentials
        self.headers: dict[str, str] = {}  # scope -> Authorization value that worked or was issued


class _Transient(Exception):
    """A failure that another attempt may not meet: a broken or refused connection, 408, 429, a 5xx.
    ``retry_after_s``: how long the registry asked to wait (its Retry-After header)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RegistryClient:
    """One pull's (or one server's) connection to registries; ``aclose`` when done.

    ``bytes_transferred`` counts the bytes of manifests, configs and blobs received, resumes included;
    ``retries`` the attempts made again after a transient failure.
    """

    def __init__(self, config: RegistryConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._config = config
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeout_s), follow_redirects=True, transport=transport, verify=config.trust
        )
        self._auth: dict[str, _Auth] = {}
        self.bytes_transferred = 0
        self.retries = 0

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- manifests --------------------------------------------------------

    async def manifest(self, reference: Reference) -> ImageManifest:
        """The reference's image manifest for linux/amd64 (through an index or manifest list if it names one)."""
        digest_wanted = reference.digest
        index_digest = None
        target = reference.version
        for _ in range(MAX_INDEX_DEPTH):
            body, media_type, digest = await self._manifest_bytes(reference, target)
            if digest_wanted is not None and digest != digest_wanted:
                raise ServerUnavailable(
                    f"manifest {target} of {reference.name} hashes to {digest}, not {digest_wanted}: refused"
                )
            document = _json_object(body, f"manifest {target} of {reference.name}")
            media_type = str(document.get("mediaType") or media_type).split(";")[0].strip()
            if media_type in _INDEX_TYPES or "manifests" in document:
                index_digest = index_digest or digest
                chosen = _pick_platform(document, reference)
                target = digest_wanted = chosen.digest
                continue
            if "layers" not in document or "config" not in document:
                raise ServerUnavailable(
                    f"manifest {target} of {reference} is neither an OCI/Docker v2 image manifest nor an index "
                    f"(media type {media_type!r}); schema 1 manifests are not supported"
                )
            layers = document["layers"]
            if not isinstance(layers, list):
                raise ServerUnavailable(f"manifest {digest} of {reference} has no layers list")
            return ImageManifest(
                reference=reference,
                digest=digest,
                index_digest=index_digest,
                media_type=media_type,
                config=Descriptor.parse(document["config"], "config"),
                layers=tuple(Descriptor.parse(layer, "layer") for layer in layers),
            )
        raise ServerUnavailable(f"the indexes of {reference} are nested more than {MAX_INDEX_DEPTH} deep")

    async def _manifest_bytes(self, reference: Reference, target: str) -> tuple[bytes, str, str]:
        url = f"{self._config.base_url(reference.registry)}/v2/{reference.repository}/manifests/{target}"
        what = f"manifest {target} of {reference.name}"

        async def attempt() -> tuple[bytes, httpx.Headers]:
            try:
                response = await self._send("GET", url, reference, headers={"Accept": MANIFEST_ACCEPT})
                try:
                    if response.status_code == 404:
                        raise NotFound(f"{reference.name}:{target} is not in registry {reference.registry} (404)")
                    await _raise_for_status(response, what)
                    return await _read_capped(response, MAX_MANIFEST_BYTES, what), response.headers
                finally:
                    await response.aclose()
            except httpx.TransportError as exc:
                raise _transport_failure(exc, url, reference.registry) from exc

        body, headers = await self._retrying(f"get {what}", attempt)
        self.bytes_transferred += len(body)
        digest = f"sha256:{hashlib.sha256(body).hexdigest()}"
        claimed = headers.get("docker-content-digest")
        if claimed and claimed.startswith("sha256:") and claimed != digest:
            raise ServerUnavailable(
                f"manifest {target} of {reference.name} hashes to {digest}, but the registry says {claimed}: refused"
            )
        return body, headers.get("content-type", ""), digest

    async def config(self, manifest: ImageManifest) -> dict[str, Any]:
        """The image config blob (Env, WorkingDir, User, Entrypoint, Cmd, Labels under "config"), verified."""
        if manifest.config.size_bytes > MAX_CONFIG_BYTES:
            raise ServerUnavailable(f"image config {manifest.config.digest} is over {MAX_CONFIG_BYTES} bytes")
        chunks: list[bytes] = []
        await self._fetch_blob(manifest.reference, manifest.config, chunks.append, lambda: chunks.clear())
        return _json_object(b"".join(chunks), f"image config {manifest.config.digest}")

    # -- blobs ------------------------------------------------------------

    async def download_blob(
        self, reference: Reference, blob: Descriptor, dest: Path, *, on_bytes: Callable[[int], None] | None = None
    ) -> None:
        """Write the blob to ``dest``, verified; resumes with Range after a broken connection."""
        with open(dest, "wb") as out:

            def restart() -> None:
                out.seek(0)
                out.truncate()

            def write(chunk: bytes) -> None:
                out.write(chunk)
                if on_bytes is not None:
                    on_bytes(len(chunk))

            await self._fetch_blob(reference, blob, write, restart)

    async def _fetch_blob(
        self, reference: Reference, blob: Descriptor, write: Callable[[bytes], None], restart: Callable[[], None]
    ) -> None:
        url = f"{self._config.base_url(reference.registry)}/v2/{reference.repository}/blobs/{blob.digest}"
        what = f"blob {blob.digest} of {reference.name}"
        hasher, received = hashlib.sha256(), 0

        async def attempt() -> None:
            nonlocal hasher, received
            headers = {"Range": f"bytes={received}-"} if received else {}
            try:
                response = await self._send("GET", url, reference, headers=headers)
                try:
                    if response.status_code == 404:
                        raise NotFound(f"{what} is not in the registry (404)")
                    await _raise_for_status(response, what)
                    if received and response.status_code != 206:  # Range ignored: the whole blob again
                        hasher, received = hashlib.sha256(), 0
                        restart()
                    # No chunk size: each read is kept as it arrives, so a broken connection loses none of it.
                    async for chunk in response.aiter_raw():
                        received += len(chunk)
                        self.bytes_transferred += len(chunk)
                        if received > blob.size_bytes:
                            raise ServerUnavailable(f"{what} is longer than its {blob.size_bytes} bytes: refused")
                        hasher.update(chunk)
                        write(chunk)
                finally:
                    await response.aclose()
            except httpx.TransportError as exc:  # a broken connection: the next attempt resumes where it stopped
                log.info("blob %s of %s: %r after %d bytes", blob.digest[:19], reference, exc, received)
                raise _transport_failure(exc, url, reference.registry) from exc
            if received < blob.size_bytes:
                raise _Transient(f"the blob stream ended after {received} of {blob.size_bytes} bytes")

        await self._retrying(f"download {what}", attempt)
        digest = f"sha256:{hasher.hexdigest()}"
        if digest != blob.digest:
            raise ServerUnavailable(
                f"blob {blob.digest} of {reference} is corrupt: its bytes hash to {digest}; refused (nothing was kept)"
            )

    # -- auth, retries and transport -------------------------------------

    async def _retrying(self, what: str, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """``attempt()``, again after each transient failure, at most ``retries`` more times; any other error
        surfaces at once. ``what`` ends the message when the attempts run out ("get manifest ...")."""
        attempts = self._config.retries + 1
        for number in range(1, attempts + 1):
            try:
                return await attempt()
            except _Transient as exc:
                if number == attempts:
                    raise ServerUnavailable(f"{exc}; gave up after {attempts} attempts to {what}") from None
                delay_s = self._config.retry_delay_s(number, exc.retry_after_s)
                log.info("%s: %s; attempt %d of %d in %.2f s", what, exc, number + 1, attempts, delay_s)
                self.retries += 1
                await asyncio.sleep(delay_s)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _send(self, method: str, url: str, reference: Reference, *, headers: dict[str, str]) -> httpx.Response:
        """Send with the auth this repository needs, answering one challenge; the response is streamed."""
        auth = self._auth.get(reference.registry)
        if auth is None:
            auth = self._auth[reference.registry] = _Auth(self._config.credentials.get(reference.registry))
        scope = f"repository:{reference.repository}:pull"
        for answered in (False, True):
            request_headers = dict(headers)
            if scope in auth.headers:
                request_headers["Authorization"] = auth.headers[scope]
            request = self._http.build_request(method, url, headers=request_headers)
            response = await self._http.send(request, stream=True)
            if response.status_code != 401:
                return response
            await response.aclose()
            if answered:
                break
            challenge = response.headers.get("www-authenticate", "")
            auth.headers[scope] = await self._answer(challenge, auth, reference, scope)
        who = f"as {auth.credentials[0]!r}" if auth.credentials else "anonymously"
        raise PermissionDenied(
            f"registry {reference.registry} refused access to {reference.repository} {who} (401): check the "
            "credentials for it in CORRAL_REGISTRY_CREDENTIALS or CORRAL_REGISTRY_AUTH_FILE"
        )

    async def _answer(self, challenge: str, auth: _Auth, reference: Reference, scope: str) -> str:
        """The Authorization value that answers a ``WWW-Authenticate`` challenge."""
        scheme, _, params_text = challenge.strip().partition(" ")
        params = {key.lower(): (quoted if quoted else bare) for key, quoted, bare in _CHALLENGE_RE.findall(params_text)}
        if scheme.lower() == "basic":
            if auth.credentials is None:
                raise PermissionDenied(
                    f"registry {reference.registry} asks for a user and password (Basic auth) and none is configured: "
                    "set CORRAL_REGISTRY_CREDENTIALS or CORRAL_REGISTRY_AUTH_FILE"
                )
            return _basic(auth.credentials)
        if scheme.lower() == "bearer" and params.get("realm"):
            return f"Bearer {await self._token(params, auth, reference, scope)}"
        raise PermissionDenied(
            f"registry {reference.registry} answered 401 with an unsupported challenge {challenge[:200]!r}"
        )

    async def _token(self, params: dict[str, str], auth: _Auth, reference: Reference, scope: str) -> str:
        query = {
            "scope": params.get("scope") or scope,
            **({"service": params["service"]} if "service" in params else {}),
        }
        headers = {"Authorization": _basic(auth.credentials)} if auth.credentials else {}
        realm = params["realm"]

        async def attempt() -> str:
            try:
                response = await self._http.get(realm, params=query, headers=headers)
            except httpx.TransportError as exc:
                raise _transport_failure(exc, realm, reference.registry) from exc
            if response.status_code in (401, 403):
                who = f"as {auth.credentials[0]!r}" if auth.credentials else "anonymously"
                raise PermissionDenied(
                    f"the token server {realm} of registry {reference.registry} refused {who} "
                    f"({response.status_code}) for {query['scope']}: check CORRAL_REGISTRY_CREDENTIALS or "
                    "CORRAL_REGISTRY_AUTH_FILE"
                )
            await _raise_for_status(response, f"the token for {reference}")
            try:
                body = response.json()
                token = body.get("token") or body.get("access_token")
            except (ValueError, AttributeError):
                token = None
            if not isinstance(token, str) or not token:
                raise ServerUnavailable(f"the token server {realm} answered without a token")
            return token

        return await self._retrying(f"get a token for {reference} from {realm}", attempt)


def _pick_platform(index: dict[str, Any], reference: Reference) -> Descriptor:
    manifests = index.get("manifests")
    if not isinstance(manifests, list) or not manifests:
        raise ServerUnavailable(f"the index of {reference} lists no manifests")
    offered = []
    for entry in manifests:
        platform = entry.get("platform") if isinstance(entry, dict) else None
        pair = (platform.get("os"), platform.get("architecture")) if isinstance(platform, dict) else (None, None)
        if pair == PLATFORM:
            return Descriptor.parse(entry, "manifest")
        offered.append("/".join(str(part) for part in pair))
    raise NotFound(f"{reference} has no linux/amd64 image; the index offers {', '.join(offered)}")


def _json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise ServerUnavailable(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ServerUnavailable(f"{what} is not a JSON object")
    return document


async def _read_capped(response: httpx.Response, limit: int, what: str) -> bytes:
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            raise ServerUnavailable(f"{what} is over {limit} bytes: refused")
        chunks.append(chunk)
    return b"".join(chunks)


async def _raise_for_status(response: httpx.Response, what: str) -> None:
    """Nothing for a 2xx; a transient failure (408, 429, 5xx) to try again; else the error it is, at once."""
    status = response.status_code
    if 200 <= status < 300:
        return
    registry = f"{response.url.host}:{response.url.port}" if response.url.port else response.url.host
    if status in _RETRIED_STATUSES:  # "what" ends the message when the attempts run out
        raise _Transient(f"registry {registry} answered {status}", _retry_after_s(response))
    if status == 403:
        raise PermissionDenied(f"the registry refused {what} (403)")
    if status == 400 and response.url.scheme == "http":
        head = b""
        async for chunk in response.aiter_bytes():
            head += chunk
            if len(head) >= _ERROR_BODY_BYTES:
                break
        body = head[:_ERROR_BODY_BYTES].decode(errors="replace")
        if "https" in body.lower():  # Go: "Client sent an HTTP request to an HTTPS server."; nginx alike
            raise ServerUnavailable(
                f"registry {registry} speaks https ({body.strip()[:120]!r}), but it is listed in "
                "CORRAL_INSECURE_REGISTRIES, whose registries are reached over plain HTTP only: remove it from "
                "that list (and if a private CA signed its certificate, give the CA in CORRAL_REGISTRY_CA_FILE)"
            )
    raise ServerUnavailable(f"the registry {registry} answered {status} for {what}")


def _retry_after_s(response: httpx.Response) -> float | None:
    """The Retry-After header as seconds from now (it is delta-seconds or an HTTP date); None if absent or bad."""
    value = response.headers.get("retry-after", "").strip()
    if value.isdigit():
        return float(value)
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _transport_failure(exc: httpx.TransportError, url: str, registry: str) -> Exception:
    """What a transport error means: a certificate that is not trusted or plain HTTP at an https URL surface at
    once (asking again will not change them); any other failure (refused, reset, timed out) is transient."""
    verify = _certificate_error(exc)
    if verify is not None:
        return ServerUnavailable(
            f"the https certificate of registry {registry} is not trusted ({verify.verify_message}; {url}): if a "
            "private CA signed it, give that CA's certificate (PEM) in CORRAL_REGISTRY_CA_FILE; Corral never "
            "connects over https without verifying the certificate"
        )
    if url.startswith("https://") and _looks_like_plain_http(exc):
        return ServerUnavailable(
            f"registry {registry} does not speak https ({exc}); if it serves plain HTTP and you trust the network "
            "to it, list it in CORRAL_INSECURE_REGISTRIES (host:port, comma-separated)"
        )
    if isinstance(exc, httpx.ConnectError):
        return _Transient(f"cannot connect to registry {registry} ({url}): {exc}")
    return _Transient(f"{exc!r} from {url}")


def _certificate_error(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate check that failed somewhere in the chain of causes (httpx wraps httpcore wraps ssl)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _basic(credentials: tuple[str, str] | None) -> str:
    user, password = credentials or ("", "")
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _looks_like_plain_http(exc: httpx.TransportError) -> bool:
    text = repr(exc).lower()
    return any(sign in text for sign in ("wrong version number", "record layer failure", "packet length too long"))
