"""gpuflat.torch.AdamW, SGD and Lion inside torch.compile: ``step()`` traces down
to gpuflat's operators (gpuflat._src.torch_optim_ops) with no graph break in
gpuflat's code, with and without max_norm, under gpuflat's GradScaler and
PyTorch's; ``zero_grad()`` reallocating the gradients recompiles nothing;
compiled steps give eager steps' bits. Under Inductor the operator updates
the parameters and state where they are: no clone in the graph, the
parameters' own addresses in the update's rows, an eager step's peak
memory. ``aot_eager`` does not reinplace a mutating operator's arguments
(it hands the operator copies and copies them back), which the last test
shows the memory measurement sees.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import gpuflat  # noqa: E402
import gpuflat.torch as gft  # noqa: E402
from gpuflat._src import param_rows, torch_optim_ops  # noqa: E402
from compiling import fresh_dynamo, model_and_twin, sharded_twins  # noqa: E402,F401  (fresh_dynamo: autouse)
from conftest import apart_at_most  # noqa: E402

nn = torch.nn
GPUFLAT_DIR = Path(gpuflat.__file__).resolve().parent

# (class, options, the biases' group's own options)
OPTIMIZERS = {
    "adamw": (gft.AdamW, dict(lr=1e-2, weight_decay=0.1), dict(weight_decay=0.0)),
    "sgd": (gft.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01), dict(weight_decay=0.0)),
    "sgd-mixed": (gft.SGD, dict(lr=0.05, momentum=0.9, nesterov=True), dict(momentum=0.0, nesterov=False)),
    "lion": (gft.Lion, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1), dict(weight_decay=0.0)),
}
SCALERS = {"stock": torch.amp.GradScaler, "gpuflat": gft.GradScaler}
INF_STEP = 2


def make_optimizer(name, model, max_norm, lr=None):
    cls, kw, own = OPTIMIZERS[name]
    if lr is not None:
        kw = dict(kw, lr=lr)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return cls([{"params": weights}, {"params": biases, **own}], max_norm=max_norm, **kw)


def update_op(name) -> str:
    # Every rule's compiled update is the one operator, the rule named in its first argument.
    return "gpuflat.update_.default"


def make_scaler(name):
    return None if name is None else SCALERS[name]("cpu", init_scale=2.0**8, growth_interval=2)


def train_step(model, opt, scaler, x, k):
    """zero_grad() (new gradient tensors at the next backward), backward,
    an inf in step INF_STEP's gradients under a scaler, then the step."""
    opt.zero_grad()
    loss = model(x).pow(2).sum()
    (loss if scaler is None else scaler.scale(loss)).backward()
    if scaler is not None and k == INF_STEP:
        model[0].weight.grad[0, 0] = float("inf")
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()


