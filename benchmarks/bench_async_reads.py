"""Cold direct reads while another thread holds the GIL: the reading threads this library uses against reads
the kernel carries on by itself (Linux AIO), for the next step of issue 36.

torch_xla 2.9's `_global_tensor_from_cpu_shards` copies every host shard without releasing the GIL (23 ms of a
33 ms placement of a 128 MiB tensor here; docs/performance.md, "Resume"). A reading thread that issues one
synchronous `preadv` at a time needs the GIL between two of them, so while a placement holds it the disk only
serves the reads already in flight. Reads submitted with `io_submit` (raw system calls through ctypes, x86-64
Linux) stay queued at the disk whatever Python does.

A file of `--scale` GiB is written and fsynced in `dir` (a temporary directory by default), then read whole
`--repeats` times per case, evicted from the page cache before each read, in 8 MiB `O_DIRECT` requests into
huge-page windows, the cases alternating ABBA:

- `threads`: 4 threads, each a synchronous `preadv` at a time (as `local_reads` reads);
- `aio`: one thread keeps `depth` requests (16) submitted (`io_submit`) and reaps them (`io_getevents`);

each alone and beside a GIL holder: this process's main thread holds the GIL for 23 ms (a C call through
`ctypes.PyDLL`, which keeps it, sleeping) and then lets go for 50 ms, over and over, as a restore that places
tensors between reads does. Reported: the median wall time and throughput per case.

    python -m benchmarks async-reads [--scale 1] [--repeats 7] [--set depth=16] [--set dir=DIR]
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fresh_process  # noqa: E402
import harness  # noqa: E402

from xla_tensorstore_ckpt.core import buffers  # noqa: E402

REQUEST = 8 << 20
HOLD_S, RELEASE_S = 0.023, 0.05
_IO_SETUP, _IO_DESTROY, _IO_GETEVENTS, _IO_SUBMIT = 206, 207, 208, 209  # x86-64 system call numbers
_LIBC = ctypes.CDLL(None, use_errno=True)
_KEEPS_GIL = ctypes.PyDLL(None)  # calls through PyDLL do not release the GIL


class _Iocb(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_uint32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fd", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


def _windows(count: int) -> list[memoryview]:
    """`count` request-sized windows in huge pages, as the library's direct reads use (`core.buffers.new`),
    touched."""
    buffer = buffers.new(count * REQUEST)[:count * REQUEST]
    buffer[::mmap.PAGESIZE] = 0
    view = memoryview(buffer)
    return [view[i * REQUEST:(i + 1) * REQUEST] for i in range(count)]


def _requests(size: int) -> list[tuple[int, int]]:
    return [(offset, min(REQUEST, size - offset)) for offset in range(0, size, REQUEST)]


def read_with_threads(fd: int, size: int, windows: list[memoryview]) -> None:
    todo, lock = _requests(size), threading.Lock()

    def work(window: memoryview) -> None:
        while True:
            with lock:
                if not todo:
                    return
                offset, length = todo.pop()
            if os.preadv(fd, [window[:length]], offset) != length:
                raise OSError(f"short read at {offset}")

    threads = [threading.Thread(target=work, args=(window,)) for window in windows[:4]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def read_with_aio(fd: int, size: int, windows: list[memoryview]) -> None:
    depth, context = len(windows), ctypes.c_ulong(0)
    if _LIBC.syscall(_IO_SETUP, depth, ctypes.byref(context)) != 0:
        raise OSError(ctypes.get_errno(), "io_setup")
    try:
        blocks, events = [_Iocb() for _ in range(depth)], (_Event * depth)()
        free, todo, in_flight = list(range(depth)), _requests(size), 0
        while todo or in_flight:
            submitted = []
            while todo and free:
                slot = free.pop()
                offset, length = todo.pop()
                block = blocks[slot]
                block.data, block.opcode, block.fd = slot, 0, fd  # opcode 0: IOCB_CMD_PREAD
                block.buf = ctypes.addressof(ctypes.c_char.from_buffer(windows[slot]))
                block.nbytes, block.offset = length, offset
                submitted.append(ctypes.pointer(block))
            if submitted:
                pointers = (ctypes.POINTER(_Iocb) * len(submitted))(*submitted)
                if _LIBC.syscall(_IO_SUBMIT, context, len(submitted), pointers) != len(submitted):
                    raise OSError(ctypes.get_errno(), "io_submit")
                in_flight += len(submitted)
            reaped = _LIBC.syscall(_IO_GETEVENTS, context, 1, depth, events, None)
            if reaped < 0:
                raise OSError(ctypes.get_errno(), "io_getevents")
            for event in events[:reaped]:
                if event.res <= 0:
                    raise OSError(-event.res, "an AIO read failed")
                free.append(event.data)
            in_flight -= reaped
    finally:
        _LIBC.syscall(_IO_DESTROY, context)


def timed(path: str, size: int, reader, hold: bool, windows: list[memoryview]) -> float:
    """Seconds to read the evicted file with `reader` on a thread of its own into `windows` (made and touched
    beforehand, untimed), the main thread holding the GIL in turns if `hold`."""
    fresh_process.evict(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        thread = threading.Thread(target=reader, args=(fd, size, windows))
        start = time.perf_counter()
        thread.start()
        while thread.is_alive():
            if hold:
                _KEEPS_GIL.usleep(int(HOLD_S * 1e6))
            thread.join(RELEASE_S)
        return time.perf_counter() - start
    finally:
        os.close(fd)


def run(settings: harness.Settings) -> harness.Result:
    """The case `async-reads`: every case reads the evicted file, ABBA, in this process."""
    depth = settings.option("depth", 16)
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        raise RuntimeError("bench_async_reads.py: x86-64 Linux only (raw AIO system calls)")
    with tempfile.TemporaryDirectory(dir=settings.option("dir", "") or settings.workdir) as directory:
        path = os.path.join(directory, "data.bin")
        size = max(REQUEST, int(settings.scale * (1 << 30)) // REQUEST * REQUEST)
        block = os.urandom(REQUEST)
        with open(path, "wb") as f:
            for _ in range(size // REQUEST):
                f.write(block)
            os.fsync(f.fileno())
        cases = {f"{name}{', GIL held in turns' if hold else ''}": (reader, hold)
                 for name, reader in (("threads", read_with_threads), ("aio", read_with_aio))
                 for hold in (False, True)}
        windows = _windows(max(4, depth))
        seconds = harness.alternated(list(cases), settings.repeats,
                                     lambda name, _round: timed(path, size, *cases[name], windows))
    rows = [harness.Row(name, {"wall_s": harness.series(runs, "s"),
                               "throughput": harness.series([size / r / 1e9 for r in runs], "GB/s")})
            for name, runs in seconds.items()]
    return harness.Result(rows, f"cold O_DIRECT reads of {size / 2**30:.2f} GiB in {REQUEST >> 20} MiB requests, "
                                f"medians of {settings.repeats} (ABBA); AIO {depth} requests deep; GIL held "
                                f"{HOLD_S * 1e3:.0f} ms, then free {RELEASE_S * 1e3:.0f} ms, in turns")


if __name__ == "__main__":
    harness.worker_main()
