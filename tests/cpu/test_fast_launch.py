"""kernels/common/launch.py: the fast Triton launch hands the compiled launcher exactly what
``JITFunction.run`` would, and only for a combination of arguments it has launched before.

No GPU here: the JIT function is a stand-in with Triton's interface (``fn[grid](...)`` returns a
compiled kernel with ``run`` / ``function`` / ``packed_metadata``; ``signature``) that records
what reaches the launcher, and the argument order is checked against ``inspect``'s binding of a
real ``@triton.jit`` signature. The GPU tests run every fused op through the real path.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import triton.language as tl  # noqa: F401  (the stand-in kernel's string annotations name it)

from ditfuse.kernels.common import launch as fl


def _kernel_src(x_ptr, y_ptr, n, eps, s0, BLOCK: "tl.constexpr", FLAG: "tl.constexpr" = False,
                MODE: "tl.constexpr" = 3):
    pass


class FakeCompiled:
    def __init__(self, log):
        self.function = object()
        self.packed_metadata = ("meta",)
        self.log = log

    @property
    def run(self):
        def _run(g0, g1, g2, stream, function, packed, launch_md, enter, exit_, *args):
            assert function is self.function and packed == self.packed_metadata
            assert launch_md is None and enter is None and exit_ is None
            self.log.append(("fast", (g0, g1, g2), args))
        return _run


class FakeJIT:
    """Triton's JITFunction as launch() uses it; the slow path records bound_args.values()."""

    def __init__(self, src=_kernel_src):
        self.signature = inspect.signature(src)
        self.log: list = []
        self.compiled: dict = {}

    def __getitem__(self, grid):
        def runner(*args, **kw):
            opts = {k: kw.pop(k) for k in list(kw) if k in ("num_warps", "enable_fp_fusion")}
            bound = self.signature.bind(*args, **kw)
            bound.apply_defaults()
            g = grid(bound.arguments) if callable(grid) else grid
            self.log.append(("slow", tuple(g) + (1,) * (3 - len(g)), tuple(bound.arguments.values())))
            spec = tuple((type(a).__name__ if not isinstance(a, torch.Tensor) else str(a.dtype)) for a in args)
            return self.compiled.setdefault((spec, tuple(sorted(opts.items()))), FakeCompiled(self.log))
        return runner


