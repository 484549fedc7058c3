"""gpuflat benchmarks: gpuflat beside the flatteners a user would reach for (#4).

``python -m bench`` runs every workload x dtype x operation for gpuflat, the
installed peers and the machine's floors in one process, then prints a table
and writes a JSON file and a PNG chart named after the machine.
"""