def without_recompiling(n, step):
    """``step(k)`` for k < n: the first compiles, any later recompile raises."""
    step(0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for k in range(1, n):
            step(k)


def assert_same_bits(model, opt, twin, twin_opt):
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        assert sorted(opt.state[p]) == sorted(twin_opt.state[q])
        for key in opt.state[p]:
            assert torch.equal(opt.state[p][key], twin_opt.state[q][key]), key
    if twin_opt.last_grad_norm is None:
        assert opt.last_grad_norm is None
    else:
        assert torch.equal(opt.last_grad_norm, twin_opt.last_grad_norm)


def breaks_in_gpuflat(explained) -> list:
    """The graph breaks whose location (the innermost frame) is in a gpuflat file."""
    return [r for r in explained.break_reasons
            if r.user_stack and Path(r.user_stack[-1].filename).resolve().is_relative_to(GPUFLAT_DIR)]


def gpuflat_ops(explained) -> set:
    return {str(op) for ops in explained.ops_per_graph for op in ops if "gpuflat" in str(op)}


@pytest.mark.parametrize("scaler_name", [None, "gpuflat", "stock"])
@pytest.mark.parametrize("max_norm", [None, 1.0])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_traces_down_to_the_operator_with_no_break_in_gpuflat(name, max_norm, scaler_name):
    model, _ = model_and_twin(0)
    explained = explain_step(model, make_optimizer(name, model, max_norm), make_scaler(scaler_name))
    assert breaks_in_gpuflat(explained) == []
    assert update_op(name) in gpuflat_ops(explained)
    if max_norm is not None or scaler_name == "gpuflat":
        assert "gpuflat.norm_and_nonfinite.default" in gpuflat_ops(explained)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_tensor_lr_traces_with_no_break_in_gpuflat(name):
    model, _ = model_and_twin(0)
    explained = explain_step(model, make_optimizer(name, model, 1.0, torch.tensor(0.01)), None)
    assert breaks_in_gpuflat(explained) == [] and update_op(name) in gpuflat_ops(explained)


def explain_step(model, opt, scaler):
    """torch._dynamo.explain of one training step's opt.step."""
    explained = []
    step = opt.step
    # The scaler calls opt.step with its grad_scale and found_inf set, as in training.
    opt.step = lambda *args, **kwargs: explained.append(torch._dynamo.explain(step)(*args, **kwargs))
    train_step(model, opt, scaler, torch.randn(4, 8), 0)
    return explained[0]


@pytest.mark.parametrize("scaler_name", [None, "gpuflat", "stock"])
@pytest.mark.parametrize("max_norm", [None, 1.0])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_five_steps_recompile_nothing_and_give_eager_bits(name, max_norm, scaler_name):
    model, twin = model_and_twin(1)
    opt, twin_opt = make_optimizer(name, model, max_norm), make_optimizer(name, twin, max_norm)
    scaler, twin_scaler = make_scaler(scaler_name), make_scaler(scaler_name)
    opt.step = torch.compile(opt.step, backend="aot_eager")
    grads = []

    def both(k):
        x = torch.randn(4, 8)
        train_step(model, opt, scaler, x, k)
        train_step(twin, twin_opt, twin_scaler, x, k)
        grads.append(model[0].weight.grad)

    without_recompiling(5, both)
    assert len({id(g) for g in grads}) == 5  # each step's gradients were new tensors
    assert_same_bits(model, opt, twin, twin_opt)
    if scaler is not None:
        assert scaler.get_scale() == twin_scaler.get_scale()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_tensor_lr_written_between_steps_recompiles_nothing(name):
    model, twin = model_and_twin(2)
    lr, twin_lr = torch.tensor(0.02), torch.tensor(0.02)
    opt, twin_opt = make_optimizer(name, model, 1.0, lr), make_optimizer(name, twin, 1.0, twin_lr)
    opt.step = torch.compile(opt.step, backend="aot_eager")

    def both(k):
        x = torch.randn(4, 8)
        train_step(model, opt, None, x, k)
        train_step(twin, twin_opt, None, x, k)
        lr.mul_(0.5)
        twin_lr.mul_(0.5)

    without_recompiling(4, both)
    assert_same_bits(model, opt, twin, twin_opt)


@pytest.mark.parametrize("scaler_name", ["gpuflat", "stock"])
def test_a_skipped_first_step_leaves_compiled_sgd_momentum_new_as_torch(scaler_name):
    # torch.optim.SGD never runs a step its GradScaler skips: its first real
    # step takes the gradient itself as the momentum buffer, undamped.
    model, twin = model_and_twin(3)
    kw = dict(lr=0.05, momentum=0.9, dampening=0.5)
    opt, twin_opt = gft.SGD(model.parameters(), **kw), torch.optim.SGD(twin.parameters(), **kw)
    scaler, twin_scaler = make_scaler(scaler_name), torch.amp.GradScaler("cpu", init_scale=2.0**8,
                                                                          growth_interval=2)
    opt.step = torch.compile(opt.step, backend="aot_eager")
    for k in range(4):
        x = torch.randn(4, 8)
        for m, o, s in ((model, opt, scaler), (twin, twin_opt, twin_scaler)):
            o.zero_grad()
            s.scale(m(x).pow(2).sum()).backward()
            if k == 0:
                m[0].weight.grad[0, 0] = float("inf")
            s.step(o)
            s.update()
    # Beside torch.optim's kernels, which round differently on each CPU:
    # within the bound of each step's chain of roundings (tests/conftest.py),
    # forward and backward through the two layers (a dot of 8 or 16 and a
    # bias, tanh, the squares summed over the batch of 4 and the 3 outputs,
    # the weights' gradients summed over the batch) and SGD's update (decay,
    # momentum, dampening, lr, the subtraction: 7).
    step_roundings = 2 * ((8 + 1) + 1 + (16 + 1) + 4 * 3) + 2 * 4 + 7
    for p, q in zip(model.parameters(), twin.parameters()):
        for a, b in ((p, q), (opt.state[p]["momentum_buffer"], twin_opt.state[q]["momentum_buffer"])):
            scale = float(torch.maximum(a.abs().max(), b.abs().max()))
            atol = apart_at_most(torch.finfo(a.dtype).eps, 4 * step_roundings, scale)
            torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_dtensor_parameters_compile_with_the_eager_bits(name):
    # The operators take the local shards; the norm over the mesh, a
    # collective, runs between two graphs. One rank: the same code paths.
    with sharded_twins(5) as (shard, params, twins):
        cls, kw, own = OPTIMIZERS[name]
        opt, twin_opt = (cls([{"params": ps[:1]}, {"params": ps[1:], **own}], max_norm=0.5, **kw)
                         for ps in (params, twins))
        opt.step = torch.compile(opt.step, backend="aot_eager")
        for _ in range(3):
            grads = [torch.randn(p.shape) for p in params]
            for ps, o in ((params, opt), (twins, twin_opt)):
                o.zero_grad()
                for p, g in zip(ps, grads):
                    p.grad = shard(g)
                o.step()
        local = gpuflat._src.dtensor.local
        for p, q in zip(params, twins):
            assert torch.equal(local(p), local(q))
            assert all(torch.equal(local(opt.state[p][k]), local(twin_opt.state[q][k])) for k in opt.state[p])
        assert torch.equal(opt.last_grad_norm, twin_opt.last_grad_norm)


def test_every_tensor_the_update_writes_has_its_version_moved():
    # Parameters, state and step counts: each tensor of each list the update
    # writes, called directly as from a compiled step.
    ws, gs = [torch.ones(3), torch.ones(2, 2)], [torch.full((3,), 0.5), torch.full((2, 2), -0.5)]
    states = [torch.zeros(3), torch.zeros(2, 2), torch.zeros(3), torch.zeros(2, 2)]  # exp_avg, then exp_avg_sq
    steps = [torch.zeros(()) for _ in ws]
    written = [*ws, *states, *steps]
    versions = [t._version for t in written]
    torch.ops.gpuflat.update_("adamw", ws, gs, states, steps, groups=[0, 0], indices=[0, 1],
                              hyper=[0.1, 0.0, 0.9, 0.999, 1e-8, 0.0, 0.0], lr_tensor=[None])
    assert [t._version > v for t, v in zip(written, versions)] == [True] * len(written)
    assert [float(s) for s in steps] == [1.0, 1.0]
    model, _ = model_and_twin(6)
    opt = make_optimizer("adamw", model, 1.0)
    opt.step = torch.compile(opt.step, backend="aot_eager")
    for k in range(2):  # compiled, and then run on the state the first step made
        train_step(model, opt, None, torch.randn(4, 8), k)
    written = [t for p in model.parameters() for t in (p, *opt.state[p].values())]
    versions = [t._version for t in written]
    train_step(model, opt, None, torch.randn(4, 8), 2)
    assert [t._version > v for t, v in zip(written, versions)] == [True] * len(written)


# ---------------------------------------------------------------- in place, under Inductor

def peak_bytes(call) -> int:
    """The most bytes the CPU allocator held at once during ``call()``
    beyond what it held before: the running total of allocated bytes that
    the profiler records at every allocation and free (PyTorch keeps no
    CPU allocator statistics otherwise)."""
    from torch._C._profiler import _EventType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events, peak = list(prof.profiler.kineto_results.experimental_event_tree()), 0
    while events:
        event = events.pop()
        events.extend(event.children)
        if event.tag == _EventType.Allocation:
            peak = max(peak, event.extra_fields.total_allocated)
    return peak


def held_bytes(model, opt) -> int:
    """What a step starts from: the parameters, their gradients and the state."""
    tensors = [t for p in model.parameters() for t in (p, p.grad, *opt.state[p].values())]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def final_graphs(monkeypatch) -> list:
    """Inductor's graphs after its last pass over mutations (reinplacing,
    then the functionalised operators' decomposition)."""
    from torch._inductor.fx_passes import post_grad

    graphs, decompose = [], post_grad.decompose_auto_functionalized

    def kept(graph):
        decompose(graph)
        graphs.append(graph)

    monkeypatch.setattr(post_grad, "decompose_auto_functionalized", kept)
    return graphs


def addresses_updated(monkeypatch) -> list:
    """The parameter addresses of each update's rows, as the operator hands them over."""
    seen, update = [], torch_optim_ops.update

    def recorded(rule, table, *args):
        seen.append(sorted(a for rows in table.updates for a in rows.rows[:, 0].tolist()))
        update(rule, table, *args)

    monkeypatch.setattr(torch_optim_ops, "update", recorded)
    return seen


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
@pytest.mark.slow  # Inductor builds C++ with g++
def test_inductor_updates_in_place_with_the_eager_bits_and_peak_memory(name, monkeypatch):
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    twin = copy.deepcopy(model)
    opt, twin_opt = make_optimizer(name, model, 1.0), make_optimizer(name, twin, 1.0)
    scaler, twin_scaler = make_scaler("gpuflat"), make_scaler("gpuflat")
    graphs, seen, built = final_graphs(monkeypatch), addresses_updated(monkeypatch), builds(monkeypatch)
    gpuflat.cache_clear()
    opt.step = torch.compile(opt.step)
    peaks = {}
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph skips the passes
        for k in range(3):
            x = torch.randn(4, 256)
            train_step(model, opt, scaler, x, k)
            train_step(twin, twin_opt, twin_scaler, x, k)
    assert_same_bits(model, opt, twin, twin_opt)
    assert seen and all(s == sorted(p.data_ptr() for p in model.parameters()) for s in seen)
    assert len(built) == 1  # the same tensors at every call (new gradients patched in): the table is kept
    (graph,) = graphs
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    update = [n for n in nodes if str(n.target) == update_op(name)]
    assert len(update) == 1
    assert not [n for n in nodes if "clone" in str(n.target) or "auto_functionalized" in str(n.target)]
    written = {a for arg in update[0].args if isinstance(arg, (list, tuple)) for a in arg}
    for n in nodes:  # what a functionalised operator leaves: x.copy_(x), nothing for Inductor to copy
        if str(n.target) == "aten.copy_.default" and n.args[0] in written:
            assert n.args[1] is n.args[0]
    for m, o, s, key in ((model, opt, scaler, "compiled"), (twin, twin_opt, twin_scaler, "eager")):
        o.zero_grad(set_to_none=False)
        s.scale(m(torch.randn(4, 256)).pow(2).sum()).backward()
        peaks[key] = held_bytes(m, o) + peak_bytes(lambda: (s.step(o), s.update()))
    assert peaks["compiled"] <= peaks["eager"] * 1.01, peaks


def test_aot_eager_hands_the_operator_copies_which_the_peak_memory_shows():
    # What Inductor's reinplacing removes: without it the functionalised
    # operator works on copies of the parameters and state, the measure of
    # the test above sees them.
    model, twin = (nn.Sequential(nn.Linear(256, 256)) for _ in range(2))
    opt, twin_opt = make_optimizer("adamw", model, 1.0), make_optimizer("adamw", twin, 1.0)
    opt.step = torch.compile(opt.step, backend="aot_eager")
    for m, o in ((model, opt), (twin, twin_opt)):
        m(torch.randn(4, 256)).sum().backward()
        o.step()
    copied = sum(p.numel() * p.element_size() * 3 for p in model.parameters())  # parameter, exp_avg, exp_avg_sq
    assert peak_bytes(opt.step) >= peak_bytes(twin_opt.step) + copied


# The precision options on a bfloat16 model: what each 16-bit parameter keeps
# beside it goes into the operator's state lists, and is written in place.
PRECISION = {
    "adamw-master": (gft.AdamW, dict(lr=1e-2, master_weights=True, exp_avg_dtype=torch.float32)),
    "sgd-kahan": (gft.SGD, dict(lr=0.05, momentum=0.9, kahan_sum=True)),
    "lion-master": (gft.Lion, dict(lr=1e-3, master_weights=True, exp_avg_dtype=torch.float32)),
    "sgd-stochastic": (gft.SGD, dict(lr=0.05, bf16_stochastic_round=True, rounding_seed=5)),
}


@pytest.mark.parametrize("name", list(PRECISION))
def test_precision_options_compile_with_the_eager_bits(name):
    model, twin = (m.to(torch.bfloat16) for m in model_and_twin(4))
    cls, kw = PRECISION[name]
    opt, twin_opt = cls(model.parameters(), max_norm=1.0, **kw), cls(twin.parameters(), max_norm=1.0, **kw)
    opt.step = torch.compile(opt.step, backend="aot_eager")

    def both(k):
        x = torch.randn(4, 8, dtype=torch.bfloat16)
        train_step(model, opt, None, x, k)
        train_step(twin, twin_opt, None, x, k)

    without_recompiling(4, both)
    assert_same_bits(model, opt, twin, twin_opt)
    if kw.get("bf16_stochastic_round"):
        # The draws are keyed by each parameter's count, which the compiled steps moved.
        assert all(float(opt.state[p]["step"]) == 4 for p in model.parameters())
        return
    kept = "kahan_comp" if kw.get("kahan_sum") else "master_param"
    # Each holds what its bfloat16 parameter could not.
    lost = [opt.state[p][kept].float() - (0 if kept == "kahan_comp" else p.float()) for p in model.parameters()]
    assert all(bool(d.abs().max() > 0) for d in lost)


# ---------------------------------------------------------------- the update's table, kept between calls

def builds(monkeypatch) -> list:
    """One entry per table the compiled update reads and checks in full
    (``param_rows.table_of``: an eager step builds its rows otherwise)."""
    built, table_of = [], param_rows.table_of

    def counted(*args, **kwargs):
        built.append(1)
        return table_of(*args, **kwargs)

    monkeypatch.setattr(param_rows, "table_of", counted)
    return built


def compiled_on_its_tensors(opt):
    """``opt.step`` compiled with TorchDynamo's eager backend: the update
    operator gets the parameters and state themselves, as under Inductor
    (aot_eager hands it copies, new memory at each call), without a build."""
    opt.step = torch.compile(opt.step, backend="eager")


def test_repeated_compiled_steps_build_the_table_once(monkeypatch):
    model, twin = model_and_twin(7)
    opt, twin_opt = make_optimizer("adamw", model, 1.0), make_optimizer("adamw", twin, 1.0)
    compiled_on_its_tensors(opt)
    gpuflat.cache_clear()
    built = builds(monkeypatch)

    def both(k, set_to_none=True):
        x = torch.randn(4, 8)
        for m, o in ((model, opt), (twin, twin_opt)):
            o.zero_grad(set_to_none=set_to_none)  # None: new gradient tensors at the backward
            m(x).pow(2).sum().backward()
            o.step()

    without_recompiling(4, both)
    assert len(built) == 1
    for k in range(2):  # the same gradient tensors, written in place
        both(k, set_to_none=False)
    assert len(built) == 1 and gpuflat.cache_info()["compiled steps' tables"] >= 1
    gpuflat.cache_clear()
    both(0)
    assert len(built) == 2
    assert_same_bits(model, opt, twin, twin_opt)


def sgd_calls(values, clear, dtypes=None):
    """The parameters, momentum buffers and counts after ``gpuflat::update_``
    called as a compiled graph calls it (the same parameters and state,
    new gradient tensors: ``values[k]`` at call k, alternately views of
    one memory and new tensors), the caches emptied before each call
    where ``clear``; ``dtypes[k]``: the parameters' dtype at call k (views
    of their memory)."""
    torch.manual_seed(8)
    w = [torch.randn(3, dtype=torch.float16), torch.randn(2, 2, dtype=torch.float16)]
    bufs, steps = [torch.zeros_like(t) for t in w], [torch.zeros(()) for _ in w]
    memory = [torch.empty_like(t) for t in w]
    kw = dict(groups=[0, 0], indices=[0, 1], hyper=[0.1, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0], lr_tensor=[None])
    for k, gs in enumerate(values):
        dtype = torch.float16 if dtypes is None else dtypes[k]
        if k % 2:
            for m, g in zip(memory, gs):
                m.copy_(g)
            grads = [m.view(dtype) for m in memory]
        else:
            grads = [g.clone().view(dtype) for g in gs]
        if clear:
            gpuflat.cache_clear()
        torch.ops.gpuflat.update_("sgd", [t.view(dtype) for t in w], grads, bufs, steps, **kw)
    return [*w, *bufs, *steps]


def gradient_values(n):
    torch.manual_seed(9)
    return [[torch.randn(3).half(), torch.randn(2, 2).half()] for _ in range(n)]


def test_new_gradient_tensors_in_the_same_memory_or_elsewhere_are_patched_in(monkeypatch):
    values = gradient_values(5)
    fresh = sgd_calls(values, clear=True)
    built = builds(monkeypatch)
    gpuflat.cache_clear()
    kept = sgd_calls(values, clear=False)
    assert len(built) == 1
    assert all(torch.equal(a, b) for a, b in zip(kept, fresh))


def test_parameters_viewed_as_another_dtype_in_the_same_memory_build_again(monkeypatch):
    # The same addresses and element counts, bfloat16 where they were float16:
    # its buffers, still float16, are then of another dtype (a precision word).
    values = gradient_values(4)
    dtypes = [torch.float16, torch.bfloat16, torch.bfloat16, torch.float16]
    fresh = sgd_calls(values, clear=True, dtypes=dtypes)
    built = builds(monkeypatch)
    gpuflat.cache_clear()
    kept = sgd_calls(values, clear=False, dtypes=dtypes)
    assert len(built) == 2  # float16, then bfloat16; float16 again is found among the kept tables
    assert all(torch.equal(a, b) for a, b in zip(kept, fresh))


def changed_between_steps(monkeypatch, opt, model, twin_opt, twin, change, dtype=torch.float32):
    """Two compiled steps and two eager ones on the twin, then
    ``change(model, opt)`` and ``change(twin, twin_opt)``, then two more of
    each: the compiled steps must give the eager bits, and build their
    table twice (once at the first step, once after the change)."""
    compiled_on_its_tensors(opt)
    gpuflat.cache_clear()
    built = builds(monkeypatch)
    for k in range(4):
        if k == 2:
            change(model, opt)
            change(twin, twin_opt)
        x = torch.randn(4, 8, dtype=dtype)
        train_step(model, opt, None, x, k)
        train_step(twin, twin_opt, None, x, k)
    assert len(built) == 2
    assert_same_bits(model, opt, twin, twin_opt)


def test_a_state_tensor_replaced_between_compiled_steps_is_read_again(monkeypatch):
    model, twin = model_and_twin(10)
    opt, twin_opt = make_optimizer("adamw", model, 1.0), make_optimizer("adamw", twin, 1.0)

    def replaced(m, o):
        o.state[m[0].weight]["exp_avg"] = o.state[m[0].weight]["exp_avg"] * 0.5

    changed_between_steps(monkeypatch, opt, model, twin_opt, twin, replaced)


@pytest.mark.parametrize("name, option, value", [("sgd", "momentum", 0.9), ("adamw", "amsgrad", True)])
def test_a_group_switching_on_state_between_compiled_steps_builds_again(monkeypatch, name, option, value):
    model, twin = model_and_twin(11)
    cls, kw, _ = OPTIMIZERS[name]
    kw = dict(kw, **{option: 0.0 if option == "momentum" else False})
    opt, twin_opt = cls(model.parameters(), max_norm=1.0, **kw), cls(twin.parameters(), max_norm=1.0, **kw)

    def switched_on(m, o):
        o.param_groups[0][option] = value

    changed_between_steps(monkeypatch, opt, model, twin_opt, twin, switched_on)
    assert all(("max_exp_avg_sq" if option == "amsgrad" else "momentum_buffer") in opt.state[p]
               for p in model.parameters())


def test_a_rounding_seed_changed_between_compiled_steps_builds_again(monkeypatch):
    model, twin = (m.to(torch.bfloat16) for m in model_and_twin(12))
    cls, kw = PRECISION["sgd-stochastic"]
    opt, twin_opt = cls(model.parameters(), max_norm=1.0, **kw), cls(twin.parameters(), max_norm=1.0, **kw)

    def reseeded(m, o):
        o.param_groups[0]["rounding_seed"] = 6

    changed_between_steps(monkeypatch, opt, model, twin_opt, twin, reseeded, dtype=torch.bfloat16)


def kept_and_fresh(monkeypatch, make, change, inputs):
    """Compiled steps (the operator given the tensors themselves) of
    ``make()``'s (model, optimizer), ``change(model, opt)`` before the
    third: with the kept tables, and again with tables built at every
    step (the caches emptied before each); the two runs' parameters and
    state, bit for bit, and the kept run building twice (at the first
    step and after the change). ``inputs(model)``: a batch for the model
    as it is."""
    def run(clear):
        torch._dynamo.reset()
        model, opt = make()
        compiled_on_its_tensors(opt)
        gpuflat.cache_clear()
        torch.manual_seed(15)
        for k in range(4):
            if k == 2:
                change(model, opt)
            if clear:
                gpuflat.cache_clear()
            opt.zero_grad()
            model(inputs(model)).pow(2).sum().backward()
            opt.step()
        return [t for p in model.parameters() for t in (p, *opt.state[p].values())]

    fresh = run(clear=True)
    built = builds(monkeypatch)
    kept = run(clear=False)
    assert len(built) == 2
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(kept, fresh))


