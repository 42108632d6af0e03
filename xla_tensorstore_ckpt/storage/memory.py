"""``memory://name``: tensorstore's in-memory kvstore, shared by the whole process. For tests and scratch
work: nothing survives the process."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Backend, Capabilities
from .kvstore import KvstoreBackend


@dataclass(frozen=True)
class MemoryBackend(KvstoreBackend):
    """The process's memory store; paths are keys."""

    scheme = "memory"
    # Tensorstore's memory store would keep referencing the buffers of zero-copy writes: freeing them later
    # (under the store's lock, needing the GIL) can deadlock against a thread holding the GIL.
    capabilities = Capabilities(atomic_create=True, durable_writes=True, cheap_refetch=True,
                                zero_copy_writes=False, renames=False)

    @classmethod
    def parse(cls, rest: str) -> tuple[Backend, str]:
        return cls(), rest.strip("/")

    def url(self, path: str) -> str:
        return f"memory://{path}"

    def kvstore_spec(self, path: str) -> dict:
        return {"driver": "memory", "path": f"{path}/" if path else ""}
