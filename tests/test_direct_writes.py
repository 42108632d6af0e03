"""Saves around the page cache (`arrays.direct_ocdbt`): on local disk a process writes its OCDBT stores itself.
What it stores is what tensorstore stores, byte for byte, key for key; tensorstore and the item merge read it;
a write that fails names the array chunk and the file, and commits nothing."""

from __future__ import annotations

import errno
import fcntl
import os
import resource
import signal
import subprocess

import pytest
import tensorstore as ts
import torch
from helpers import small_file_system

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.arrays import direct_ocdbt
from xla_tensorstore_ckpt.arrays.direct_ocdbt import DirectStore

THROUGH_TENSORSTORE = xtc.SaveOptions(direct_io=False)


def _stored(path) -> dict[bytes, bytes]:
    """Every key and value of the OCDBT store in directory `path`, read by tensorstore."""
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    return {key: store.read(key).result().value for key in store.list().result()}


def _state():
    g = torch.Generator().manual_seed(3)
    return {
        "rows": torch.randn(10, 7, generator=g),
        "bf16": torch.randn(33, 5, generator=g).to(torch.bfloat16),
        "flags": torch.rand(9, generator=g) > 0.5,
        "ints": torch.randint(-2**40, 2**40, (4, 4), generator=g),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.zeros(0, 3),
        "large": torch.randn(3 << 20, generator=g),  # 12 MiB: one value crosses several aligned windows
    }


def test_a_direct_save_stores_what_tensorstore_stores(tmp_path):
    state = _state()
    xtc.save(tmp_path / "direct", state)
    xtc.save(tmp_path / "tensorstore", state, options=THROUGH_TENSORSTORE)
    direct, through = _stored(tmp_path / "direct"), _stored(tmp_path / "tensorstore")
    assert direct.keys() == through.keys() and any(k.endswith(b"/c/0") for k in direct)
    assert [k for k in direct if direct[k] != through[k]] == []
    out = xtc.restore(tmp_path / "direct")
    assert all(torch.equal(out[k], v) for k, v in state.items())
    # the process's own chunk stores were written here, not by tensorstore (which never writes uncompressed nodes)
    lanes = sorted(n for n in os.listdir(tmp_path / "direct") if n.startswith("ocdbt.process_0x"))
    assert lanes and all(_root_node(tmp_path / "direct" / n)[13] == 0 for n in lanes)


def test_edge_chunks_are_padded_as_tensorstore_pads_them(tmp_path):
    """Two processes' shards of 10 rows in chunks of 4 end in a chunk of 2 rows: stored as 4, the rest zeros."""
    value = torch.arange(70, dtype=torch.float32).reshape(10, 7)
    encoded = direct_ocdbt.encode_chunk(value[8:].numpy(), (4, 7))
    stored = bytes(encoded[0])
    assert len(stored) == 4 * 7 * 4 and stored[2 * 7 * 4:] == bytes(2 * 7 * 4)
    assert stored[:2 * 7 * 4] == value[8:].numpy().tobytes()


def _root_node(path) -> bytes:
    manifest = ts.ocdbt.dump(ts.KvStore.open(f"file://{path}/").result()).result()
    _, where = manifest["versions"][-1]["root"]["location"].split("::")
    file, offset, length = where.rsplit(":", 2)
    with open(os.path.join(path, file), "rb") as f:
        f.seek(int(offset))
        return f.read(int(length))


def test_a_store_spreads_over_data_files_and_reads_back(tmp_path):
    values = {f"a/c/{i}": os.urandom(i * 300_001 + 7) for i in range(12)}
    values.update({f"{'é' * 40}/{i:03}": os.urandom(i * 7) for i in range(150)})  # small: kept in the node
    store = DirectStore(str(tmp_path / "s"), data_file_bytes=1 << 20)
    for key in sorted(values, reverse=True):  # any order: the node lists them sorted
        store.put(key, [memoryview(values[key])])
    store.finish()
    assert len(os.listdir(tmp_path / "s" / "d")) > 3
    assert _stored(tmp_path / "s") == {k.encode(): v for k, v in values.items()}
    node = _root_node(tmp_path / "s")
    assert node[:4] == bytes.fromhex("0cdb20de")
    base = ts.KvStore.open(f"file://{tmp_path / 's'}/").result()
    where = ts.ocdbt.dump(base).result()["versions"][-1]["root"]["location"]
    entries = {e["key"]: e for e in ts.ocdbt.dump(base, where).result()["entries"]}
    assert all(("inline_value" in entries[k.encode()]) == (len(v) <= 1024) for k, v in values.items())


def test_an_empty_store_is_a_store_with_no_keys(tmp_path):
    store = DirectStore(str(tmp_path / "s"), data_file_bytes=1 << 20)
    store.finish()
    assert _stored(tmp_path / "s") == {}


