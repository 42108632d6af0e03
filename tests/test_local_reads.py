"""Positioned reads of local files (`arrays.local_reads`): buffered from a warm page cache, O_DIRECT through an
aligned window from a cold file, the same bytes either way."""

import ctypes
import errno
import mmap
import os
import subprocess

import crc32c
import numpy as np
import pytest
from helpers import overlay_file_system
from memory_maps import vm_flags

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import CorruptCheckpointError, StorageError
from xla_tensorstore_ckpt.arrays import local_reads, page_cache
from xla_tensorstore_ckpt.core import buffers, tunables


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


def _cold(path):
    """Evict the file, or skip the test where the file system keeps it in memory whatever is advised (tmpfs
    beneath an overlay, some container and FUSE mounts): there no read is cold, so no read can be direct."""
    _evict(path)
    if _resident_pages(path):
        kind = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()
        pytest.skip(f"the file system ({kind}) keeps the file in its page cache after POSIX_FADV_DONTNEED")


def _resident_pages(path) -> list[int]:
    """The indices of the file's pages in the page cache, by ``mincore`` of a mapping, which reads nothing. Not
    by a ``RWF_NOWAIT`` read: on a miss it starts the read it refuses to wait for, and where the disk answers at
    once (this VM's, from its host's cache) the page is there before the call returns, so it succeeds."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        vector = (ctypes.c_ubyte * pages)()
        try:
            if _LIBC.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return [page for page, flags in enumerate(vector) if flags & 1]
        finally:
            del address  # the exported buffer must be gone before the mapping closes


_LIBC = ctypes.CDLL(None, use_errno=True)


def _direct_supported(path):
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def _cachestat_counts(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return page_cache.cached_pages(fd, 0, 4096) is not None
    finally:
        os.close(fd)


def _runs(data):
    """Unaligned runs, some adjacent, one duplicated, one crossing window boundaries, one at the file's end."""
    spans = [(5, 100), (105, 3000), (4093, 9000), (4093, 9000), (50_000, 70_000), (199_990, 10)]
    outs = [bytearray(n) for _, n in spans]
    return [(at, memoryview(out)) for (at, _), out in zip(spans, outs)], outs, [data[a:a + n] for a, n in spans]


def _nowait_probes(before: dict) -> int:
    """How many of the cache probes since `before` read a byte with ``RWF_NOWAIT`` (``cachestat`` could not
    count)."""
    return local_reads.COUNTS.since(before)["nowait_probes"]


def _paths(before: dict) -> list[str]:
    """The paths the local reads since `before` (a `COUNTS.snapshot`) took, one entry per read: what
    ``restore_finished`` reports as ``paths``."""
    since = local_reads.COUNTS.since(before)
    return ["direct"] * since["direct_reads"] + ["buffered"] * since["buffered_reads"]


@pytest.fixture
def refused_cachestat(monkeypatch):
    """``refuse(code)``: from then on the test's ``cachestat`` system calls fail with errno `code`, as kernels
    before 6.5 (ENOSYS) and since 2025 (EPERM, for a file this process could not write) answer; it returns the
    list of the calls the kernel got (their file descriptors). The library's wrapper of the system call is the
    boundary replaced, nothing above it."""
    def refuse(code: int) -> list:
        calls = []

        def call(*args):
            calls.append(args[1])
            ctypes.set_errno(code)
            return -1

        monkeypatch.setattr(page_cache, "_cachestat", call)
        return calls

    return refuse


@pytest.fixture
def small_windows():
    with tunables.overridden(read_window_bytes=16384):  # runs cross several windows (made anew at this size)
        yield


@pytest.mark.parametrize("probe", ["cachestat", "nowait-read"])
@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_runs_read_the_same_bytes_cold_or_warm(tmp_path, refused_cachestat, small_windows, cache, probe):
    if probe == "nowait-read":  # kernels before 6.5 (no cachestat)
        refused_cachestat(errno.ENOSYS)
    path, data = _file(tmp_path)
    if cache == "cold":
        _cold(path)
    else:
        open(path, "rb").read()
    runs, outs, expected = _runs(data)
    before = local_reads.COUNTS.snapshot()
    checksum = local_reads.read_runs(path, runs, "the test file", checksummed=4)
    assert [bytes(o) for o in outs] == expected
    assert checksum == crc32c.crc32c(b"".join(expected[:4]))  # computed window by window when direct
    probes = local_reads.COUNTS.since(before)
    direct = cache == "cold" and _direct_supported(path)
    if probe == "nowait-read":
        assert probes["nowait_probes"] == probes["cache_probes"] > 0
        # The probing read of a cold page may itself be served at once (see `_resident_pages`): then the bytes
        # are taken as cached, and read buffered, as the probe said.
        direct = direct and not probes["cached_probes"]
    elif _cachestat_counts(path):
        assert probes["cache_probes"] > 0 and probes["nowait_probes"] == 0
    assert _paths(before) == (["direct"] if direct else ["buffered"])
    if direct:  # a cold read leaves the file out of the page cache
        assert 60_000 // mmap.PAGESIZE not in _resident_pages(path)


