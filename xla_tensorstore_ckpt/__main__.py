"""``python -m xla_tensorstore_ckpt``: the offline command line (see `cli`)."""

from .cli import run

run()
