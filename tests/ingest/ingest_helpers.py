"""Ingest test helpers: a real HTTP server on loopback, feed documents, a config on disk."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from robot_llm.config import AppConfig, load_config

DEMO = Path(__file__).resolve().parents[2] / "robot_llm" / "demo_data"

INSTRUMENTS = [
    {"ticker": "SBER", "name": "Сбербанк", "aliases": ["Сбербанк*", "Sberbank", "Сбер"]},
    {"ticker": "GAZP", "name": "Газпром", "aliases": ["Газпром*", "Gazprom"]},
    {"ticker": "LKOH", "name": "Лукойл", "aliases": ["Лукойл*", "Lukoil"]},
    {"ticker": "YDEX", "name": "Яндекс", "aliases": ["Яндекс*", "Yandex"]},
    {"ticker": "AAPL", "name": "Apple", "aliases": ["Apple Inc"]},
    {"ticker": "NVDA", "name": "Nvidia", "aliases": ["re:nvidia(?:'s)?"]},
    {"ticker": "ON", "name": "onsemi", "aliases": ["ON Semiconductor"]},
]


@dataclass
class Reply:
    """One scripted HTTP response."""

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds to wait before answering (to trip a read timeout)
    content_length: bool = True  # False: close-delimited body, no length announced
    trickle: float = 0.0  # seconds between single bytes of the body (a server that never quite stalls)


@dataclass
class Seen:
    path: str
    headers: dict[str, str]


Route = Callable[[Seen], Reply]


class FeedServer:
    """A ThreadingHTTPServer on 127.0.0.1:0 whose answers each test scripts per path."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.requests: list[Seen] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen = Seen(self.path, {k.lower(): v for k, v in self.headers.items()})
                server.requests.append(seen)
                route = server.routes.get(self.path)
                reply = route(seen) if route else Reply(404, b"not found")
                if reply.delay:
                    time.sleep(reply.delay)
                try:
                    self.send_response(reply.status)
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    if reply.content_length:
                        self.send_header("Content-Length", str(len(reply.body)))
                    self.end_headers()
                    if reply.trickle:
                        for byte in reply.body:
                            self.wfile.write(bytes([byte]))
                            self.wfile.flush()
                            time.sleep(reply.trickle)
                    else:
                        self.wfile.write(reply.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout, size limit): that is the point of the test

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def serve(self, path: str, *replies: Reply) -> None:
        """Answer ``path`` with ``replies`` in turn; the last one repeats."""
        queue = list(replies)

        def route(_: Seen) -> Reply:
            return queue.pop(0) if len(queue) > 1 else queue[0]

        self.routes[path] = route

    def hits(self, path: str) -> list[Seen]:
        return [r for r in self.requests if r.path == path]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def gzipped(body: bytes) -> bytes:
    return gzip.compress(body)


def rss(*items: str, encoding: str = "utf-8", title: str = "Test feed", declare: str | None = "") -> bytes:
    """An RSS 2.0 document with the given ``<item>`` bodies in ``encoding``.

    The XML declaration names ``declare``: by default ``encoding`` itself; None leaves the
    encoding undeclared (feeds in the wild do both, and declare wrongly too).
    """
    inner = "".join(f"<item>{i}</item>" for i in items)
    declared = "" if declare is None else f' encoding="{declare or encoding}"'
    text = (
        f'<?xml version="1.0"{declared}?>\n<rss version="2.0"><channel><title>{title}</title>'
        f"<link>https://example.org/</link><description>d</description>{inner}</channel></rss>"
    )
    return text.encode(encoding)


def item(
    title: str, *, guid: str | None = None, link: str | None = None, date: str | None = None, text: str = ""
) -> str:
    out = f"<title>{title}</title><description>{text}</description>"
    if guid:
        out += f'<guid isPermaLink="false">{guid}</guid>'
    if link:
        out += f"<link>{link}</link>"
    if date:
        out += f"<pubDate>{date}</pubDate>"
    return out


def write_config(
    tmp_path: Path,
    db_url: str,
    *,
    feeds: list[dict[str, Any]] | None = None,
    drop_dirs: list[Path] | None = None,
    http: dict[str, Any] | None = None,
) -> Path:
    """A real YAML config file in ``tmp_path``; returns its path."""
    data = {
        "database": {"url": db_url},
        "instruments": INSTRUMENTS,
        "feeds": feeds or [],
        "http": {
            "connect_timeout": 2,
            "read_timeout": 2,
            "retries": 2,
            "backoff": 0.01,
            "total_timeout": 10,
            **(http or {}),
        },
        "signals": {"sources": [{"name": f"robot{i}", "drop_dir": str(d)} for i, d in enumerate(drop_dirs or [])]},
        "model": {"store": "store", "vocab": "voc.sp"},
    }
    path = tmp_path / "robot-llm.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


def make_config(tmp_path: Path, db_url: str, **kwargs: Any) -> AppConfig:
    return load_config(write_config(tmp_path, db_url, **kwargs))