@pytest.fixture
def gpu_like(monkeypatch):
    """launch() as on a GPU: fast path enabled, a current device and stream."""
    monkeypatch.setattr(fl, "_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    fl.clear()
    yield
    fl.clear()


def test_full_arguments_match_inspect_binding():
    import triton

    jit = triton.runtime.jit.JITFunction(_kernel_src)
    x, y = torch.zeros(4), torch.zeros(4)
    for args, kw in [((x, y, 5, 1e-6, 7), dict(BLOCK=64)),
                     ((x, y, 5, 1e-6, 7, 32), dict(MODE=1)),
                     ((x, y), dict(n=1, eps=0.5, s0=16, BLOCK=8, FLAG=True))]:
        bound = inspect.signature(_kernel_src).bind(*args, **kw)
        bound.apply_defaults()
        assert fl.full_arguments(jit, args, kw) == tuple(bound.arguments.values())
    with pytest.raises(TypeError, match="missing argument 'BLOCK'"):
        fl.full_arguments(jit, (x, y, 5, 1e-6, 7), {})


def test_second_launch_is_fast_and_passes_what_run_would(gpu_like):
    fn = FakeJIT()
    x, y = torch.zeros(8), torch.zeros(8)
    for _ in range(3):
        fl.launch(fn, (4, 2), x, y, 8, 1e-6, 3, BLOCK=64, MODE=1, num_warps=4)
    kinds = [e[0] for e in fn.log]
    assert kinds == ["slow", "fast", "fast"], kinds
    slow, fast = fn.log[0], fn.log[1]
    assert fast[1] == slow[1] == (4, 2, 1)
    assert fast[2] == slow[2], f"fast launch args {fast[2]} differ from run's {slow[2]}"
    assert fl.stats() == {"fast": 2, "slow": 1}


@pytest.mark.parametrize("change", ["dtype", "alignment", "int", "constexpr", "option", "grid"])
def test_any_specialising_change_takes_the_slow_path(gpu_like, change):
    fn = FakeJIT()
    x, y = torch.zeros(64), torch.zeros(64)
    base = dict(args=(x, y, 8, 1e-6, 16), kw=dict(BLOCK=64, num_warps=4), grid=(4,))
    fl.launch(fn, base["grid"], *base["args"], **base["kw"])
    args, kw, grid = list(base["args"]), dict(base["kw"]), base["grid"]
    if change == "dtype":
        args[0] = x.double()
    elif change == "alignment":
        args[0] = x[1:]  # 4 bytes off a 16-byte boundary
    elif change == "int":
        args[4] = 17  # Triton specialises ints on % 16
    elif change == "constexpr":
        kw["BLOCK"] = 128
    elif change == "option":
        kw["num_warps"] = 8
    else:
        grid = (5,)
    fl.launch(fn, grid, *args, **kw)
    assert [e[0] for e in fn.log] == ["slow", "slow"]
    fl.launch(fn, grid, *args, **kw)  # now known
    assert fn.log[-1][0] == "fast" and fn.log[-1][2] == fn.log[-2][2]


def test_hooks_interpreter_switch_and_odd_grids_take_the_slow_path(gpu_like, monkeypatch):
    from triton import knobs

    fn = FakeJIT()
    x = torch.zeros(4)
    call = lambda grid=(1,): fl.launch(fn, grid, x, x, 1, 1.0, 0, BLOCK=4)  # noqa: E731
    call()
    chain = knobs.runtime.launch_enter_hook  # an empty HookChain in Triton 3.6: no hook
    assert not fl._hooks_set()
    hook = lambda *a: None  # noqa: E731
    chain.add(hook)
    try:
        call()
    finally:
        chain.remove(hook)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", hook)  # a bare callable counts too
    call()
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    monkeypatch.setattr(fl, "_enabled", lambda: False)
    call()
    monkeypatch.setattr(fl, "_enabled", lambda: True)
    call(grid=[1])  # a list: not the tuple the cache was filled with
    call(grid=lambda meta: (1,))
    assert [e[0] for e in fn.log] == ["slow"] * 6
    assert fl.stats() == {"fast": 0, "slow": 6}  # every path through kernel[grid] is counted
    call()
    assert fn.log[-1][0] == "fast"


def test_unhashable_argument_and_other_device(gpu_like, monkeypatch):
    fn = FakeJIT()
    x = torch.zeros(4)
    fl.launch(fn, (1,), x, x, [1, 2], 1.0, 0, BLOCK=4)
    fl.launch(fn, (1,), x, x, [1, 2], 1.0, 0, BLOCK=4)
    assert [e[0] for e in fn.log] == ["slow", "slow"]
    fl.launch(fn, (1,), x, x, 3, 1.0, 0, BLOCK=4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    fl.launch(fn, (1,), x, x, 3, 1.0, 0, BLOCK=4)  # compiled and loaded for device 0
    assert [e[0] for e in fn.log] == ["slow"] * 4


def test_disabled_by_default_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not fl._enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("DITFUSE_FAST_LAUNCH", "0")
    assert not fl._enabled()
    monkeypatch.setenv("DITFUSE_FAST_LAUNCH", "1")
    assert fl._enabled()


def test_wrapper_without_signature_is_always_launched_through(gpu_like):
    """A stand-in for a kernel (tests/support/launch_count.py's Counting) has no signature: every
    launch goes through its [grid], so it sees (and counts) each one."""
    from collections import Counter

    from tests.support.launch_count import Counting

    counts: Counter = Counter()
    fn = FakeJIT()
    wrapped = Counting(fn, "k", counts)
    x = torch.zeros(4)
    for _ in range(3):
        fl.launch(wrapped, (1,), x, x, 1, 1.0, 0, BLOCK=4)
    assert counts["k"] == 3 and [e[0] for e in fn.log] == ["slow"] * 3


@pytest.mark.interpret
@pytest.mark.parametrize("family,layers", [("sd3", (2,)), ("flux", (2, 2)), ("qwenimage", (2,)), ("zimage", (2, 1))])
def test_launch_keys_are_stable_across_steps(monkeypatch, family, layers):
    """A real step's launches (every family's fused ops, Triton interpreted): the second and third
    steps make no launch key the first did not, so on a GPU every launch after the first step
    takes the fast path (a scalar that changed per call would send each launch down Triton's
    path and grow the cache)."""
    import collections
    import sys

    import ditfuse
    from ditfuse.models import families

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("DITFUSE_VERIFY", "off")
    keys: dict = collections.defaultdict(set)

    def recording_launch(fn, grid, *args, **kw):
        # the interpreter's kernels have no signature (launch() would not key them): key here
        k = fl._key(grid, args, kw)
        keys[k is None].add(k)
        return fn[grid](*args, **kw)

    fam = families.get(family)
    torch.manual_seed(0)
    m = fam.load_class()(**fam.config("tiny", layers)).to(torch.bfloat16).eval().requires_grad_(False)
    inp = fam.make_inputs(m, 1, "64x48", device="cpu", dtype=torch.bfloat16, txt_tokens=7)
    handle = ditfuse.accelerate(m)
    try:
        with torch.no_grad():
            m(**inp)  # first step: every kernel module the step uses is imported by now
        real = fl.launch
        for mod in list(sys.modules.values()):
            if (getattr(mod, "__name__", "").startswith("ditfuse.kernels") and mod is not fl
                    and getattr(mod, "launch", None) is real):
                monkeypatch.setattr(mod, "launch", recording_launch)
        counts = []
        for _ in range(3):
            with torch.no_grad():
                m(**inp)
            counts.append(len(keys[False]))
    finally:
        handle.unmount()
    assert not keys[True], "a launch could not be keyed"
    assert counts[0] > 0 and counts[0] == counts[1] == counts[2], f"{family}: distinct launch keys per step {counts}"


def test_tensor_passed_by_keyword_is_never_cached(gpu_like):
    fn = FakeJIT()
    x = torch.zeros(4)
    for _ in range(2):
        fl.launch(fn, (1,), x, n=1, eps=1.0, s0=0, BLOCK=4, y_ptr=x)
    assert [e[0] for e in fn.log] == ["slow", "slow"]


def test_equal_scalars_of_other_types_are_other_keys(gpu_like):
    """1, True and 1.0 are one dict key, but Triton specialises them apart (i32 == 1, i1, fp32)."""
    fn = FakeJIT()
    x = torch.zeros(4)
    for s0 in (1, True, 1.0, 1, True, 1.0):
        fl.launch(fn, (1,), x, x, 3, 0.5, s0, BLOCK=4)
    assert [e[0] for e in fn.log] == ["slow"] * 3 + ["fast"] * 3
    assert [type(e[2][4]) for e in fn.log] == [int, bool, float] * 2
