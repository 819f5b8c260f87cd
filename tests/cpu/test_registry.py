import json
import os
import subprocess
import sys

import pytest

from ditfuse.kernels import registry as reg_mod
from ditfuse.kernels.registry import (
    CapabilityError,
    DeviceInfo,
    KernelConfigError,
    KernelDisabledError,
    Registry,
    UnknownOpError,
)
from ditfuse.kernels.spec import Backend, Capability, Contract, KernelSpec


def _spec(op, backend="triton", caps=(Capability("cuda", (8, 0)),), target="math:sqrt"):
    return KernelSpec(op=op, backend=Backend(backend), target=target, capabilities=frozenset(caps),
                      contract=Contract.BIT_EXACT, replaces="x", summary="s")


@pytest.fixture
def reg(monkeypatch):
    r = Registry([
        _spec("norm.a"),
        _spec("norm.a", backend="torch", caps=(Capability("cpu"), Capability("cuda"))),
        _spec("rope.b"),
        _spec("rope.c", caps=(Capability("cuda", (9, 0)), Capability("cpu", interpreter=True))),
    ])
    return r


def _on(monkeypatch, dev: DeviceInfo):
    monkeypatch.setattr(reg_mod, "current_device", lambda device=None: dev)


H200 = DeviceInfo("cuda", (9, 0), "NVIDIA H200")
A100 = DeviceInfo("cuda", (8, 0), "A100")
T4 = DeviceInfo("cuda", (7, 5), "T4")
CPU = DeviceInfo("cpu")
CPU_INTERP = DeviceInfo("cpu", interpreter=True)


def test_spec_validation():
    with pytest.raises(ValueError, match="<domain>.<name>"):
        _spec("nodomain")
    with pytest.raises(ValueError, match="capability"):
        _spec("a.b", caps=())


def test_ops_get_unknown(reg):
    assert reg.ops() == ["norm.a", "rope.b", "rope.c"]
    assert [s.backend for s in reg.get("norm.a")] == [Backend.TRITON, Backend.TORCH]
    with pytest.raises(UnknownOpError, match="unknown op 'nope'.*norm.a"):
        reg.get("nope")


def test_duplicate_registration_rejected(reg):
    with pytest.raises(ValueError, match="registered twice"):
        reg.register(_spec("rope.b"))


def test_select_prefers_triton_and_falls_back_by_capability(reg, monkeypatch):
    _on(monkeypatch, H200)
    assert reg.select("norm.a").backend is Backend.TRITON
    _on(monkeypatch, T4)  # sm_75 < sm_80: triton not usable, torch is
    assert reg.select("norm.a").backend is Backend.TORCH
    _on(monkeypatch, CPU)
    assert reg.select("norm.a").backend is Backend.TORCH


def test_single_spec_capability_checked_and_error_names_need(reg, monkeypatch):
    _on(monkeypatch, A100)
    with pytest.raises(CapabilityError) as e:
        reg.select("rope.c")
    msg = str(e.value)
    assert "rope.c[triton] needs" in msg and "sm_90" in msg and "A100 (sm_80)" in msg
    _on(monkeypatch, CPU)
    with pytest.raises(CapabilityError, match="TRITON_INTERPRET"):
        reg.select("rope.b")
    _on(monkeypatch, CPU_INTERP)
    assert reg.select("rope.c").op == "rope.c"
    _on(monkeypatch, H200)
    assert reg.select("rope.c").op == "rope.c"
    assert reg.available("rope.c") is True


def test_explicit_backend_argument(reg, monkeypatch):
    _on(monkeypatch, H200)
    assert reg.select("norm.a", backend="torch").backend is Backend.TORCH
    with pytest.raises(KernelConfigError, match="has no cuda backend"):
        reg.select("norm.a", backend="cuda")


def test_pin_backend(reg, monkeypatch):
    _on(monkeypatch, H200)
    monkeypatch.setenv("DITFUSE_BACKEND", "norm.a=torch")
    assert reg.select("norm.a").backend is Backend.TORCH
    assert reg.select("rope.b").backend is Backend.TRITON


