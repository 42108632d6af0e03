"""The contract every storage backend keeps, as a test class to subclass (in the manner of zarr-python's
StoreTests). A subclass provides a fresh, empty `location` fixture and two hooks that bypass the backend under
test: `raw_put` and `raw_get`, which read and write the underlying medium directly. Then every rule below is
checked against the real medium, not against the backend's own view of it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import tensorstore as ts

from xla_tensorstore_ckpt import storage
from xla_tensorstore_ckpt.core.errors import StorageError


class BackendContract:
    """Subclasses define the `location` fixture (an empty directory) and `raw_put` / `raw_get`."""

    def raw_put(self, loc: storage.Location, name: str, data: bytes) -> None:
        raise NotImplementedError

    def raw_get(self, loc: storage.Location, name: str) -> bytes | None:
        raise NotImplementedError

    def test_capabilities_are_declared(self, location):
        assert isinstance(location.capabilities, storage.Capabilities)

    def test_url_round_trip(self, location):
        assert storage.location(str(location)) == location
        assert storage.location(str(location.child("a/b"))) == location.child("a", "b")

    def test_read_sees_what_is_stored(self, location):
        assert location.read("missing") is None
        self.raw_put(location, "x/data.bin", b"\x00\x01stored")
        assert location.read("x/data.bin") == b"\x00\x01stored"
        assert location.child("x").read("data.bin") == b"\x00\x01stored"

    def test_a_directory_is_no_file(self, location):
        """Readers tell a file from a directory by reading it (a Hugging Face file from a checkpoint
        directory): a directory reads as missing, on every backend."""
        self.raw_put(location, "d/inside.bin", b"data")
        assert location.read("d") is None and location.read_range("d", 0, 0).result() is None
        assert location.read_range("d", 0, 4).result() is None

    def test_ranged_reads_return_exactly_the_range(self, location):
        self.raw_put(location, "blob.bin", bytes(range(256)) * 4)
        reads = [location.read_range("blob.bin", a, b) for a, b in ((0, 8), (250, 260), (1020, 1024), (5, 5))]
        assert [r.result() for r in reads] == [bytes(range(8)), bytes(range(250, 256)) + bytes(range(4)),
                                               bytes(range(252, 256)), b""]
        assert location.read_range("missing.bin", 0, 4).result() is None
        with pytest.raises(storage.RangeNotSatisfiableError) as info:
            location.read_range("blob.bin", 1000, 1100).result()
        assert "blob.bin" in str(info.value) and info.value.size in (1024, None)
        local = location.local_file("blob.bin")
        if local is not None:  # where there is one, it is the very file
            with open(local, "rb") as f:
                assert f.read() == bytes(range(256)) * 4

    def test_write_stores_and_overwrites(self, location):
        location.write("deep/er/file.json", b"{}")
        assert self.raw_get(location, "deep/er/file.json") == b"{}"
        location.write("deep/er/file.json", b"[1]", fsync=False)
        assert self.raw_get(location, "deep/er/file.json") == b"[1]"

    def test_create_exclusive_creates_only_once(self, location):
        assert location.create_exclusive("lock", b"first")
        assert self.raw_get(location, "lock") == b"first"
        assert not location.create_exclusive("lock", b"second")
        assert self.raw_get(location, "lock") == b"first"
        self.raw_put(location, "taken", b"by someone")
        assert not location.create_exclusive("taken", b"mine")

    def test_racing_creators_have_one_winner(self, location):
        for attempt in range(10):
            barrier = threading.Barrier(2)

            def create(data: bytes, barrier=barrier, name=f"race{attempt}") -> bool:
                barrier.wait()
                return location.create_exclusive(name, data)

            with ThreadPoolExecutor(2) as pool:
                results = list(pool.map(create, (b"a", b"b")))
            assert sorted(results) == [False, True]
            assert self.raw_get(location, f"race{attempt}") == (b"a" if results[0] else b"b")

    def test_listing_names_files_and_directories_once(self, location):
        assert location.list() == [] and location.is_empty() and not location.exists()
        for name in ("b.json", "a/1", "a/2/deep", "c/x"):
            self.raw_put(location, name, b".")
        assert location.list() == ["a", "b.json", "c"]
        assert location.child("a").list() == ["1", "2"]
        assert location.exists() and not location.is_empty() and location.child("a", "2").exists()
        assert location.child("nothing").list() == [] and not location.child("nothing").exists()

    def test_delete_removes_one_file_only(self, location):
        for name in ("a", "ab", "a.json", "d/a"):
            self.raw_put(location, name, b".")
        location.delete("a")
        location.delete("a")  # already gone: fine
        location.delete("never-there")
        assert self.raw_get(location, "a") is None
        assert [self.raw_get(location, n) for n in ("ab", "a.json", "d/a")] == [b".", b".", b"."]

    def test_delete_tree_removes_a_directory_only(self, location):
        for name in ("dir/x", "dir/sub/y", "dir2/z", "dirfile"):
            self.raw_put(location, name, b".")
        location.child("dir").delete_tree()
        location.child("dir").delete_tree()  # already gone: fine
        assert self.raw_get(location, "dir/x") is None and self.raw_get(location, "dir/sub/y") is None
        assert self.raw_get(location, "dir2/z") == b"." and self.raw_get(location, "dirfile") == b"."
        assert location.list() == ["dir2", "dirfile"]

    def test_arrays_see_the_same_files(self, location):
        location.write("arr/zarr.json", b'{"written": "by the backend"}')
        kv = ts.KvStore.open(location.kvstore_spec(), context=storage.context()).result()
        assert kv.read("arr/zarr.json").result().value == b'{"written": "by the backend"}'
        kv.write("arr/c/0", b"chunk").result()
        assert self.raw_get(location, "arr/c/0") == b"chunk" and location.child("arr").list() == ["c", "zarr.json"]

    def test_sync_files_accepts_what_was_written(self, location):
        location.write("s/a", b"1", fsync=False)
        location.write("s/deep/b", b"2", fsync=False)
        location.sync_files(["s/a", "s/deep/b"])
        location.file_written("s/a")  # a hint: never fails
        location.file_written("s/missing")
        if not location.capabilities.durable_writes:
            with pytest.raises(StorageError, match="missing"):
                location.sync_files(["s/missing"])

    def test_replace_puts_a_complete_directory_in_place(self, location):
        for name, data in (("old/_MARKER", b"old"), ("old/data/x", b"old x"), ("old/gone", b".")):
            self.raw_put(location, name, data)
        for name, data in (("new/_MARKER", b"new"), ("new/data/x", b"new x"), ("new/deep/y", b"new y")):
            self.raw_put(location, name, data)
        location.child("new").replace(location.child("old"), commit_files=("_MARKER",))
        assert location.list() == ["old"]
        assert location.backend.list_files(location.child("old").path) == ["_MARKER", "data/x", "deep/y"]
        assert [self.raw_get(location, f"old/{n}") for n in ("_MARKER", "data/x", "deep/y", "gone")] == [
            b"new", b"new x", b"new y", None]
        location.child("old").replace(location.child("fresh"))  # into nothing: a move
        assert location.list() == ["fresh"] and self.raw_get(location, "fresh/deep/y") == b"new y"

    def test_overlaps_tells_nested_locations(self, location):
        a = location.child("a")
        assert a.overlaps(a) and a.overlaps(a.child("b", "c")) and a.child("b").overlaps(a)
        assert not a.overlaps(location.child("ab")) and not a.overlaps(location.child("b"))
        assert location.child("x").is_file() is False
        self.raw_put(location, "x", b".")
        assert location.child("x").is_file() and not location.is_file()
