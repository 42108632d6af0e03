"""torch.distributed.checkpoint storage in this library's format: ``dcp.save(sd,
storage_writer=DCPStorageWriter(path))`` writes an item that `xtc.restore`, ``xtckpt`` and Orbax read;
``dcp.load(sd, storage_reader=DCPStorageReader(path))`` reads ours, Orbax's, safetensors and DCP's own. The global
plan of a save (`plans`), the writer (`writer`), DCP's metadata of an item (`metadata`) and the reader (`reader`).
Imports torch.distributed.checkpoint (public names only); the package imports this module only when asked for
these classes."""

from .load_planner import DCPLoadPlanner
from .reader import DCPStorageReader
from .writer import DCPStorageWriter

__all__ = ["DCPLoadPlanner", "DCPStorageReader", "DCPStorageWriter"]
