"""Implementations the benchmark times: gpuflat and each peer library.

Every module has ``library_name(device) -> str``, ``absent(device) ->
reason or None`` and ``cases(op, ctx) -> list[Case]``. A peer that is not installed is reported
with its reason, never replaced by made-up figures.
"""
from . import array_peers, gpuflat_impl, jax_peers, torch_peers

PROVIDERS = (gpuflat_impl, array_peers, torch_peers, jax_peers)


def split_available(device):
    """(available providers, {library: reason} for the absent ones)."""
    ready, absent = [], {}
    for provider in PROVIDERS:
        reason = provider.absent(device)
        if reason is None:
            ready.append(provider)
        else:
            absent[provider.library_name(device)] = reason
    return ready, absent