def test_where_the_file_system_refuses_o_direct_the_store_is_written_buffered(tmp_path, monkeypatch):
    """tmpfs takes O_DIRECT on this kernel; here `fcntl` refuses it as such a file system does (EINVAL). The
    next test mounts one that really does, where this process may."""
    real_fcntl = direct_ocdbt.fcntl.fcntl

    def refusing(fd, command, arg=0):
        if command == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, command, arg)

    monkeypatch.setattr(direct_ocdbt.fcntl, "fcntl", refusing)
    state = _state()
    xtc.save(tmp_path / "ck", state)
    out = xtc.restore(tmp_path / "ck")
    assert all(torch.equal(out[k], v) for k, v in state.items())


@pytest.fixture
def ramfs(tmp_path):
    """A ramfs file system (no O_DIRECT at all), mounted where this process may mount one."""
    where = tmp_path / "ramfs"
    where.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(where)], capture_output=True)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount ramfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_save_onto_ramfs_is_written_buffered(ramfs):
    with pytest.raises(OSError):
        os.close(os.open(ramfs / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    state = _state()
    xtc.save(ramfs / "ck", state)
    out = xtc.restore(ramfs / "ck")
    assert all(torch.equal(out[k], v) for k, v in state.items())


def _open_files() -> set[str]:
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the descriptor listing the directory
    return names


def test_an_error_in_a_lane_fails_the_save_closes_its_files_and_commits_nothing(tmp_path):
    """The disk fills up under a lane's writes (a real ENOSPC, on a file system of its own)."""
    before = _open_files()
    with small_file_system(tmp_path / "fs", "8m") as fs:
        with pytest.raises(xtc.StorageError, match=r"No space left on device"):
            xtc.save(fs / "ck", _state(), options=xtc.SaveOptions(host_batch_bytes=1 << 10))
        assert not [f for f in _open_files() - before if str(tmp_path) in f]
        with pytest.raises(xtc.CheckpointError):
            xtc.restore(fs / "ck")
        assert os.listdir(fs) == []  # the failed save's temporary directory is gone too


@pytest.fixture(params=[4 << 20, (4 << 20) + 100], ids=["aligned", "unaligned"])
def file_size_limit(request):
    """Writes past the limit fail in this process with EFBIG, as on a full disk (a real OS error from the write
    path; SIGXFSZ, which would kill the process, is ignored meanwhile). An unaligned limit cuts a direct write
    to a length O_DIRECT refuses: the error must still be the real one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (request.param, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_failed_write_names_the_chunk_and_file_and_commits_nothing(tmp_path, file_size_limit):
    mgr = xtc.CheckpointManager(tmp_path / "run", xtc.CheckpointManagerOptions(
        save_interval_steps=1, async_save=False, save_rng=False))
    small = {"w": torch.ones(8)}
    mgr.save(1, extra=small)
    before = _open_files()
    with pytest.raises(xtc.StorageError) as err:
        mgr.save(2, extra={"w": torch.ones(8), "big": torch.randn(4 << 20)})  # 16 MiB
    message = str(err.value)
    assert "big" in message and "/c/0" in message and "ocdbt.process_0x" in message and "File too large" in message
    assert mgr.all_steps() == [1]
    assert not [f for f in _open_files() - before if str(tmp_path) in f]  # no file left open, deleted or not
    restored = {"w": torch.zeros(8)}
    assert mgr.restore("latest", extra=restored) == 1 and torch.equal(restored["w"], torch.ones(8))


def test_the_local_tier_writes_through_the_page_cache_the_persistent_tier_around_it(tmp_path, monkeypatch):
    """A manager's local tier is written buffered (`local_page_cache`: a same-host restart reads it warm), its
    persistent tier with O_DIRECT; both by the direct lanes, both restored bit-exact."""
    real_fcntl = direct_ocdbt.fcntl.fcntl
    direct: list[str] = []

    def watching(fd, command, arg=0):
        if command == fcntl.F_SETFL and arg & os.O_DIRECT:
            direct.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fcntl(fd, command, arg)

    monkeypatch.setattr(direct_ocdbt.fcntl, "fcntl", watching)
    state = {"large": torch.randn(9 << 18, generator=torch.Generator().manual_seed(1))}  # 9 MiB: past a window
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, async_save=False, save_rng=False,
                                           local_directory=tmp_path / "local", local_save_interval_steps=1)
    with xtc.CheckpointManager(tmp_path / "persistent", options) as mgr:
        mgr.save(1, model=state)
    assert direct and all(path.startswith(str(tmp_path / "persistent")) for path in direct)
    for root in ("persistent", "local"):
        assert torch.equal(xtc.restore(tmp_path / root / "1" / "model")["large"], state["large"])
