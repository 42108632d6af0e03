"""The backend contract (backend_contract.py) on every backend: local disk, memory, a real GCS emulator and a real
S3 server (moto). The raw hooks go around the backend: plain file I/O, tensorstore's memory kvstore, the GCS
emulator's JSON API, boto3."""

from __future__ import annotations

import itertools
import os
import urllib.error
import urllib.parse
import urllib.request

import pytest
import tensorstore as ts
from backend_contract import BackendContract
from conftest import GCS_BUCKET, S3_BUCKET

from xla_tensorstore_ckpt import storage
from xla_tensorstore_ckpt.core.errors import StorageError

_unique = itertools.count()


class TestLocal(BackendContract):
    @pytest.fixture
    def location(self, tmp_path):
        return storage.location(tmp_path / "root")

    def raw_put(self, loc, name, data):
        path = os.path.join(loc.path, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def raw_get(self, loc, name):
        try:
            with open(os.path.join(loc.path, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None


class TestMemory(BackendContract):
    @pytest.fixture
    def location(self):
        return storage.location(f"memory://contract/{next(_unique)}")

    def _kv(self):
        return ts.KvStore.open({"driver": "memory"}, context=storage.context()).result()

    def raw_put(self, loc, name, data):
        self._kv().write(f"{loc.path}/{name}", data).result()

    def raw_get(self, loc, name):
        result = self._kv().read(f"{loc.path}/{name}").result()
        return result.value if result.state == "value" else None


class TestGcs(BackendContract):
    @pytest.fixture
    def location(self, gcs_emulator_server):
        self.url = gcs_emulator_server.url
        return storage.location(f"gs://{GCS_BUCKET}/contract/{next(_unique)}")

    def raw_put(self, loc, name, data):
        query = urllib.parse.urlencode({"uploadType": "media", "name": f"{loc.path}/{name}"})
        request = urllib.request.Request(f"{self.url}/upload/storage/v1/b/{GCS_BUCKET}/o?{query}", data=data,
                                         method="POST", headers={"Content-Type": "application/octet-stream"})
        urllib.request.urlopen(request, timeout=30).read()

    def raw_get(self, loc, name):
        quoted = urllib.parse.quote(f"{loc.path}/{name}", safe="")
        try:
            return urllib.request.urlopen(f"{self.url}/storage/v1/b/{GCS_BUCKET}/o/{quoted}?alt=media",
                                          timeout=30).read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise


class TestS3(BackendContract):
    @pytest.fixture
    def location(self, s3_server_process):
        import boto3

        self.client = boto3.client("s3", endpoint_url=s3_server_process.url)
        return storage.location(f"s3://{S3_BUCKET}/contract/{next(_unique)}")

    def raw_put(self, loc, name, data):
        self.client.put_object(Bucket=S3_BUCKET, Key=f"{loc.path}/{name}", Body=data)

    def raw_get(self, loc, name):
        try:
            return self.client.get_object(Bucket=S3_BUCKET, Key=f"{loc.path}/{name}")["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None


def test_local_paths_are_compared_with_their_links_resolved(tmp_path):
    (tmp_path / "real" / "item").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    real, link = storage.location(tmp_path / "real" / "item"), storage.location(tmp_path / "link" / "item")
    assert real.overlaps(link) and link.overlaps(storage.location(tmp_path / "real"))
    assert link.child("x").is_link() is False and storage.location(tmp_path / "link").is_link()


def test_local_replace_follows_nothing_and_removes_only_links(tmp_path):
    """A symbolic link at the target is replaced by the new directory; what it pointed to is untouched."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep").write_text("mine")
    (tmp_path / "target").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "f").write_text("new")
    storage.location(tmp_path / "new").replace(storage.location(tmp_path / "target"))
    assert not (tmp_path / "target").is_symlink() and (tmp_path / "target" / "f").read_text() == "new"
    assert (tmp_path / "elsewhere" / "keep").read_text() == "mine" and not (tmp_path / "new").exists()
    (tmp_path / "link2").symlink_to(tmp_path / "elsewhere")
    storage.location(tmp_path / "link2").delete_tree()
    assert not (tmp_path / "link2").exists() and (tmp_path / "elsewhere" / "keep").read_text() == "mine"


def test_local_reads_refuse_what_is_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    loc = storage.location(tmp_path)
    with pytest.raises(StorageError, match="regular file"):
        loc.read("fifo")
    with pytest.raises(OSError, match="regular file"):
        loc.read_range("fifo", 0, 8).result()