def test_runs_whose_first_page_is_cached_are_still_read_direct(tmp_path, small_windows):
    """A chunk's first page is often cached by the read before it (the previous chunk's checksum shares it):
    the probe looks at the middle of what is read, so the rest is not read through the page cache."""
    path, data = _file(tmp_path)
    if not _direct_supported(path):
        pytest.skip("the file system refuses O_DIRECT")
    _cold(path)
    with open(path, "rb") as f:
        f.read(1)
    before = local_reads.COUNTS.snapshot()
    out = bytearray(60_000)
    local_reads.read_runs(path, [(100, memoryview(out))], "the test file")
    assert bytes(out) == data[100:60_100]
    assert _paths(before) == ["direct"]


def test_cold_bytes_read_twice_are_read_direct_twice(tmp_path, small_windows):
    """Asking whether bytes are cached reads none of them: a second restore of the same cold chunks (a resume
    after a failed one) goes around the page cache as the first did."""
    path, data = _file(tmp_path)
    if not _direct_supported(path) or not _cachestat_counts(path):
        pytest.skip("the file system refuses O_DIRECT, or the kernel cannot count its cached pages")
    _cold(path)
    before = local_reads.COUNTS.snapshot()
    for _ in range(2):
        out = bytearray(60_000)
        local_reads.read_runs(path, [(100, memoryview(out))], "the test file")
        assert bytes(out) == data[100:60_100]
    assert _paths(before) == ["direct", "direct"]


def test_a_file_cachestat_refuses_is_probed_and_cachestat_still_asked_for_the_next(tmp_path, refused_cachestat):
    """Kernels since 2025 refuse cachestat (EPERM) on a file this process could not write (a checkpoint of
    another user): that read asks the old way, the next file is counted again."""
    path, data = _file(tmp_path)
    calls = refused_cachestat(errno.EPERM)
    before = local_reads.COUNTS.snapshot()
    for _ in range(2):
        out = bytearray(5000)
        local_reads.read_runs(path, [(7, memoryview(out))], "the test file")
        assert bytes(out) == data[7:5007]
    assert len(calls) == 2  # asked each time: the refusal was for that file
    assert _nowait_probes(before) == 2
    assert page_cache._cachestat is not None


def test_a_kernel_without_cachestat_is_not_asked_again(tmp_path, refused_cachestat):
    path, data = _file(tmp_path)
    calls = refused_cachestat(errno.ENOSYS)
    before = local_reads.COUNTS.snapshot()
    for _ in range(2):
        out = bytearray(5000)
        local_reads.read_runs(path, [(7, memoryview(out))], "the test file")
        assert bytes(out) == data[7:5007]
    assert len(calls) == 1 and page_cache._cachestat is None
    assert _nowait_probes(before) == 2


def test_a_file_system_that_hides_its_cache_from_cachestat_is_probed(tmp_path, refused_cachestat):
    """overlayfs keeps a file's pages under the file beneath, where cachestat does not look (it would count
    none of a warm file): such file systems are asked the old way. A real overlayfs; the same read of a file on
    the file system beneath asks cachestat."""
    with overlay_file_system(tmp_path / "overlay") as mounted:
        hidden, data = _file(mounted)
        plain, _ = _file(tmp_path)
        calls = refused_cachestat(errno.EPERM)
        for path, asked in ((hidden, 0), (plain, 1)):
            before = local_reads.COUNTS.snapshot()
            out = bytearray(5000)
            local_reads.read_runs(path, [(7, memoryview(out))], "the test file")
            assert bytes(out) == data[7:5007]
            assert len(calls) == asked and _nowait_probes(before) == 1, path


