"""Positioned reads of local files (`arrays.local_reads`): buffered from a warm page cache, O_DIRECT through an
aligned window from a cold file, the same bytes either way."""

import errno
import os

import numpy as np
import pytest

from xla_tensorstore_ckpt import CorruptCheckpointError
from xla_tensorstore_ckpt.arrays import local_reads


def _file(tmp_path, nbytes=200_000):
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return str(path), data


def _evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _direct_supported(path):
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def _runs(data):
    """Unaligned runs, some adjacent, one duplicated, one crossing window boundaries, one at the file's end."""
    spans = [(5, 100), (105, 3000), (4093, 9000), (4093, 9000), (50_000, 70_000), (199_990, 10)]
    outs = [bytearray(n) for _, n in spans]
    return [(at, memoryview(out)) for (at, _), out in zip(spans, outs)], outs, [data[a:a + n] for a, n in spans]


@pytest.fixture
def small_windows(monkeypatch):
    monkeypatch.setattr(local_reads, "WINDOW_BYTES", 16384)  # runs cross several windows
    monkeypatch.setattr(local_reads._windows, "view", None, raising=False)


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_runs_read_the_same_bytes_cold_or_warm(tmp_path, monkeypatch, small_windows, cache):
    path, data = _file(tmp_path)
    seen = []
    real_direct, real_buffered = local_reads._read_direct, local_reads._read_buffered
    monkeypatch.setattr(local_reads, "_read_direct", lambda *a: seen.append("direct") or real_direct(*a))
    monkeypatch.setattr(local_reads, "_read_buffered", lambda *a: seen.append("buffered") or real_buffered(*a))
    if cache == "cold":
        _evict(path)
    else:
        open(path, "rb").read()
    runs, outs, expected = _runs(data)
    local_reads.read_runs(path, runs, "the test file")
    assert [bytes(o) for o in outs] == expected
    direct = cache == "cold" and _direct_supported(path)
    assert seen == (["direct"] if direct else ["buffered"])
    if direct:  # a cold read leaves the file out of the page cache
        fd = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                os.preadv(fd, [bytearray(1)], 60_000, os.RWF_NOWAIT)
        finally:
            os.close(fd)


def test_a_file_system_without_o_direct_is_read_buffered(tmp_path, monkeypatch, small_windows):
    path, data = _file(tmp_path)
    _evict(path)
    real_open = os.open

    def no_direct(name, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(name, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    runs, outs, expected = _runs(data)
    local_reads.read_runs(path, runs, "the test file")
    assert [bytes(o) for o in outs] == expected


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_a_run_past_the_end_names_the_file(tmp_path, small_windows, cache):
    path, data = _file(tmp_path)
    if cache == "cold":
        _evict(path)
    out = bytearray(100)
    with pytest.raises(CorruptCheckpointError, match="the test file: the file ends before"):
        local_reads.read_runs(path, [(len(data) - 50, memoryview(out))], "the test file")


def test_a_held_descriptor_is_read_cold_even_after_its_name_is_removed(tmp_path, small_windows):
    path = tmp_path / "data"
    payload = os.urandom(3 * 16384 + 123)
    path.write_bytes(payload)
    fd = local_reads.open_for_runs(str(path))
    try:
        _evict(path)
        os.unlink(path)
        out = bytearray(20000)
        local_reads.read_runs(str(path), [(100, memoryview(out))], "data", fd=fd)
    finally:
        os.close(fd)
    assert bytes(out) == payload[100:20100]