def test_a_parameter_moved_to_another_group_builds_again(monkeypatch):
    # The same parameters in the same order, the first layer's bias now in
    # the second group, with its learning rate. (Against fresh tables: the
    # eager step, which compares the groups' lists as one, misses this move.)
    def make():
        model, _ = model_and_twin(16)
        return model, gft.SGD([{"params": [*model[0].parameters()]},
                               {"params": [*model[2].parameters()], "lr": 0.01}], lr=0.05, momentum=0.9, max_norm=1.0)

    def moved(m, o):
        o.param_groups[0]["params"] = [m[0].weight]
        o.param_groups[1]["params"] = [m[0].bias, *m[2].parameters()]

    kept_and_fresh(monkeypatch, make, moved, lambda m: torch.randn(4, 8))


def test_a_parameter_moved_within_its_group_builds_again(monkeypatch):
    # A parameter without a gradient moved from first to last: the others'
    # indices, which key their stochastic rounding, each one less. (Against
    # fresh tables: the eager step keeps each parameter's key as first read.)
    def make():
        model = model_and_twin(17)[0].to(torch.bfloat16)
        cls, kw = PRECISION["sgd-stochastic"]
        return model, cls([nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)), *model.parameters()], max_norm=1.0,
                          **kw)

    def moved(m, o):
        ps = o.param_groups[0]["params"]
        o.param_groups[0]["params"] = [*ps[1:], ps[0]]

    kept_and_fresh(monkeypatch, make, moved, lambda m: torch.randn(4, 8, dtype=torch.bfloat16))


