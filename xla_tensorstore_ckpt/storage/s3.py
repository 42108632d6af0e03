"""``s3://bucket/prefix``: Amazon S3 and S3-compatible stores (MinIO, R2, Ceph) through tensorstore's ``s3``
kvstore (arrays and small files), with boto3 for what that kvstore lacks: delimited listings (it lists every
object below a prefix; a root of many steps would be listed object by object) and conditional creates.

Configuration is the AWS convention, nothing new: ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` for an
S3-compatible endpoint, ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``), and the standard credential chain
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a profile, an instance role), which tensorstore and boto3 both
follow. Exclusive creates are conditional writes (``If-None-Match: *``), which S3 has honoured since 2024 and
S3-compatible stores mostly do; where a store ignores it, the manager lock is best effort (docs/quickstart.md).
Requests are retried with exponential backoff on throttling (503 SlowDown), 5xx and dropped connections, a
bounded number of times (`kvstore.OBJECT_STORE_MAX_RETRIES`; boto3: 10 attempts); the error that escapes names
the object.
"""

from __future__ import annotations

import os
import time
from functools import cache

from ..core.errors import StorageError
from .kvstore import BucketBackend

# S3 answers 409 ConditionalRequestConflict to a conditional write racing another one on the same key: retry.
_CONFLICT_RETRIES = 5


class S3Backend(BucketBackend):
    """An S3 bucket (see `BucketBackend`)."""

    scheme = "s3"

    def kvstore_spec(self, path: str) -> dict:
        # Keys in the environment come first in the standard chain; naming them spares the chain's search of
        # profile files that do not exist (which the AWS C SDK logs as errors).
        credentials = "environment" if os.environ.get("AWS_ACCESS_KEY_ID") else "default"
        spec = {"driver": "s3", "bucket": self.bucket, "path": f"{path}/" if path else "",
                "aws_credentials": {"type": credentials}}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            spec["endpoint"] = endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            spec["aws_region"] = region
        return spec

    def create_exclusive(self, path: str, data: bytes) -> bool:
        # A conditional PUT (If-None-Match: *) through boto3: tensorstore's s3 kvstore checks a precondition with
        # a HEAD before an unconditional PUT (outside AWS's own endpoints), which two creators can both pass.
        client, errors = _client()
        attempt = 0
        while True:
            try:
                client.put_object(Bucket=self.bucket, Key=path, Body=data, IfNoneMatch="*")
                return True
            except errors as exc:
                code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
                if code == "PreconditionFailed":
                    return False  # it exists: someone else created it
                if code != "ConditionalRequestConflict" or attempt + 1 == _CONFLICT_RETRIES:
                    raise StorageError(f"cannot create {self.url(path)}: {exc}") from exc
            time.sleep(0.05 * 2**attempt)  # a concurrent conditional write to the key is in flight
            attempt += 1

    def copy_file(self, source: str, target: str) -> None:
        """A copy on the server (CopyObject, in parts for large objects): the data never passes through this
        process."""
        client, errors = _client()
        try:
            client.copy({"Bucket": self.bucket, "Key": source}, self.bucket, target)
        except errors as exc:
            raise StorageError(f"cannot copy {self.url(source)} to {self.url(target)}: {exc}") from exc

    def list_dir(self, path: str) -> list[str]:
        """Delimited listings (one request per 1,000 names), not a walk over every object below."""
        prefix = f"{path}/" if path else ""
        names: set[str] = set()
        client, errors = _client()
        try:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix,
                                                                         Delimiter="/"):
                names.update(p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", []))
                names.update(o["Key"][len(prefix):] for o in page.get("Contents", []))
        except errors as exc:
            raise StorageError(f"cannot list {self.url(path)}: {exc}") from exc
        return sorted(n for n in names if n)


@cache
def _client() -> tuple:
    """A boto3 client and the exceptions it raises (imported lazily: only s3:// needs boto3)."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    # boto3 reads the endpoint, region and credentials itself. An S3-compatible endpoint gets path-style requests,
    # as tensorstore sends them: such a host rarely resolves bucket subdomains.
    custom = bool(os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
    config = Config(retries={"max_attempts": 10, "mode": "standard"},
                    s3={"addressing_style": "path"} if custom else None)
    client = boto3.client("s3", config=config)
    return client, (BotoCoreError, ClientError)
