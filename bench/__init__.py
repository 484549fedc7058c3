"""gpuflat benchmarks: gpuflat beside the flatteners a user would reach for.

``python -m bench`` runs every workload x dtype x operation for gpuflat (one
row per backend: "numpy" and the native "host" on a CPU, "cuda" on a GPU,
plus the ``gpuflat.torch`` drop-ins), the installed peers and the machine's
floors in one process; then times gpuflat's host work per norm and clip
call, with and without a resident model. It prints a table and the targets
and writes a JSON file and a PNG chart named after the machine.
"""
