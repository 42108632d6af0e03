"""The processes of the chaos harness (tests/chaos.py) and what it reads back: the zygote that forks the four
processes of a job (tests/scripts/chaos_job.py), a job of them, the torch_xla job of one process
(tests/scripts/chaos_xla_job.py, a fresh interpreter: torch_xla does not survive a fork), the bucket seen
directly, and the fault-free reference run's digests."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

import gcs_emulator

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "scripts", "chaos_job.py")
XLA_JOB = os.path.join(HERE, "scripts", "chaos_xla_job.py")
BUCKET = "xtc-chaos"


class Zygote:
    """tests/scripts/chaos_job.py's zygote: forks processes that have imported torch and the library already."""

    def __init__(self, env: dict):
        self.process = subprocess.Popen([sys.executable, JOB, "zygote"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)
        self.messages: queue.Queue = queue.Queue()
        self.pending: list[dict] = []  # exits read while waiting for a fork's answer
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.messages.put(json.loads(line))
        self.messages.put({"zygote_ended": True})

    def fork(self, argv: list[str], env: dict, out: str) -> int:
        self.process.stdin.write(json.dumps({"argv": argv, "env": env, "out": out, "err": out + ".err"}) + "\n")
        self.process.stdin.flush()
        while True:
            message = self.messages.get()
            if "pid" in message:
                return message["pid"]
            if "zygote_ended" in message:
                raise RuntimeError("the zygote ended")
            self.pending.append(message)  # an exit: `next` gives it

    def next(self, timeout: float) -> dict | None:
        """The next exit report, or None after `timeout` seconds without one."""
        if self.pending:
            return self.pending.pop(0)
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


class Job:
    """One run of the four processes; `wait` collects their exit codes (None: still running at the deadline)."""

    def __init__(self, zygote: Zygote, argv: list[str], directory: str, world: int = 4):
        self.zygote, self.outs = zygote, [os.path.join(directory, f"{r}.out") for r in range(world)]
        env = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(gcs_emulator.free_port())}
        self.pids = [zygote.fork(argv, {**env, "RANK": str(r)}, self.outs[r]) for r in range(world)]

    def wait(self, deadline_s: float, stop_rank: int | None = None) -> list[int | None]:
        codes: dict[int, int] = {}
        end = time.monotonic() + deadline_s
        while len(codes) < len(self.pids) and time.monotonic() < end:
            if stop_rank is not None and self.pids[stop_rank] not in codes and stopped(self.pids[stop_rank]) \
                    and all(p in codes for r, p in enumerate(self.pids) if r != stop_rank):
                os.kill(self.pids[stop_rank], signal.SIGCONT)  # the others have ended: the stalled host wakes
            message = self.zygote.next(0.5)  # a bounded wait only to look at the stalled process again
            if message is not None and "exit" in message and message["exit"] in self.pids:
                codes[message["exit"]] = message["code"]
        hung = [(pid, out) for pid, out in zip(self.pids, self.outs) if pid not in codes]
        for pid, _ in hung:  # every thread's stack into the process's stderr file, for the report
            with contextlib.suppress(ProcessLookupError):  # it may end meanwhile (a stopped one, continued)
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGUSR1)
        for pid, out in hung:
            _wait_for_stacks(out + ".err")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return [codes.get(pid) for pid in self.pids]

    def kill(self) -> None:
        """SIGKILL every process of the job (a stopped one continued, so that it dies)."""
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def lines(self) -> list[list[dict]]:
        out = []
        for path in self.outs:
            with open(path) as f:
                out.append([json.loads(x) for x in f if x.startswith("{")])
        return out


def _wait_for_stacks(path: str, seconds: float = 10.0) -> None:
    """Until a hung process's stack dump (faulthandler) has stopped growing in `path`, at most `seconds`."""
    end, size = time.monotonic() + seconds, -1
    while time.monotonic() < end:
        now = os.path.getsize(path)
        if now == size and "most recent call first" in open(path, errors="replace").read():
            return
        size = now
        time.sleep(0.2)


