"""Megatron integration of hotload.

Today this package generates the ``--hotload-*`` command-line flags from :class:`fsdp_hotload.HotloadConfig`
and builds the config back from parsed arguments, so a Megatron launcher gets exactly the same validated
settings as an FSDP script. The Megatron weight adapter (TP/PP/EP layouts to HF names) is not written yet; until
it is, Megatron jobs can publish with :class:`fsdp_hotload.TensorPublisher` from a gathered HF state dict.

Example::

    parser = argparse.ArgumentParser()
    add_hotload_args(parser)                 # --hotload-bucket-url, --hotload-full-every, ...
    cfg = config_from_args(parser.parse_args())   # None unless --hotload-bucket-url or HOTLOAD_BUCKET_URL is set

In a Megatron script, Megatron Core 0.18 and later (``pretrain`` no longer takes ``extra_args_provider``)::

    args = parse_and_validate_args(extra_args_provider=add_hotload_args, args_defaults={...})
    cfg = config_from_args(args)             # on every rank

Up to 0.17: ``pretrain(..., extra_args_provider=add_hotload_args)``, then, once the arguments are parsed (after
``initialize_megatron``, or in a provider that ``pretrain`` calls), ``config_from_args(get_args())``. With a
provider of your own (``pretrain_gpt.py``'s ``add_modelopt_args``), chain them: both return the parser,
``extra_args_provider=lambda p: add_hotload_args(add_modelopt_args(p))``.
"""
from __future__ import annotations

from .args import add_hotload_args, config_from_args, flag_name

__all__ = ["add_hotload_args", "config_from_args", "flag_name"]
