"""A real S3 server for the tests: moto's standalone server (from the registry's ``moto[server]``, run by
`atomic_moto` so that conditional writes are decided atomically, as by AWS) on 127.0.0.1, in memory. The clients
(tensorstore through this library, and boto3) find it through the standard AWS variables that
`client_environment` returns and `configure_clients` sets."""

from __future__ import annotations

import os
import subprocess
import sys

from gcs_emulator import free_port, wait_until_answering

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}


class S3Server:
    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> S3Server:
        self.process = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "atomic_moto.py"),
                                         str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until_answering(self.process, f"{self.url}/moto-api/", "the moto S3 server")
        return self

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.url, region_name=CREDENTIALS["AWS_REGION"],
                     aws_access_key_id="test", aws_secret_access_key="test").create_bucket(Bucket=name)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)


def client_environment(url: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": url, **CREDENTIALS}


def configure_clients(url: str) -> None:
    os.environ.update(client_environment(url))
