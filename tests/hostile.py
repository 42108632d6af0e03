"""Hostile checkpoints, made from real ones, and a harness that runs every reader on them in a guarded process.

Seeds are small checkpoints of every format this library reads (ours, format 1 and 2, as OCDBT stores and as
directories; Orbax's, zarr v3 and v2; a root of steps; a Hugging Face file and directory; a DCP directory; a
torch_xla CheckpointManager root). A case is a copy of a seed with one mutation (`mutate`): bytes flipped, the
file truncated, a JSON value replaced by a hostile one (huge or negative numbers, deep nesting, wrong types,
look-alike digits), a string replaced by a hostile name (a path leaving the directory, absolute, a drive, NUL,
backslashes, over-long), a key deleted, the file removed or replaced by a FIFO, a socket or a symbolic link to a
FIFO (any file, data files too: tensorstore opens those). `Harness` runs each case's reads (`ops_for`) in
`tests/scripts/hostile_worker.py` under a memory limit (RLIMIT_AS) and a time limit, and `check` says what went
wrong: a signal, a hang, a traceback, or a file changed outside the destination. Deterministic: case n of a
seed is the same on every run.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import resource
import select
import shutil
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

WORKER = os.path.join(os.path.dirname(__file__), "scripts", "hostile_worker.py")
# The worker's address space after importing torch and tensorstore is about 5 GiB (thread stacks and malloc
# arenas are reserved, not used); a reader may allocate 3 GiB beyond that before the limit stops it.
MEMORY_LIMIT = 8 << 30
CASE_TIMEOUT_S = 120  # a hang guard, far beyond what any case takes (tenths of a second)

METADATA_NAMES = ("_METADATA", "_CHECKPOINT_METADATA", "zarr.json", ".zarray", "_strings.json", "metadata",
                  "model.safetensors.index.json", "manifest.ocdbt", "commit_success.txt", ".metadata",
                  ".manager_metadata")


@dataclass(frozen=True)
class Seed:
    name: str
    path: str  # the checkpoint (a directory, or a safetensors file)
    kind: str  # "item", "step", "root", "xla-root" or "file"
    array_key: str | None  # a key `xtckpt show` can read


@dataclass(frozen=True)
class Case:
    id: str
    seed: Seed
    description: str


def files_of(seed: Seed) -> list[str]:
    """The seed's files (relative to its directory; the file itself for a file seed)."""
    if os.path.isfile(seed.path):
        return [""]
    return sorted(os.path.relpath(os.path.join(root, f), seed.path)
                  for root, _, names in os.walk(seed.path) for f in names)


HOSTILE_VALUES = [2**40, 2**63, 2**64 + 7, -1, -(2**63), 0, 1e308, "²", "1.5", "", "x" * 5000, None, True, [], {},
                  [2**40] * 40, [[[]]], {"a": {"b": {}}}, "../../etc", "/abs", "a\x00b", [0] * 3, 3.5]
# Names a reader would join to its directory: each must be refused, or kept inside the directory.
HOSTILE_NAMES = ["../outside", "../../../../../../tmp/outside", "/etc/passwd", "a/../../outside", "..", ".", "",
                 "C:", "C:/outside", "c:\\outside", "..\\outside", "a\x00b", "a//b", "./a", "a/", "x" * 300,
                 "/".join(["d"] * 2100), "²", "\u202e..", "a/./b"]
KINDS = ["flip", "truncate", "json", "json", "json", "name", "delete-key", "remove", "deep", "fifo", "socket",
         "fifo-link"]
KIND_WEIGHTS = [3, 2, 4, 4, 4, 3, 2, 1, 1, 0.3, 0.2, 0.2]
SPECIAL = ("fifo", "socket", "fifo-link")


