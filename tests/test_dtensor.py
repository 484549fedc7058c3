"""DTensor leaves (FSDP2, tensor parallel): gpuflat._src.dtensor and its use by
gpuflat.distributed, gpuflat.torch and the tree functions.

The multi-process cases live in tests/dtensor_worker.py. Starting a process
group costs seconds and these machines have 2 cores, so each world size runs
every case in one launch of gloo ranks on 127.0.0.1, under an explicit
timeout; each case is then its own test here, passing when every rank
reported it ok.
"""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import dtensor_worker  # noqa: E402
from ranks import Launches, check_case  # noqa: E402
import gpuflat as gf  # noqa: E402
from gpuflat._src import dtensor  # noqa: E402

LAUNCH_TIMEOUT = {2: 150, 4: 300}  # seconds for one launch; a hang fails every case of it
LAUNCHES = Launches(Path(__file__).with_name("dtensor_worker.py"), LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return lambda size: LAUNCHES.get(size, tmp_path_factory)


@pytest.mark.timeout(LAUNCH_TIMEOUT[4] + 60)
@pytest.mark.parametrize("size,case", [
    pytest.param(n, name, id=f"gloo-{n}-{name}")
    for n in (2, 4) for name, sizes in dtensor_worker.CASES if sizes is None or n in sizes])
def test_case_on_every_rank(report, size, case):
    check_case(*report(size), case)


# ---------------------------------------------------------------- one process

def test_plain_tensors_are_no_dtensors():
    assert not dtensor.is_dtensor(torch.ones(2))
    assert dtensor.sharding([None, torch.ones(2)], ["['a']", "['b']"]) is None


def test_a_tensor_subclass_gpuflat_cannot_read_is_named():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(3)
    with pytest.raises(gf.UnwalkableError, match=r"leaf \"\['w'\]\": expected a plain tensor or a DTensor, "
                                                 r"found a torch._subclasses.fake_tensor.FakeTensor"):
        gf.global_norm({"w": fake})
    import gpuflat.torch as gft

    with pytest.raises(TypeError, match=r"leaf 'tensors\[0\]': expected a plain tensor or a DTensor"):
        gft.get_total_norm([fake])


def test_a_plain_subclass_is_read_as_its_data():
    class Tagged(torch.Tensor):
        pass

    t = torch.tensor([3.0, 4.0]).as_subclass(Tagged)
    assert float(gf.global_norm({"w": t})) == 5.0
