"""robot_llm.ingest.http against a real HTTP server on loopback (no database)."""

from __future__ import annotations

import gzip
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
from ingest_helpers import FeedServer, Reply, item, rss

from robot_llm.config_sections import HttpConfig
from robot_llm.ingest.http import FetchError, fetch

FAST = HttpConfig(
    connect_timeout=timedelta(seconds=2),
    read_timeout=timedelta(seconds=2),
    retries=2,
    backoff=timedelta(seconds=0.01),
    user_agent="robot-llm-test/1",
)
BODY = rss(item("Hello", guid="g1"))


def test_user_agent_validators_and_304(server: FeedServer) -> None:
    def route(seen):  # conditional GET as a real server does it
        if seen.headers.get("if-none-match") == '"v1"' or seen.headers.get("if-modified-since") == "LM1":
            return Reply(304, headers={"ETag": '"v1"'})
        return Reply(200, BODY, {"ETag": '"v1"', "Last-Modified": "LM1", "Content-Type": "application/rss+xml"})

    server.routes["/feed"] = route
    first = fetch(server.url("/feed"), FAST)
    assert (first.http_status, first.content, first.etag, first.last_modified) == (200, BODY, '"v1"', "LM1")
    assert first.headers["content-type"] == "application/rss+xml"
    assert server.requests[0].headers["user-agent"] == "robot-llm-test/1"
    assert "if-none-match" not in server.requests[0].headers

    again = fetch(server.url("/feed"), FAST, etag=first.etag, last_modified=first.last_modified)
    assert again.not_modified and again.http_status == 304 and again.content == b""
    sent = server.requests[1].headers
    assert sent["if-none-match"] == '"v1"' and sent["if-modified-since"] == "LM1"

    by_date_only = fetch(server.url("/feed"), FAST, last_modified="LM1")
    assert by_date_only.not_modified


def test_500_then_success_is_retried_with_backoff(server: FeedServer) -> None:
    server.serve("/flaky", Reply(500, b"oops"), Reply(503, b"busy"), Reply(200, BODY))
    delays: list[float] = []
    result = fetch(server.url("/flaky"), FAST, sleep=delays.append)
    assert result.http_status == 200 and result.content == BODY
    assert result.attempts == 3 and len(server.hits("/flaky")) == 3
    assert delays == [0.01, 0.02]  # exponential


def test_500_forever_gives_up_with_the_status(server: FeedServer) -> None:
    server.serve("/down", Reply(502, b"bad gateway"))
    with pytest.raises(FetchError, match=r"HTTP 502.*after 3 attempts") as info:
        fetch(server.url("/down"), FAST, sleep=lambda _: None)
    assert info.value.http_status == 502
    assert len(server.hits("/down")) == 3


def test_404_is_not_retried(server: FeedServer) -> None:
    with pytest.raises(FetchError, match="HTTP 404") as info:
        fetch(server.url("/missing"), FAST, sleep=lambda _: None)
    assert info.value.http_status == 404 and len(server.hits("/missing")) == 1


def test_read_timeout_is_retried_then_reported(server: FeedServer) -> None:
    # Far slower than the read timeout: a client thread starved for a while still times out.
    server.serve("/slow", Reply(200, BODY, delay=5.0))
    http = HttpConfig(read_timeout=timedelta(seconds=0.15), retries=1, backoff=timedelta(seconds=0.01))
    with pytest.raises(FetchError, match=r"read timeout \(after 2 attempts\)"):
        fetch(server.url("/slow"), http)
    # The server notes a request once its handler thread has read it, which a loaded machine may do
    # after the client gave up on it: wait for the second one instead of racing it.
    deadline = time.monotonic() + 30
    while len(server.hits("/slow")) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(server.hits("/slow")) == 2


def test_429_honours_retry_after(server: FeedServer) -> None:
    server.serve("/limited", Reply(429, headers={"Retry-After": "2"}), Reply(200, BODY))
    delays: list[float] = []
    assert fetch(server.url("/limited"), FAST, sleep=delays.append).content == BODY
    assert delays == [2.0]


def test_a_trickling_server_hits_the_total_timeout(server: FeedServer) -> None:
    server.serve("/trickle", Reply(200, b"x" * 40, trickle=0.02))
    http = HttpConfig(read_timeout=timedelta(seconds=1), total_timeout=timedelta(seconds=0.2), retries=2)
    with pytest.raises(FetchError, match=r"took longer than 0.2s \(http.total_timeout\)"):
        fetch(server.url("/trickle"), http)
    assert len(server.hits("/trickle")) == 1


def test_redirect_loop_is_refused(server: FeedServer) -> None:
    server.serve("/loop", Reply(302, headers={"Location": "/loop"}))
    with pytest.raises(FetchError, match="more than 5 redirects"):
        fetch(server.url("/loop"), FAST)


def test_redirect_is_followed(server: FeedServer) -> None:
    server.serve("/old", Reply(301, headers={"Location": "/new"}))
    server.serve("/new", Reply(200, BODY))
    result = fetch(server.url("/old"), FAST)
    assert result.content == BODY and result.url == server.url("/new")


def test_gzip_body_is_decoded(server: FeedServer) -> None:
    server.serve("/gz", Reply(200, gzip.compress(BODY), {"Content-Encoding": "gzip"}))
    result = fetch(server.url("/gz"), FAST)
    assert result.content == BODY
    assert "gzip" in server.hits("/gz")[0].headers["accept-encoding"]


@pytest.mark.parametrize(
    "reply",
    [
        Reply(200, b"x" * 5000),  # announced length
        Reply(200, b"x" * 5000, content_length=False),  # found while streaming
        Reply(200, gzip.compress(b"<" * 200_000), {"Content-Encoding": "gzip"}),  # small on the wire, big decoded
    ],
    ids=["content-length", "streamed", "gzip-bomb"],
)
def test_body_over_the_size_limit_is_refused(server: FeedServer, reply: Reply) -> None:
    server.serve("/big", reply)
    http = HttpConfig(max_bytes=4096, retries=2, backoff=timedelta(seconds=0.01))
    with pytest.raises(FetchError, match=r"over the limit of 4096"):
        fetch(server.url("/big"), http)
    assert len(server.hits("/big")) == 1  # not worth retrying


def test_connection_refused_is_reported(server: FeedServer) -> None:
    url = server.url("/feed")
    server.close()
    with pytest.raises(FetchError, match=r"ConnectError.*after 2 attempts"):
        fetch(url, HttpConfig(retries=1, backoff=timedelta(seconds=0.01)))
    server.httpd.server_close()


def test_local_path_and_file_url_with_mtime_validator(tmp_path: Path) -> None:
    path = tmp_path / "feed.xml"
    path.write_bytes(BODY)
    first = fetch(str(path), FAST)
    assert first.content == BODY and first.http_status is None and first.etag
    same = fetch(path.as_uri(), FAST, etag=first.etag)
    assert same.not_modified
    path.write_bytes(BODY + b"\n")
    os.utime(path, ns=(1, 2))
    changed = fetch(path.as_uri(), FAST, etag=first.etag)
    assert not changed.not_modified and changed.content == BODY + b"\n"
    with pytest.raises(FetchError, match="no such file"):
        fetch(str(tmp_path / "nope.xml"), FAST)
