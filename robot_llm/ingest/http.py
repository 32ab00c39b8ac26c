"""Fetching a feed document: HTTP(S) with httpx, or a local file.

feedparser's own fetching has no timeout (and its next major version drops it), so we
fetch ourselves and hand feedparser bytes and headers. One call to :func:`fetch`:

- sends our User-Agent and, when we have them, ``If-None-Match`` / ``If-Modified-Since``
  (conditional GET: a ``304`` comes back as ``FetchResult(not_modified=True)``);
- follows redirects (at most 5);
- applies the connect and read timeouts, and a ceiling on the whole attempt (not retried);
- stops reading once the *decoded* body passes ``max_bytes`` (a gzip bomb counts in full);
- retries timeouts, connection errors, 5xx and 429 with exponential backoff
  (``backoff``, ``2*backoff``, ...; a ``Retry-After`` in seconds is honoured up to 60 s);
  a 4xx other than 429 is final.

Local paths and ``file://`` URLs are read directly; their mtime and size play the role of an
ETag, so an unchanged file is "not modified" too.
"""

from __future__ import annotations

import dataclasses
import email.utils
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx

from robot_llm.config_sections import HttpConfig
from robot_llm.errors import RobotLLMError

__all__ = ["FetchError", "FetchResult", "fetch", "is_local", "make_client"]

_MAX_REDIRECTS = 5
_MAX_RETRY_AFTER = 60.0
_ACCEPT = (
    "application/rss+xml, application/atom+xml, application/rdf+xml;q=0.9, application/xml;q=0.8, "
    "text/xml;q=0.8, */*;q=0.1"
)


class FetchError(RobotLLMError):
    """A feed could not be fetched; ``http_status`` is set when a server answered."""

    def __init__(self, message: str, *, http_status: int | None = None, attempts: int = 1) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.attempts = attempts


@dataclass(frozen=True)
class FetchResult:
    """What came back: the body (empty when not modified), the headers and the cache validators."""

    url: str
    """The final URL (after redirects), or the local path."""
    http_status: int | None
    """The HTTP status code; ``None`` for a local file."""
    content: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    """Response headers, names lower-cased."""
    etag: str | None = None
    last_modified: str | None = None
    not_modified: bool = False
    attempts: int = 1


def is_local(url: str) -> bool:
    """True for ``file://`` URLs and plain paths (anything that is not http(s))."""
    return not url.startswith(("http://", "https://"))


def _local_path(url: str) -> Path:
    if url.startswith("file://"):
        return Path(unquote(urlparse(url).path))
    return Path(url)


def _fetch_local(url: str, max_bytes: int, etag: str | None) -> FetchResult:
    path = _local_path(url)
    try:
        st = path.stat()
        if st.st_size > max_bytes:
            raise FetchError(f"{path}: {st.st_size} bytes is over the limit of {max_bytes} (http.max_bytes)")
        validator = f'"{st.st_mtime_ns:x}-{st.st_size:x}"'
        if etag == validator:
            return FetchResult(url=str(path), http_status=None, content=b"", etag=etag, not_modified=True)
        content = path.read_bytes()
    except FileNotFoundError:
        raise FetchError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise FetchError(f"{path}: is a folder, not a feed file") from None
    except PermissionError:
        raise FetchError(f"{path}: permission denied") from None
    last_modified = email.utils.formatdate(st.st_mtime, usegmt=True)
    return FetchResult(
        url=str(path),
        http_status=None,
        content=content,
        headers={
            # Without a content type feedparser flags every local file as bozo; the XML
            # declaration inside the file still decides the encoding.
            "content-type": "text/html" if path.suffix.lower() in (".html", ".htm") else "application/xml",
            "content-location": path.resolve().as_uri(),
            "last-modified": last_modified,
        },
        etag=validator,
        last_modified=last_modified,
    )