def mutate(seed: Seed, root: str, index: int) -> Case:
    """Copy `seed` into `root` and apply mutation `index` to the copy; the case describes what was done."""
    rng = random.Random(f"{seed.name}/{index}")
    target = os.path.join(root, os.path.basename(seed.path))
    if os.path.isfile(seed.path):
        shutil.copy(seed.path, target)
    else:
        shutil.copytree(seed.path, target, symlinks=True)
    files = files_of(seed)
    metadata = [f for f in files if os.path.basename(f) in METADATA_NAMES or f.endswith(".safetensors") or f == ""]
    kind = rng.choices(KINDS, weights=KIND_WEIGHTS)[0]
    # Special files anywhere half the time: data files too (chunks, OCDBT data files), which tensorstore opens.
    share = 0.5 if kind in SPECIAL else 0.85
    name = rng.choice(metadata if metadata and rng.random() < share else files)
    path = os.path.join(target, name) if name else target
    what = f"{seed.name}: {kind} {name or os.path.basename(seed.path)}"
    if kind in SPECIAL:
        _special(path, kind, root)
        return Case(f"{seed.name}-{index}", _moved(seed, target), what)
    data = open(path, "rb").read()
    header = None
    if name.endswith(".safetensors") or name == "":  # a safetensors file: mutate its JSON header
        length = struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else 0
        header, body = data[8:8 + length], data[8 + length:]
    doc = _json(header if header is not None else data)
    if kind in ("json", "name", "delete-key", "deep") and doc is None:
        kind = "flip"
        what = f"{seed.name}: {kind} {name or os.path.basename(seed.path)}"
    if kind == "flip":
        buffer = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            if buffer:
                at = rng.randrange(len(buffer))
                buffer[at] ^= 1 << rng.randrange(8)
        new = bytes(buffer)
    elif kind == "truncate":
        new = data[:rng.randrange(len(data))] if data else b""
    elif kind == "remove":
        os.remove(path)
        return Case(f"{seed.name}-{index}", _moved(seed, target), what)
    else:
        if kind == "deep":
            encoded = ("[" * 100_000 + "]" * 100_000).encode()
            what += " (nested 100,000 deep)"
        else:
            doc, change = _mutate_json(doc, rng, delete=kind == "delete-key", names=kind == "name")
            encoded = json.dumps(doc).encode()
            what += f" ({change})"
        if header is not None:
            encoded += b" " * (-len(encoded) % 8)
            new = struct.pack("<Q", len(encoded)) + encoded + body
        else:
            new = encoded
    with open(path, "wb") as f:
        f.write(new)
    return Case(f"{seed.name}-{index}", _moved(seed, target), what)


def _moved(seed: Seed, path: str) -> Seed:
    return Seed(seed.name, path, seed.kind, seed.array_key)


def _json(data: bytes):
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def _special(path: str, kind: str, root: str) -> None:
    """Replace the file `path` by a FIFO, a bound Unix socket, or a symbolic link to a FIFO outside the case's
    checkpoint (in `root`): none of them may be opened by a reader (a FIFO blocks it, a socket cannot be read)."""
    if os.path.isdir(path):  # a file seed: the checkpoint itself is replaced
        shutil.rmtree(path)
    else:
        os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":  # bound from its directory: a socket's path may not exceed 107 bytes
        here = os.getcwd()
        os.chdir(os.path.dirname(path))
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(os.path.basename(path))
        finally:
            os.chdir(here)
    else:
        fifo = os.path.join(root, "elsewhere.fifo")
        if not os.path.exists(fifo):
            os.mkfifo(fifo)
        os.symlink(fifo, path)


def _mutate_json(doc, rng: random.Random, *, delete: bool, names: bool = False):
    """Replace (or delete) one node of `doc`, chosen at random among all of them; the change, described. With
    `names`: a string (a key or a value) chosen at random replaced by one of `HOSTILE_NAMES`."""
    doc = copy.deepcopy(doc)
    nodes = []  # (container, key) of every value

    def walk(node, depth=0):
        if depth > 60:
            return
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            nodes.append((node, key))
            walk(value, depth + 1)

    walk(doc)
    if names:
        strings = [(c, k) for c, k in nodes if isinstance(c[k], str) or isinstance(k, str)]
        if strings:
            container, key = rng.choice(strings)
            value = rng.choice(HOSTILE_NAMES)
            if isinstance(container[key], str) and (not isinstance(key, str) or rng.random() < 0.7):
                container[key] = value
                return doc, f"{str(key)[:40]!r} set to the name {value[:40]!r}"
            container[value] = container.pop(key)
            return doc, f"key {str(key)[:40]!r} renamed {value[:40]!r}"
    if not nodes:
        return HOSTILE_VALUES[rng.randrange(len(HOSTILE_VALUES))], "the whole document replaced"
    container, key = rng.choice(nodes)
    if delete:
        del container[key]
        return doc, f"deleted {str(key)[:40]!r}"
    value = rng.choice(HOSTILE_VALUES)
    container[key] = value
    return doc, f"{str(key)[:40]!r} set to {str(value)[:40]!r}"


