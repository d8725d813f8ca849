"""A module's files: its ``state_dict`` as ``.pt`` (``torch.save``) and ``.safetensors``, each written
atomically (a reader never sees half a file). Either loads in plain PyTorch into the re-declared model:
``model.load_state_dict(torch.load(path, weights_only=True))`` or ``safetensors.torch.load_file``."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def save(module: nn.Module, path: Path) -> Path:
    """Write ``module``'s ``state_dict`` at ``path`` (``.pt``) and beside it as ``.safetensors``; ``path``."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    tmp = path.with_name(f".{path.stem}.tmp.pt")
    torch.save(state, tmp)
    tmp.replace(path)
    safetensors = path.with_suffix(".safetensors")
    tmp = path.with_name(f".{path.stem}.tmp.safetensors")
    save_file(_unshared(state), str(tmp))
    tmp.replace(safetensors)
    return path


def load(path: Path) -> dict[str, torch.Tensor]:
    """The ``state_dict`` in a ``.pt`` or ``.safetensors`` file (a ``.pt`` read with ``weights_only``)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state: dict[str, torch.Tensor] = torch.load(path, map_location="cpu", weights_only=True)
    return state


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with a tensor that shares memory with an earlier one (a tied weight's second name) copied:
    safetensors stores each tensor's own bytes, and refuses shared ones."""
    seen: set[int] = set()
    out = {}
    for key, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[key] = tensor.clone() if ptr in seen else tensor.contiguous()
        seen.add(ptr)
    return out
