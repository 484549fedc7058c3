"""gpuflat's internals: no stable API. The public modules are gpuflat,
gpuflat.torch, gpuflat.distributed, gpuflat.optim and gpuflat.errors."""
