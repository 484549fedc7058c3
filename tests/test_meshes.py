"""Models split over several meshes: expert parallelism (experts and dense
layers on different meshes of one root: a slice beside a flattened mesh,
torchtitan's sibling meshes), pipeline stages (``pp_mesh=``, a weight tied
across stages with ``tied=``), and meshes of different roots, refused.

The multi-process cases live in tests/mesh_worker.py, launched once per world
size (2 and 4 gloo ranks on 127.0.0.1) under an explicit timeout, as
tests/test_dtensor.py does; each case is then its own test here, passing
when every rank reported it ok.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import mesh_worker  # noqa: E402
from ranks import Launches, check_case  # noqa: E402

LAUNCH_TIMEOUT = {2: 150, 4: 300}  # seconds for one launch; a hang fails every case of it
LAUNCHES = Launches(Path(__file__).with_name("mesh_worker.py"), LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return lambda size: LAUNCHES.get(size, tmp_path_factory)


@pytest.mark.timeout(LAUNCH_TIMEOUT[4] + 60)
@pytest.mark.parametrize("size,case", [
    pytest.param(n, name, id=f"gloo-{n}-{name}")
    for n in (2, 4) for name, sizes in mesh_worker.CASES if sizes is None or n in sizes])
def test_case_on_every_rank(report, size, case):
    check_case(*report(size), case)


# ---------------------------------------------------------------- one process

def test_a_pipeline_clip_inside_torch_compile_runs_between_graphs():
    """gpuflat's operators hold no process group: across stages the drop-ins
    run as they are, between two graphs (a world of one rank here)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import gpuflat.torch as gft

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pp = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
        w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        w.grad = torch.tensor([3.0, 4.0], dtype=torch.float64)

        @torch.compile(backend="eager")
        def clip(params):
            return (gft.get_total_norm([p.grad for p in params], pp_mesh=pp, tied=[(params[0].grad, 0)]),
                    gft.clip_grad_norm_(params, 1.0, pp_mesh=pp))

        before, total = clip([w])
        assert float(before) == float(total) == 5.0
        torch.testing.assert_close(w.grad, torch.tensor([0.6, 0.8], dtype=torch.float64) / (1 + 0.2e-6))
    finally:
        dist.destroy_process_group()


def test_flat_optimizers_check_pp_mesh_and_tied_when_made():
    """gft.AdamW, SGD and Lion refuse a bad pp_mesh or tied as the clip does, when
    made, not at their first step (a world of one rank here)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import gpuflat.torch as gft

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pp = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
        w = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        stranger = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
        for kind in (gft.AdamW, gft.SGD, gft.Lion):
            for options, error, needle in (
                    (dict(pp_mesh=2), TypeError, "pp_mesh: expected a DeviceMesh or a torch.distributed ProcessGroup"),
                    (dict(pp_mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))), ValueError,
                     "pp_mesh: expected a 1-D DeviceMesh"),
                    (dict(tied=[(w, 0)]), ValueError, "tied: expected pp_mesh= beside it"),
                    (dict(pp_mesh=pp, tied=[(w, 1)]), ValueError, "tied[0]: expected the owning stage, 0 to 0"),
                    (dict(pp_mesh=pp, tied=[w]), TypeError, "tied[0]: expected a pair (weight, owning stage)"),
                    (dict(pp_mesh=pp, tied=[(stranger, 0)]), ValueError,
                     "tied[0]: expected one of the leaves given, found a Parameter of shape (3,)")):
                with pytest.raises(error, match=re.escape(needle)):
                    kind([w], max_norm=1.0, **options)
            # A world of one stage: the pipeline's norm is this stage's.
            w.grad = torch.tensor([3.0, 4.0], dtype=torch.float64)
            opt = kind([w], lr=0.0, max_norm=1.0, pp_mesh=pp, tied=[(w, 0)])
            opt.step()
            assert float(opt.last_grad_norm) == 5.0
    finally:
        dist.destroy_process_group()