def test_the_file_system_magic_is_read_from_fstatfs(tmp_path):
    with overlay_file_system(tmp_path / "overlay") as mounted:
        hidden, _ = _file(mounted)
        plain, _ = _file(tmp_path)
        assert _magic(hidden) == 0x794C7630  # overlayfs
        for path, unseen in ((hidden, True), (plain, _magic(plain) in (0x794C7630, 0x2FC12FC1))):
            fd = os.open(path, os.O_RDONLY)
            try:
                assert page_cache._cache_unseen(fd) == unseen, path
            finally:
                os.close(fd)


def _magic(path):
    """The file system's magic number, as `stat -f` prints it."""
    out = subprocess.run(["stat", "-f", "-c", "%t", path], capture_output=True, text=True, check=True).stdout
    return int(out.strip(), 16)


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


def test_aligned_runs_into_aligned_buffers_are_read_straight_in_and_checksummed_in_file_order(tmp_path, monkeypatch):
    """A cold run whose file offset and destination are page-aligned is read into the destination, with no copy
    out of a window (what `views.histogram`'s buffers get); what lies around it still goes through the window,
    and the checksum is still of every checksummed run in file order."""
    path, data = _file(tmp_path, 2 << 20)
    _cold(path)
    if not _direct_supported(path):
        pytest.skip("no O_DIRECT on this file system: every read is buffered")
    straight_a, straight_b = buffers.new(600_000), buffers.new(300 << 10)
    spans = [(0, 600_000, straight_a), (600_100, 5000, None), (1 << 20, 300 << 10, straight_b),
             ((1 << 20) + (300 << 10), 400_000, None), (1_900_000, 197_152 - 3, None)]
    outs = [buffer[:n] if buffer is not None else np.zeros(n + 1, np.uint8)[1:] for _, n, buffer in spans]
    runs = [(at, memoryview(out)) for (at, _, _), out in zip(spans, outs)]
    copies = []
    copy_bytes = local_reads.copy_bytes
    monkeypatch.setattr(local_reads, "copy_bytes", lambda dest, source: (copies.append(len(dest)),
                                                                       copy_bytes(dest, source)))
    checksum = local_reads.read_runs(path, runs[::-1], "the test file", checksummed=len(runs))
    assert [bytes(o) for o in outs] == [data[at:at + n] for at, n, _ in spans]
    assert checksum == crc32c.crc32c(b"".join(data[at:at + n] for at, n, _ in spans))
    # straight in: all but the last 600_000 % 4096 bytes of the first run, the whole third; the rest copied
    assert sorted(copies) == sorted([600_000 % 4096, 5000, 400_000, 197_152 - 3])
    tail = buffers.new(1 << 20)
    with pytest.raises(CorruptCheckpointError, match="the test file: the file ends before"):
        local_reads.read_runs(path, [((1 << 20) + (512 << 10), memoryview(tail))], "the test file")


def test_direct_reads_go_through_windows_advised_to_use_huge_pages(tmp_path):
    # A direct request is built from its buffer's physically contiguous runs, of which a disk takes a limited
    # number: in 4 KiB pages a window went to the disk here in requests of 512 KiB, in 2 MiB pages of 4 MiB.
    path, data = _file(tmp_path, 3 << 20)
    _cold(path)
    fd = local_reads.open_for_runs(path)
    try:
        view = local_reads.read_window(fd, 4096, 3 << 20, "the test file")
        assert bytes(view) == data[4096:3 << 20]
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    finally:
        os.close(fd)
    assert "hg" in vm_flags(address)
    written = buffers.take(8 << 20)  # the direct writes' windows (arrays.direct_ocdbt), and every buffer, as well
    assert "hg" in vm_flags(ctypes.addressof(ctypes.c_char.from_buffer(written)))


@pytest.mark.parametrize("cache", ["cold", "warm"])
@pytest.mark.parametrize("start, stop", [(5, 3000), (4093, 16000), (1000, 50_000), (199_000, 200_000)],
                         ids=["in-a-page", "a-window", "larger-than-a-window", "to-the-end"])
