// The host libraries' work items: each slot's elements cut into items of
// GF_ITEM elements (gpuflat._src.layout.ITEM) and a shorter last one, as
// gpuflat._src.layout.work_items cuts them for the CUDA kernels. The norm
// partials are per item, so this cut is part of the summation order.
// Included after gpuflat_common.cuh (struct Item) and gpuflat_rules.h
// (GF_ITEM), by sources that include <algorithm> and <vector> before
// host_prelude.h (see there).
#pragma once

// Appends to `items` the items of slot `slot`, of `size` elements whose
// first lies at `first` in the flat buffer (0 for a parameter row, which
// has none: its update reads start, never flat).
inline void gf_append_items(std::vector<Item>& items, long long slot, long long size, long long first) {
    for (long long start = 0; start < size; start += GF_ITEM)
        items.push_back(Item{slot, start, std::min<long long>(GF_ITEM, size - start), first + start});
}