def ops_for(seed: Seed, out: str) -> list[list]:
    """The reads (and writes into `out`, the only place that may change) run on a case of `seed`."""
    path = seed.path
    if seed.kind == "root":
        return [["cli", "steps", path], ["cli", "verify", path], ["cli", "tree", os.path.join(path, "1")],
                ["cli", "convert", os.path.join(path, "1"), os.path.join(out, "item")],
                ["cli", "report", path, "-o", os.path.join(out, "report.html")]]
    if seed.kind == "xla-root":  # a torch_xla CheckpointManager root: its steps are DCP directories
        step = os.path.join(path, "2")
        return [["cli", "steps", path], ["cli", "tree", step], ["metadata", step], ["restore", step],
                ["cli", "verify", step], ["cli", "convert", step, os.path.join(out, "item")],
                ["cli", "report", path, "-o", os.path.join(out, "report.html")]]
    ops = [["cli", "tree", path], ["cli", "verify", path], ["cli", "stats", path, "--histogram", "log"],
           ["metadata", path], ["restore", path],
           ["cli", "convert", path, os.path.join(out, "item"), "--max-host-bytes", "64MiB"],
           ["cli", "convert", path, os.path.join(out, "hf"), "--to", "safetensors"]]
    if seed.kind == "step":
        ops = [op for op in ops if op[0] == "cli"]  # the API reads items; a step's items are read by the CLI
    ops += [["cli", "diff", path, path], ["cli", "report", path, "-o", os.path.join(out, "report.html")]]
    if seed.array_key:
        ops += [["cli", "show", path, f"{seed.array_key}[0:1]"], ["cli", "show", path, seed.array_key, "--layout"],
                ["cli", "show", path, seed.array_key, "--layout", "--mesh", "2x2", "--spec", "1,0", "--processes",
                 "2"]]
    return ops


def snapshot(path: str) -> dict[str, str]:
    """Every entry below `path` (or `path` itself) with its type and, for files, a digest of its content."""
    out = {}
    paths = [path] if not os.path.isdir(path) or os.path.islink(path) else []
    for root, dirs, files in os.walk(path):
        paths.extend(os.path.join(root, n) for n in dirs + files)
    for p in paths:
        if os.path.islink(p):
            out[p] = "link:" + os.readlink(p)
        elif os.path.isfile(p):
            with open(p, "rb") as f:
                out[p] = hashlib.sha1(f.read()).hexdigest()
        elif os.path.isdir(p):
            out[p] = "dir"
        else:
            out[p] = "special"
    return out


class Harness:
    """One worker process, restarted after a case kills it or hangs; `run` gives each op's outcome."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.proc: subprocess.Popen | None = None
        self._buffer = b""

    def _start(self) -> None:
        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

        self._buffer = b""
        self.proc = subprocess.Popen([sys.executable, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=self.env, preexec_fn=limit)
        assert json.loads(self._line(600))["ready"]

    def _line(self, timeout: float) -> str:
        """The worker's next line; `TimeoutError` if none comes in `timeout` seconds, `EOFError` if it died.
        Read through a buffer of our own: a buffered reader would hold a second line where `select` cannot
        see it."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def run(self, case_id: str, ops: list[list]) -> list[dict] | str:
        """The outcome of each op, or a string saying how the worker failed (a signal, a hang)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"id": case_id, "ops": ops}) + "\n").encode())
        self.proc.stdin.flush()
        try:
            return json.loads(self._line(CASE_TIMEOUT_S))["results"]
        except TimeoutError:
            self.proc.kill()
            self.proc.wait()
            return f"hung (no answer in {CASE_TIMEOUT_S} s)"
        except EOFError:
            code = self.proc.wait()
            return f"the worker died with {'signal ' + str(-code) if code < 0 else 'status ' + str(code)}"

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def failures(case: Case, outcome: list[dict] | str, before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What went wrong in one case, as lines naming the case (empty: nothing)."""
    problems = []
    if isinstance(outcome, str):
        problems.append(outcome)
    else:
        problems += [f"{' '.join(map(str, r['op']))}: {r['message']}" for r in outcome if r["outcome"] == "escaped"]
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    if changed:
        problems.append(f"files changed: {changed[:5]}")
    return [f"[{case.id}] {case.description}: {p}" for p in problems]