class _Retryable(Exception):
    def __init__(self, message: str, http_status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.retry_after = retry_after


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return min(max(float(value), 0.0), _MAX_RETRY_AFTER)
    except ValueError:
        return None  # an HTTP-date: use our own backoff rather than trust a remote clock


def _attempt(client: httpx.Client, url: str, headers: dict[str, str], http: HttpConfig) -> FetchResult:
    deadline = time.monotonic() + http.total_timeout.total_seconds()
    limit = http.max_bytes
    try:
        with client.stream("GET", url, headers=headers) as response:
            status = response.status_code
            if status == 304:
                return FetchResult(
                    url=str(response.url),
                    http_status=304,
                    content=b"",
                    headers={k.lower(): v for k, v in response.headers.items()},
                    etag=response.headers.get("etag"),
                    last_modified=response.headers.get("last-modified"),
                    not_modified=True,
                )
            if status >= 500 or status == 429:
                raise _Retryable(
                    f"HTTP {status} {response.reason_phrase}".strip(),
                    http_status=status,
                    retry_after=_retry_after(response.headers.get("retry-after")),
                )
            if status >= 400:
                raise FetchError(f"{url}: HTTP {status} {response.reason_phrase}".strip(), http_status=status)
            declared = response.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > limit:
                raise FetchError(
                    f"{url}: the body of {declared} bytes is over the limit of {limit} (http.max_bytes)",
                    http_status=status,
                )
            chunks: list[bytes] = []
            size = 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > limit:
                    raise FetchError(
                        f"{url}: the body is over the limit of {limit} bytes (http.max_bytes); stopped reading",
                        http_status=status,
                    )
                if time.monotonic() > deadline:
                    raise FetchError(
                        f"{url}: took longer than {http.total_timeout.total_seconds():g}s (http.total_timeout)",
                        http_status=status,
                    )
                chunks.append(chunk)
            return FetchResult(
                url=str(response.url),
                http_status=status,
                content=b"".join(chunks),
                headers={k.lower(): v for k, v in response.headers.items()},
                etag=response.headers.get("etag"),
                last_modified=response.headers.get("last-modified"),
            )
    except httpx.TooManyRedirects:
        raise FetchError(f"{url}: more than {_MAX_REDIRECTS} redirects") from None
    except httpx.TimeoutException as exc:
        kind = {
            httpx.ConnectTimeout: "connect timeout",
            httpx.ReadTimeout: "read timeout",
            httpx.PoolTimeout: "pool timeout",
            httpx.WriteTimeout: "write timeout",
        }.get(type(exc), "timeout")
        raise _Retryable(kind) from None
    except httpx.DecodingError as exc:
        raise FetchError(f"{url}: cannot decode the response body: {exc}") from None
    except httpx.TransportError as exc:
        raise _Retryable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from None
    except httpx.InvalidURL as exc:
        raise FetchError(f"{url}: invalid URL: {exc}") from None


def fetch(
    url: str,
    http: HttpConfig,
    *,
    etag: str | None = None,
    last_modified: str | None = None,
    client: httpx.Client | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> FetchResult:
    """Fetch ``url`` (http(s), ``file://`` or a local path) under the rules in the module docstring.

    ``etag`` / ``last_modified`` are the validators stored from the previous fetch. Raises
    :class:`FetchError` when every attempt failed or the failure is not worth retrying.
    """
    if is_local(url):
        return _fetch_local(url, http.max_bytes, etag)
    headers = {"User-Agent": http.user_agent, "Accept": _ACCEPT}
    if etag:
        headers["If-None-Match"] = etag
    if last_modified:
        headers["If-Modified-Since"] = last_modified
    own = client is None
    if client is None:
        client = make_client(http)
    attempts = http.retries + 1
    attempt = 0
    try:
        while True:
            attempt += 1
            try:
                result = _attempt(client, url, headers, http)
            except _Retryable as exc:
                if attempt >= attempts:
                    raise FetchError(
                        f"{url}: {exc} (after {attempts} attempt{'s' if attempts > 1 else ''})",
                        http_status=exc.http_status,
                        attempts=attempt,
                    ) from None
                delay = http.backoff.total_seconds() * 2 ** (attempt - 1)
                if exc.retry_after is not None:
                    delay = max(delay, exc.retry_after)
                sleep(delay)
                continue
            except FetchError as exc:
                exc.attempts = attempt
                raise
            return dataclasses.replace(result, attempts=attempt)
    finally:
        if own:
            client.close()


def make_client(http: HttpConfig) -> httpx.Client:
    """An httpx client with the configured timeouts and redirect policy (reuse it across feeds)."""
    connect = http.connect_timeout.total_seconds()
    read = http.read_timeout.total_seconds()
    return httpx.Client(
        timeout=httpx.Timeout(connect=connect, read=read, write=read, pool=connect),
        follow_redirects=True,
        max_redirects=_MAX_REDIRECTS,
        headers={"User-Agent": http.user_agent},
    )