class XlaJob:
    """The one process of the torch_xla variant, in a fresh interpreter; the same interface as `Job`."""

    def __init__(self, env: dict, argv: list[str], directory: str):
        self.outs = [os.path.join(directory, "0.out")]
        with open(self.outs[0], "w") as out, open(self.outs[0] + ".err", "w") as err:
            self.process = subprocess.Popen([sys.executable, XLA_JOB, *argv], stdout=out, stderr=err,
                                            env={**env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8"})

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def wait(self, deadline_s: float, stop_rank: int | None = None) -> list[int | None]:
        try:
            return [self.process.wait(timeout=deadline_s)]
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return [None]

    lines = Job.lines


class Store:
    """The persistent tier's bucket seen directly (not through the proxy): committed steps and their objects."""

    def __init__(self, kind: str, port: int, prefix: str):
        self.kind, self.port, self.prefix = kind, port, prefix
        self.root = f"{'gs' if kind == 'gcs' else 's3'}://{BUCKET}/{prefix}"

    def objects(self) -> dict[str, str]:
        """Object name (under the root) -> its hash as the store reports it."""
        out = {}
        if self.kind == "gcs":
            token = ""
            while True:
                query = urllib.parse.urlencode({"prefix": self.prefix + "/", **({"pageToken": token} if token else {})})
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/storage/v1/b/{BUCKET}/o?{query}",
                                            timeout=60) as response:
                    page = json.loads(response.read())
                out.update({i["name"][len(self.prefix) + 1:]: i.get("md5Hash", i.get("crc32c")) for i in
                            page.get("items", [])})
                token = page.get("nextPageToken", "")
                if not token:
                    return out
        for page in self._s3().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=self.prefix + "/"):
            out.update({o["Key"][len(self.prefix) + 1:]: o["ETag"] for o in page.get("Contents", [])})
        return out

    def read(self, name: str) -> bytes:
        """The bytes of the object `name` (under the root)."""
        key = f"{self.prefix}/{name}"
        if self.kind == "gcs":
            url = (f"http://127.0.0.1:{self.port}/download/storage/v1/b/{BUCKET}/o/"
                   f"{urllib.parse.quote(key, safe='')}?alt=media")
            with urllib.request.urlopen(url, timeout=60) as response:
                return response.read()
        return self._s3().get_object(Bucket=BUCKET, Key=key)["Body"].read()

    def replace(self, name: str, data: bytes | None) -> None:
        """Write `data` as the object `name` (under the root), or delete it (None)."""
        key = f"{self.prefix}/{name}"
        if self.kind == "s3":
            if data is None:
                self._s3().delete_object(Bucket=BUCKET, Key=key)
            else:
                self._s3().put_object(Bucket=BUCKET, Key=key, Body=data)
            return
        quoted = urllib.parse.quote(key, safe="")
        if data is None:
            request = urllib.request.Request(f"http://127.0.0.1:{self.port}/storage/v1/b/{BUCKET}/o/{quoted}",
                                             method="DELETE")
        else:
            request = urllib.request.Request(f"http://127.0.0.1:{self.port}/upload/storage/v1/b/{BUCKET}/o?"
                                             f"uploadType=media&name={quoted}", data=data, method="POST",
                                             headers={"Content-Type": "application/octet-stream"})
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()

    def delete_step(self, step: int) -> None:
        """Delete every object of `step` (an operator removing a damaged step)."""
        for name in self.objects():
            if name.split("/", 1)[0] == str(step):
                self.replace(name, None)

    def _s3(self):
        import boto3

        return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.port}", region_name="us-east-1",
                            aws_access_key_id="test", aws_secret_access_key="test")


class Reference:
    """The fault-free run: each rank's state digest at step 0 (fresh) and after each step, with no checkpoint;
    run again, twice as long, when a cycle goes past it (the training is deterministic)."""

    def __init__(self, launch, workdir: str, world: int):
        self.launch, self.workdir, self.digests = launch, workdir, [[] for _ in range(world)]

    def __getitem__(self, rank: int) -> list[str]:
        return self.digests[rank]

    def cover(self, step: int) -> None:
        """Make sure every rank's digests reach `step`."""
        if len(self.digests[0]) > step:
            return
        directory = tempfile.mkdtemp(prefix="reference-", dir=self.workdir)
        job = self.launch(["reference", str(max(2 * step, 32))], directory)
        codes = job.wait(3600)
        if codes != [0] * len(self.digests):
            raise RuntimeError(f"the reference run failed ({codes}): {open(job.outs[0] + '.err').read()[-2000:]}")
        self.digests = [rank_lines[-1]["digests"] for rank_lines in job.lines()]
        shutil.rmtree(directory)


