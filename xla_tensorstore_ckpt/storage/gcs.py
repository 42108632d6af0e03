"""``gs://bucket/prefix``: Google Cloud Storage through tensorstore's ``gcs`` kvstore (arrays and small files),
with gcsfs for what tensorstore lacks: delimited listings (tensorstore lists recursively) and creates with a
precondition the emulator honours too.

Credentials are the standard ones (application default credentials on TPU VMs); against an emulator
(STORAGE_EMULATOR_HOST / TENSORSTORE_GCS_HTTP_URL) anonymous access. Requests are retried with backoff on
transient errors (429, 5xx, dropped connections) a bounded number of times: tensorstore's own retries
(`kvstore.OBJECT_STORE_MAX_RETRIES`) and gcsfs's (6 attempts).
"""

from __future__ import annotations

import os
from functools import cache

from ..core.errors import StorageError
from .kvstore import BucketBackend


class GcsBackend(BucketBackend):
    """A GCS bucket (see `BucketBackend`)."""

    scheme = "gs"

    def kvstore_spec(self, path: str) -> dict:
        return {"driver": "gcs", "bucket": self.bucket, "path": f"{path}/" if path else ""}

    def create_exclusive(self, path: str, data: bytes) -> bool:
        # gcsfs sends the precondition (ifGenerationMatch=0) with a multipart upload, which GCS and its emulator
        # both honour; the emulator ignores preconditions on tensorstore's single-part uploads.
        try:
            _gcsfs().pipe_file(f"{self.bucket}/{path}", data, mode="create")
        except FileExistsError:
            return False
        except OSError as exc:
            raise StorageError(f"cannot create {self.url(path)}: {exc}") from exc
        return True

    def copy_file(self, source: str, target: str) -> None:
        """A copy on the server (GCS's rewrite): the data never passes through this process."""
        try:
            _gcsfs().copy(f"{self.bucket}/{source}", f"{self.bucket}/{target}")
        except OSError as exc:
            raise StorageError(f"cannot copy {self.url(source)} to {self.url(target)}: {exc}") from exc

    def list_dir(self, path: str) -> list[str]:
        """One delimited listing, not a walk over every object below."""
        prefix = f"{self.bucket}/{path}".rstrip("/")
        try:
            entries = _gcsfs().ls(prefix, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StorageError(f"cannot list {self.url(path)}: {exc}") from exc
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != prefix})


@cache
def _gcsfs():  # noqa: ANN202 - gcsfs is imported lazily: only gs:// needs it
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # else every call waits on a gRPC probe
    import gcsfs

    token = "anon" if os.environ.get("STORAGE_EMULATOR_HOST") else None
    return gcsfs.GCSFileSystem(token=token)
