"""hotload: keep a remote RL rollout fleet on the freshest policy with lossless weight deltas.

Public entry points (imported lazily so ``import fsdp_hotload.arc`` stays free of torch.distributed):

* :class:`HotloadConfig` - one validated config for everything;
* :class:`HotloadCallback` - the FSDP / plain-module training callback;
* :class:`TensorPublisher` - publish from in-memory tensors in one process;
* :class:`HotLoadEmulator` - a local stand-in for the Fireworks hot-load API.

Example::

    from fsdp_hotload import HotloadCallback, HotloadConfig
    hot = HotloadCallback(model, HotloadConfig(bucket_url="s3://bucket/prefix", full_every=20))
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
_LAZY = {
    "HotloadConfig": ("fsdp_hotload.config", "HotloadConfig"),
    "HotloadCallback": ("fsdp_hotload.callback", "HotloadCallback"),
    "TensorPublisher": ("fsdp_hotload.publish", "TensorPublisher"),
    "HotLoadEmulator": ("fsdp_hotload.emulator", "HotLoadEmulator"),
    "PublishError": ("fsdp_hotload.engine.publisher", "PublishError"),
    "OwnershipError": ("fsdp_hotload.fsdp", "OwnershipError"),
    "split_fused_experts": ("fsdp_hotload.naming", "split_fused_experts"),
    "transpose_fused_experts": ("fsdp_hotload.naming", "transpose_fused_experts"),
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'fsdp_hotload' has no attribute {name!r}")