@pytest.mark.parametrize(
    "value, match",
    [
        ("nope.x=triton", "unknown op 'nope.x'"),
        ("norm.a=vulkan", "unknown backend 'vulkan'"),
        ("rope.b=torch", "has only triton"),
        ("norm.a", "op=backend"),
    ],
)
def test_bad_pins_are_errors_at_first_use(reg, monkeypatch, value, match):
    _on(monkeypatch, H200)
    monkeypatch.setenv("DITFUSE_BACKEND", value)
    with pytest.raises(KernelConfigError, match=match):
        reg.select("rope.b")


@pytest.mark.parametrize(
    "value, disabled",
    [
        ("norm.a", {"norm.a"}),
        ("rope.*", {"rope.b", "rope.c"}),
        ("all", {"norm.a", "rope.b", "rope.c"}),
        (" norm.a , rope.c ", {"norm.a", "rope.c"}),
    ],
)
def test_disable(reg, monkeypatch, value, disabled):
    _on(monkeypatch, H200)
    monkeypatch.setenv("DITFUSE_DISABLE", value)
    for op in reg.ops():
        assert reg.is_disabled(op) is (op in disabled)
        if op in disabled:
            with pytest.raises(KernelDisabledError, match="DITFUSE_DISABLE"):
                reg.select(op)
            assert reg.available(op) is False
        else:
            reg.select(op)


def test_disable_unknown_is_error(reg, monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "norm.a,typo.*")
    with pytest.raises(KernelConfigError, match="'typo.\\*'"):
        reg.is_disabled("norm.a")


def test_env_change_is_seen(reg, monkeypatch):
    _on(monkeypatch, H200)
    assert not reg.is_disabled("norm.a")
    monkeypatch.setenv("DITFUSE_DISABLE", "norm.a")
    assert reg.is_disabled("norm.a")


def test_load_is_lazy_and_resolves(reg):
    import math

    assert reg.get("rope.b")[0].load() is math.sqrt


def test_default_registry_inventory():
    ops = reg_mod.ops()
    assert "norm.layernorm_modulate" in ops and "rope.qk_rmsnorm_rope" in ops
    for s in reg_mod.specs():
        assert s.target.startswith("ditfuse.kernels.")
        assert s.predicate is None or s.predicate.startswith("ditfuse.kernels.")


def test_every_registered_target_and_export_resolves():
    import ditfuse.kernels as k

    for s in reg_mod.specs():
        assert callable(s.load()), s.target
        assert callable(s.load_predicate()), s.predicate
    for name in k._EXPORTS:
        assert getattr(k, name) is not None, name
    with pytest.raises(AttributeError):
        k.does_not_exist


def _fresh(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout


def test_import_ditfuse_imports_no_triton_and_no_kernel_module():
    out = _fresh(
        "import sys, json, ditfuse, ditfuse.kernels, ditfuse.kernels.registry as r\n"
        "ops = r.ops()\n"
        "mods = [m for m in sys.modules if m == 'triton' or m.startswith('triton.') or m.endswith('_triton')]\n"
        "print(json.dumps({'ops': len(ops), 'mods': mods, 'torch': 'torch' in sys.modules}))"
    )
    data = json.loads(out)
    assert data["ops"] >= 6
    assert data["mods"] == []
    # spec/registry are torch-free too
    assert data["torch"] is False


def test_facade_attribute_imports_only_its_kernel():
    out = _fresh(
        "import os; os.environ['TRITON_INTERPRET']='1'\n"
        "import sys, ditfuse.kernels as k\n"
        "f = k.gate_residual\n"
        "print(sorted(m for m in sys.modules if m.endswith('_triton')))"
    )
    assert out.strip() == "['ditfuse.kernels.modulate.gate_residual_triton']"


def test_cli_kernels_json_and_table():
    from ditfuse.runtime.cli import main

    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["kernels", "--json"]) == 0
    rows = json.loads(buf.getvalue())
    assert {r["op"] for r in rows} == set(reg_mod.ops())
    assert all({"op", "backend", "contract"} <= set(r) for r in rows)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["kernels"]) == 0
    table = buf.getvalue()
    assert "norm.layernorm_modulate" in table and "bit_exact" in table and "replaces" in table