def transposed_model(seed):
    """model_and_twin's, its first weight laid out transposed (not
    contiguous: its gradients, and their addresses, are read every step)."""
    model, twin = model_and_twin(seed)
    for m in (model, twin):
        m[0].weight = nn.Parameter(m[0].weight.detach().t().contiguous().t())
    return model, twin


def test_gradients_not_contiguous_give_the_eager_bits_and_errors(monkeypatch):
    model, twin = transposed_model(13)
    opt, twin_opt = make_optimizer("sgd", model, 1.0), make_optimizer("sgd", twin, 1.0)
    compiled_on_its_tensors(opt)
    gpuflat.cache_clear()
    built = builds(monkeypatch)
    # Per model, memory the gradients are copied into and viewed from, the same at every step.
    memory = {id(m): [torch.empty(16 * 16 if i == 0 else p.numel()) for i, p in enumerate(m.parameters())]
              for m in (model, twin)}

    def step(m, o, x, weight_view=None):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        if weight_view is not None:  # every gradient a view of its memory: the same addresses at every step
            for i, (p, mem) in enumerate(zip(m.parameters(), memory[id(m)])):
                (mem[:128].view(8, 16).t() if i == 0 else mem.view_as(p)).copy_(p.grad)
                p.grad = weight_view(mem) if i == 0 else mem.view_as(p)
        o.step()

    aligned = lambda mem: mem[:128].view(8, 16).t()  # noqa: E731  (the weight's layout)
    for k in range(4):
        x = torch.randn(4, 8)
        for m, o in ((model, opt), (twin, twin_opt)):
            step(m, o, x, aligned if k >= 2 else None)
        if k == 2:
            before = len(built)
    assert_same_bits(model, opt, twin, twin_opt)
    assert len(built) == before  # the same addresses: found again, their layouts compared
    # The same addresses and element counts, the weight's gradient in another
    # layout (rows of 16): refused as the eager step refuses it.
    across = lambda mem: mem.view(16, 16)[:, :8]  # noqa: E731
    x = torch.randn(4, 8)
    errors = []
    for m, o in ((model, opt), (twin, twin_opt)):
        with pytest.raises(ValueError, match="expected its gradient of shape") as info:
            step(m, o, x, across)
        errors.append(str(info.value))
        # An error out of a compiled step leaves the step's no_grad on (TorchDynamo's frame never restores it).
        torch.set_grad_enabled(True)
    assert errors[0] == errors[1] and "param_groups[0]['params'][0]" in errors[0]
    for p, q in zip(model.parameters(), twin.parameters()):  # nothing written
        assert torch.equal(p, q)


