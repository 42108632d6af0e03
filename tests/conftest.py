"""Test environment: torch_xla SPMD on 8 virtual CPU devices, set up before anything imports torch_xla, on the
stack that has it. On the newest stack (no torch_xla) the tests marked `xla` are deselected: `make test` passes
`-m "not xla"` there, and `pytest --collect-only -q -m xla` counts them. The tests marked `trainers` need
torchtitan and Lightning (the `[trainers]` extra, on the newest stack): without them they are deselected too."""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ["CPU_NUM_DEVICES"] = os.environ.get("XTC_TEST_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA's CPU backend spends most of a small test's time in LLVM's optimization of every graph it compiles (the demo's
# training step: 20 s of compilation, 5 s at level 0). Tests compare runs under the same flags, bit for bit, so the
# unoptimized code is as good a witness; subprocesses inherit it. A caller's own XLA_FLAGS win.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
# One intra-op thread per process: the suite runs many processes on few cores, where torch's OpenMP threads only
# take turns, and spin waiting for work after each operation (on this 2-core machine the resume test's processes
# used 38.6 CPU-s instead of 44.3 in the same wall time). Runs compared bit for bit share this setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import importlib.util  # noqa: E402
import itertools  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from xla_stack import HAS_TORCH_XLA, sharding, torch_xla, xr, xs  # noqa: E402

pytest_plugins = ["cpu_durations"]  # `--cpu-durations=N`: where the suite's time budget goes

if HAS_TORCH_XLA:
    xr.use_spmd()
    # torch's autograd engine sizes its per-device queues at the first backward pass. If a CPU-only backward runs
    # first (some tests train a CPU model), a later backward on the XLA device trips an internal assert in
    # torch 2.9; one tiny XLA backward up front initializes the engine for both.
    _warm = torch.ones(1, device="xla", requires_grad=True)
    (_warm * 2).sum().backward()
    torch_xla.sync()


def pytest_configure(config):
    config.addinivalue_line("markers", "xla: needs torch_xla (the XLA stack); deselected on a stack without it")
    config.addinivalue_line("markers", "trainers: needs torchtitan and Lightning (the [trainers] extra, newest stack); "
                            "deselected without them")


HAS_TRAINERS = all(importlib.util.find_spec(name) is not None for name in ("torchtitan", "lightning_fabric"))


def pytest_collection_modifyitems(config, items):
    """Without torch_xla (or torchtitan and Lightning), the tests that need it are deselected (and counted as
    such), whatever `-m` says."""
    for marker, present in (("xla", HAS_TORCH_XLA), ("trainers", HAS_TRAINERS)):
        if present:
            continue
        needs = [item for item in items if item.get_closest_marker(marker)]
        if needs:
            config.hook.pytest_deselected(items=needs)
            items[:] = [item for item in items if not item.get_closest_marker(marker)]


def pytest_addoption(parser):
    parser.addoption("--hostile-cases", type=int, default=300,
                     help="how many generated hostile checkpoints tests/test_hostile_inputs.py runs (default 300)")
    parser.addoption("--hostile-start", type=int, default=0,
                     help="the first generated case to run (default 0): a long run split into parts runs cases "
                          "START .. START + N - 1, the same cases a single run would")


@pytest.fixture(scope="session")
def num_devices() -> int:
    return xr.global_runtime_device_count()


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...], order=None) -> xs.Mesh:
    n = int(np.prod(shape))
    ids = np.arange(n) if order is None else np.asarray(order)
    return xs.Mesh(ids, shape, names)


def sharded(cpu: torch.Tensor, mesh: xs.Mesh | None, spec: tuple | None) -> torch.Tensor:
    """An XLA copy of `cpu`, sharded with `spec` on `mesh` (unsharded if mesh is None), materialized."""
    t = cpu.to("xla")
    if mesh is not None:
        xs.mark_sharding(t, mesh, spec)
    torch_xla.sync()
    return t


@pytest.fixture
def xla_calls(monkeypatch) -> list:
    """The library's calls into torch_xla's C API (the XLA target's `_X`, its one way into torch_xla: the boundary
    tests watch), as ``(name, args, result)`` in the order they returned; a test may put entries of its own into
    the same list (a listener's) to see the order of both. The calls themselves are torch_xla's."""
    sharding.load()
    real, calls = sharding._X, []

    class Watched:
        def __getattr__(self, name):
            attribute = getattr(real, name)
            if not callable(attribute):
                return attribute

            def call(*args, **kwargs):
                result = attribute(*args, **kwargs)
                calls.append((name, args, result))
                return result
            return call

    monkeypatch.setattr(sharding, "_X", Watched())  # undone after the test: torch_xla's own again
    return calls


# gs:// goes to a fake-gcs-server started on first use; the clients read these variables.
import gcs_emulator  # noqa: E402

GCS_PORT = gcs_emulator.free_port()
gcs_emulator.configure_clients(f"http://127.0.0.1:{GCS_PORT}")
GCS_BUCKET = "xtc-test"
_unique = itertools.count()


@pytest.fixture(scope="session")
def gcs_emulator_server():
    server = gcs_emulator.Emulator(GCS_PORT).start()
    server.create_bucket(GCS_BUCKET)
    yield server
    server.stop()


# s3:// goes to moto's S3 server, started on first use; the clients read the standard AWS variables.
import s3_server  # noqa: E402

S3_PORT = gcs_emulator.free_port()
s3_server.configure_clients(f"http://127.0.0.1:{S3_PORT}")
S3_BUCKET = "xtc-test"


@pytest.fixture(scope="session")
def s3_server_process():
    server = s3_server.S3Server(S3_PORT).start()
    server.create_bucket(S3_BUCKET)
    yield server
    server.stop()


def object_store(request, scheme: str, prefix: str):
    """A fresh path under `prefix` on the GCS emulator ("gcs") or moto ("s3"), started if need be; with the
    server's port and the module whose `client_environment(url)` points clients elsewhere (a proxy)."""
    if scheme == "gcs":
        request.getfixturevalue("gcs_emulator_server")
        return f"gs://{GCS_BUCKET}/{prefix}/{next(_unique)}", GCS_PORT, gcs_emulator
    request.getfixturevalue("s3_server_process")
    return f"s3://{S3_BUCKET}/{prefix}/{next(_unique)}", S3_PORT, s3_server


@pytest.fixture(params=["file", "memory", "gcs", "s3"])
def storage_root(request, tmp_path) -> str:
    """A fresh, empty root on each storage backend: the conformance suite runs every test on all of them."""
    n = next(_unique)
    if request.param == "file":
        return str(tmp_path / "root")
    if request.param == "memory":
        return f"memory://conformance/{n}"
    if request.param == "gcs":
        request.getfixturevalue("gcs_emulator_server")
        return f"gs://{GCS_BUCKET}/conformance/{n}"
    request.getfixturevalue("s3_server_process")
    return f"s3://{S3_BUCKET}/conformance/{n}"


@pytest.fixture
def mesh_4x2() -> xs.Mesh:
    return make_mesh((4, 2), ("x", "y"))


@pytest.fixture
def mesh_2x4() -> xs.Mesh:
    return make_mesh((2, 4), ("a", "b"))


@pytest.fixture
def mesh_8() -> xs.Mesh:
    return make_mesh((8,), ("d",))
