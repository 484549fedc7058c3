"""gpuflat.distributed across processes: torch.distributed (gloo) and MPI, 2 and 4 ranks.

Starting a process group costs seconds, so each (transport, ranks) pair runs
every case of tests/distributed_worker.py in one launch, on 127.0.0.1 only;
each case is then its own test here, passing when every rank reported it ok.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import distributed_worker
from ranks import collect, free_port
import gpuflat as gf
from gpuflat import distributed as gfd
from gpuflat._src.ranks import _Comm

WORKER = Path(__file__).with_name("distributed_worker.py")
# The ranks import gpuflat from this checkout, not from wherever it is installed.
CHECKOUT = str(Path(__file__).resolve().parents[1])
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")])))
MPIRUN = Path(sys.executable).with_name("mpirun")
LAUNCH_TIMEOUT = 90  # seconds for one launch; a hang fails every case of it
RUNS = [("gloo", 2), ("gloo", 4), ("mpi", 2), ("mpi", 4)]

_reports: dict = {}


def _mpirun(size, *command):
    """mpirun on this machine only: ranks talk through shared memory (the self and sm
    transports), never a network interface."""
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [str(MPIRUN), *root, "--oversubscribe", "-n", str(size), "--mca", "btl", "self,sm", "-x", "PYTHONPATH",
            sys.executable, "-m", "mpi4py", *command]


def _launch(transport, size, out_dir):
    """Run every case on ``size`` ranks; returns the ranks' reports and the processes' output."""
    if transport == "mpi":
        procs = [subprocess.Popen(_mpirun(size, str(WORKER), str(out_dir), "mpi"),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)]
    else:
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, str(WORKER), str(out_dir), "gloo", str(r), str(size), port],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
                 for r in range(size)]
    return collect(procs, out_dir, size, LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    def get(transport, size):
        key = (transport, size)
        if key not in _reports:
            _reports[key] = _launch(transport, size, tmp_path_factory.mktemp(f"{transport}{size}"))
        return _reports[key]

    return get


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
@pytest.mark.parametrize("transport,size,case", [
    pytest.param(t, n, name, id=f"{t}-{n}-{name}")
    for t, n in RUNS for name, transports in distributed_worker.CASES if t in transports])
def test_case_on_every_rank(report, transport, size, case):
    reports, output = report(transport, size)
    for rank, results in enumerate(reports):
        if case not in results:
            pytest.fail(f"rank {rank} did not report {case!r}; the processes printed:\n{output[-3000:]}")
        assert results[case] == "ok", f"rank {rank}:\n{results[case]}"


@pytest.mark.timeout(60)
def test_mpi_rank_that_raises_aborts_the_job(tmp_path):
    """Under MPI no collective times out: ``python -m mpi4py`` aborts every rank
    when one raises, instead of leaving the others in the all-reduce."""
    script = tmp_path / "raise_on_rank_1.py"
    script.write_text(
        "import numpy as np\n"
        "from mpi4py import MPI\n"
        "from gpuflat import distributed as gfd\n"
        "comm = MPI.COMM_WORLD\n"
        "if comm.Get_rank() == 1:\n"
        "    raise RuntimeError('rank 1 failed before the collective')\n"
        "gfd.global_norm({'w': np.ones(3)}, group=comm)\n"
        "print('rank', comm.Get_rank(), 'passed the collective')\n"
    )
    proc = subprocess.run(_mpirun(2, str(script)), capture_output=True, text=True, timeout=50, env=ENV)
    assert proc.returncode != 0
    assert "rank 1 failed before the collective" in proc.stdout + proc.stderr
    assert "passed the collective" not in proc.stdout


# ---------------------------------------------------------------- one process

def test_world_of_one_counts_owned_leaves_only():
    grads = {"w": np.array([3.0, 4.0], np.float32), "ln": np.array([12.0])}
    assert float(gfd.global_norm(grads)) == 13.0
    assert float(gfd.global_norm(grads, owned=lambda path, leaf: leaf.dtype == np.float32)) == 5.0
    assert float(gfd.global_norm(grads, np.inf, owned={"['ln']"})) == 12.0


def test_owned_errors_name_the_path():
    grads = {"w": np.ones(2)}
    with pytest.raises(ValueError, match=r"\['v'\].*expected one of"):
        gfd.global_norm(grads, owned={"['v']"})
    with pytest.raises(TypeError, match="owned: expected"):
        gfd.global_norm(grads, owned=3)


def test_group_of_the_wrong_type_is_refused():
    with pytest.raises(TypeError, match="group: expected a torch.distributed ProcessGroup"):
        gfd.global_norm({"w": np.ones(2)}, group="world")


def test_read_only_gradients_are_refused_before_any_write():
    ro = np.ones(3)
    ro.flags.writeable = False
    grads = {"a": np.full(2, 10.0), "b": ro}
    with pytest.raises(ValueError, match=r"leaf \"\['b'\]\": expected a writable array"):
        gfd.clip_grad_norm_(grads, 1.0)
    np.testing.assert_array_equal(grads["a"], np.full(2, 10.0))


def test_ownership_mask_is_cached_per_plan():
    calls = []

    def rule(path, leaf):
        calls.append(path)
        return True

    grads = {"w": np.ones(2), "b": np.ones(3)}
    for _ in range(3):
        gfd.global_norm(grads, owned=rule)
    assert calls == ["['w']", "['b']"]


def test_owned_takes_any_iterable_of_paths_and_dotted_paths():
    grads = {"enc": {"w": np.array([3.0, 4.0])}, "ln": np.array([12.0])}
    for owned in (["['enc']['w']"], ("enc.w",), frozenset({"['enc'].w"}), {"enc.w"}):
        assert float(gfd.global_norm(grads, owned=owned)) == 5.0, owned
    with pytest.raises(TypeError, match=r"got str 'ln' \(wrap one path in a set"):
        gfd.global_norm(grads, owned="ln")


def test_rules_combine_with_sets_and_callables_on_either_side():
    grads = {"w": np.array([3.0, 4.0]), "b": np.array([12.0])}
    for owned in (gfd.sharded() & {"['w']"}, {"['w']"} & gfd.sharded(), ["w"] & gfd.sharded(),
                  (lambda path: path == "['w']") & gfd.sharded(), gfd.sharded() & (lambda path, leaf: leaf.size == 2)):
        assert float(gfd.global_norm(grads, owned=owned)) == 5.0


def test_callables_take_the_path_or_the_path_and_the_leaf():
    grads = {"w": np.array([3.0, 4.0]), "b": np.array([12.0])}
    assert float(gfd.global_norm(grads, owned=lambda path: "w" in path)) == 5.0
    assert float(gfd.global_norm(grads, owned=gfd.Owned(lambda path, leaf=None: "b" in path))) == 12.0
    with pytest.raises(TypeError, match=r"owned: expected a callable \(path\) -> bool or \(path, leaf\) -> bool, "
                                        r"got .*<lambda>\(a, b, c\)"):
        gfd.global_norm(grads, owned=lambda a, b, c: True)


def test_unknown_where_paths_and_owner_ranks_raise():
    grads = {"ln": np.ones(2)}
    with pytest.raises(ValueError, match=r"where: path 'lm' not a trainable leaf.*expected one of \[\"\['ln'\]\"\]"
                                         r".*dotted \('enc.w'"):
        gfd.global_norm(grads, owned=gfd.replicated(where={"lm"}))
    with pytest.raises(ValueError, match=r"owner_rank: expected a rank of the group, 0 to 0 \(a group of 1 rank\), got -1"):
        gfd.tied(-1, where={"ln"})
    assert float(gfd.global_norm(grads, owned=gfd.replicated(where={"ln"}))) == pytest.approx(2 ** 0.5)


def test_all_reduce_of_a_resident_torch_model_in_a_world_of_one():
    torch = pytest.importorskip("torch")
    net = torch.nn.Linear(3, 2)
    r = gf.resident(net)
    net(torch.ones(4, 3)).sum().backward()
    before = {n: g.clone() for n, g in r.grads.items()}
    gfd.all_reduce_(r, "mean")
    gfd.all_reduce_(net, "sum")
    for n, g in r.grads.items():
        np.testing.assert_array_equal(g.numpy(), before[n].numpy())
        assert net.get_parameter(n).grad is g


def test_a_module_with_a_missing_gradient_is_refused_naming_it():
    torch = pytest.importorskip("torch")
    net = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"leaf 'weight': expected a gradient tensor, got None"):
        gfd.all_reduce_(net)



def test_a_torch_groups_cupy_work_runs_on_pytorchs_current_stream(monkeypatch):
    # NCCL orders its collectives on PyTorch's current stream: CuPy's work on
    # the buffer it reduces goes there too, wrapped as CuPy 14 wraps a
    # foreign stream (ExternalStream, which it deprecates, would warn).
    import warnings

    import cupy_stand_in
    import torch

    cupy = cupy_stand_in.make_cupy(("90",))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *device: type("S", (), {"cuda_stream": 0x4200})())
    comm = _Comm(None)
    comm.kind = "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with comm.stream(cupy) as stream:
            assert stream.ptr == 0x4200 and cupy.cuda.get_current_stream() is stream
    assert isinstance(comm.stream(np), type(contextlib.nullcontext()))