def test_a_parameter_dtype_changed_between_compiled_steps_builds_again(monkeypatch):
    # Against fresh tables: a compiled step keeps the state in its dtype (its
    # rows say so), where an eager step makes it follow the parameter's.
    def make():
        model, _ = model_and_twin(14)
        return model, make_optimizer("adamw", model, 1.0)

    kept_and_fresh(monkeypatch, make, lambda m, o: m.double(), lambda m: torch.randn(4, 8, dtype=m[0].weight.dtype))


def test_a_table_kept_under_one_backend_is_not_used_under_another(monkeypatch):
    from gpuflat._src import tensor_table
    from gpuflat._src.backends import get_backend

    served = []
    update = torch_optim_ops.update
    monkeypatch.setattr(torch_optim_ops, "update",
                        lambda rule, table, *args: (served.append([r.backend.name for r in table.updates]),
                                                    update(rule, table, *args))[1])
    w, g = torch.ones(3), torch.full((3,), 0.5)
    kw = dict(groups=[0], indices=[0], hyper=[0.1] + [0.0] * 6, lr_tensor=[None])
    gpuflat.cache_clear()
    torch.ops.gpuflat.update_("sgd", [w], [g], [], [], **kw)
    with tensor_table.serve_with(get_backend("emulated")):
        torch.ops.gpuflat.update_("sgd", [w], [g], [], [], **kw)
    torch.ops.gpuflat.update_("sgd", [w], [g], [], [], **kw)
    default = tensor_table.backend_for(w.device).name
    assert served == [[default], ["emulated"], [default]]
    torch.testing.assert_close(w, torch.full((3,), 1.0 - 3 * 0.05))  # three updates, whichever backend
