"""Small Hugging Face checkpoints made in the tests (no hub access): two safetensors files with an index."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def hf_tensors() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The two files of a small model: bf16 and f32 matrices, vectors, a scalar; rows not multiples of 8."""
    g = torch.Generator().manual_seed(0)
    first = {"model.embed_tokens.weight": torch.randn(100, 48, generator=g).to(torch.bfloat16),
             "model.layers.0.self_attn.q_proj.weight": torch.randn(48, 48, generator=g),
             "model.layers.0.input_layernorm.weight": torch.randn(48, generator=g).to(torch.bfloat16)}
    second = {"model.layers.1.mlp.up_proj.weight": torch.randn(96, 48, generator=g),
              "model.norm.weight": torch.randn(48, generator=g),
              "lm_head.weight": torch.randn(100, 48, generator=g).to(torch.bfloat16),
              "model.rotary.scale": torch.tensor(0.25)}
    return first, second


def write_hf_dir(directory: str) -> dict[str, torch.Tensor]:
    first, second = hf_tensors()
    os.makedirs(directory, exist_ok=True)
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    save_file(first, os.path.join(directory, names[0]), metadata={"format": "pt"})
    save_file(second, os.path.join(directory, names[1]), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0},
             "weight_map": {**{k: names[0] for k in first}, **{k: names[1] for k in second}}}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return {**first, **second}
