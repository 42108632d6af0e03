"""The object store servers a benchmark writes to: fake-gcs-server or moto's S3 server, started with the test
suite's own launchers (tests/gcs_emulator.py, tests/s3_server.py), each with a bucket "bench". Used by the
side-by-side, compression, small-arrays, multi-tier and scale cases."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


class Server:
    """A local object store server for the run, and the client environment that points at it."""

    def __init__(self, process, environment: dict[str, str]):
        self.process, self.environment = process, environment

    def stop(self) -> None:
        self.process.stop()


def start_object_store(kind: str) -> tuple[Server | None, str | None]:
    """Start fake-gcs-server or moto's S3 server (the test suite's own launchers) with a bucket "bench"; the
    server and the root every contender writes under (None, None for local files)."""
    if kind == "local":
        return None, None
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    if kind == "gcs":
        import gcs_emulator

        process = gcs_emulator.Emulator().start()
        process.create_bucket("bench")
        return Server(process, gcs_emulator.client_environment(process.url)), "gs://bench"
    import s3_server

    process = s3_server.S3Server().start()
    process.create_bucket("bench")
    return Server(process, s3_server.client_environment(process.url)), "s3://bench"
