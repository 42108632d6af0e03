"""moto's standalone S3 server with each request handled whole before the next: ``python atomic_moto.py PORT``.

moto answers a conditional PUT (``If-None-Match: *``) by looking the key up and then storing the object, two steps
that two of its request threads can interleave, so two creators of one key can both succeed; AWS decides the
condition and the write as one. The tests rely on that (the manager's root lock is an exclusive create), so the
server's handling of a request, up to its response's first byte, holds one lock; responses are still sent
concurrently. Started by `s3_server.S3Server`."""

from __future__ import annotations

import sys
import threading

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple


def atomic(app):
    """`app` (a WSGI application) with its calls, which read the request and change the backend, one at a time."""
    lock = threading.Lock()

    def handle(environ, start_response):
        with lock:
            return app(environ, start_response)

    return handle


def main() -> None:
    port = int(sys.argv[1])
    run_simple("127.0.0.1", port, atomic(DomainDispatcherApplication(create_backend_app)), threaded=True,
               request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