def test_a_window_view_holds_the_bytes_cold_or_warm(tmp_path, small_windows, cache, start, stop):
    path, data = _file(tmp_path)
    if cache == "cold":
        _cold(path)
    fd = local_reads.open_for_runs(path)
    try:
        view = local_reads.read_window(fd, start, stop, "the test file")
        assert bytes(view) == data[start:stop]
        with pytest.raises(CorruptCheckpointError, match="the test file: the file ends before"):
            local_reads.read_window(fd, len(data) - 10, len(data) + 10, "the test file")
    finally:
        os.close(fd)
    if cache == "cold" and _direct_supported(path) and stop - start > 8192:
        # read around the page cache: a quarter in, nothing is cached
        assert (start + (stop - start) // 4) // mmap.PAGESIZE not in _resident_pages(path)


# --------------------------------------------------------------------------------- boxes of a stored array

def _array_file(tmp_path, shape, dtype=np.float32, offset=123):
    """A C-order array stored at an unaligned offset of a file, between other bytes."""
    array = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    path = tmp_path / "array.bin"
    path.write_bytes(os.urandom(offset) + array.tobytes() + os.urandom(77))
    return str(path), array, offset


def _boxes(array, boxes):
    """Destinations for `boxes`: views into one output buffer each, as a region's buffer is cut."""
    outs = [np.full([b - a for a, b in box], -1, array.dtype) for box in boxes]
    return [(box, out) for box, out in zip(boxes, outs)], outs


@pytest.mark.parametrize("cache", ["cold", "warm"])
@pytest.mark.parametrize("shape, boxes", [
    # a row-sharded piece read column-sharded: every box a short run per row, rows over several windows
    ((64, 96), [((0, 64), (0, 24)), ((0, 64), (24, 48)), ((0, 64), (48, 96))]),
    # rows larger than a window (16 KiB here): read dimension by dimension
    ((5, 40, 200), [((1, 4), (3, 37), (10, 190)), ((0, 5), (0, 40), (0, 200))]),
    # rows with gaps between the boxes, a single element, a 1-D array
    ((300, 7), [((0, 10), (2, 5)), ((200, 250), (0, 7)), ((299, 300), (6, 7))]),
    ((5000,), [((10, 4990),), ((4000, 4100),)]),
])
def test_boxes_are_read_bit_exact_cold_or_warm(tmp_path, small_windows, cache, shape, boxes):
    path, array, offset = _array_file(tmp_path, shape)
    if cache == "cold":
        _evict(path)
    else:
        open(path, "rb").read()
    pairs, outs = _boxes(array, boxes)
    local_reads.read_boxes(path, offset, shape, pairs, "the test array")
    for box, out in zip(boxes, outs):
        assert np.array_equal(out, array[tuple(slice(a, b) for a, b in box)])


def test_a_zero_d_array_is_read(tmp_path):
    path, array, offset = _array_file(tmp_path, ())
    out = np.zeros((), np.float32)
    local_reads.read_boxes(path, offset, (), [((), out[...])], "the test array")
    assert out == array


def test_boxes_on_a_file_system_without_o_direct_are_read_buffered(tmp_path, monkeypatch, small_windows):
    path, array, offset = _array_file(tmp_path, (64, 96))
    _evict(path)
    real_open, opened = os.open, []

    def no_direct(name, flags, *args):
        opened.append(bool(flags & os.O_DIRECT))
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(name, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    pairs, outs = _boxes(array, [((0, 64), (8, 40))])
    local_reads.read_boxes(path, offset, (64, 96), pairs, "the test array")
    assert np.array_equal(outs[0], array[:, 8:40])
    assert opened == [False, True] or not _direct_supported(path)


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_boxes_past_the_end_of_the_file_name_it(tmp_path, small_windows, cache):
    path, array, offset = _array_file(tmp_path, (64, 96))
    os.truncate(path, offset + array.nbytes // 2)
    if cache == "cold":
        _evict(path)
    pairs, _ = _boxes(array, [((0, 64), (0, 10))])
    with pytest.raises(CorruptCheckpointError, match="the test array: the file ends before"):
        local_reads.read_boxes(path, offset, (64, 96), pairs, "the test array")


def test_boxes_of_a_missing_file_are_a_storage_error(tmp_path):
    with pytest.raises(StorageError, match="cannot open the test array"):
        local_reads.read_boxes(str(tmp_path / "gone"), 0, (4, 4), [(((0, 4), (0, 4)), np.zeros((4, 4)))],
                               "the test array")


def test_tunables_are_set_for_a_block_and_checked():
    """`tunables.overridden` sets sizes for a ``with`` block and puts them back, also on errors; unknown names and
    values that are not sizes are refused."""
    default = tunables.get("read_window_bytes")
    with pytest.raises(RuntimeError), tunables.overridden(read_window_bytes=4096):
        assert tunables.get("read_window_bytes") == 4096
        raise RuntimeError
    assert tunables.get("read_window_bytes") == default == tunables.DEFAULTS["read_window_bytes"]
    for bad in ({"no_such_size": 1}, {"read_window_bytes": -1}, {"read_window_bytes": 1.5}):
        with pytest.raises(xtc.UsageError), tunables.overridden(**bad):
            pass
