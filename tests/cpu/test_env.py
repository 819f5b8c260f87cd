"""ditfuse.kernels.env.env: the per-call environment read must see every change os.environ sees."""

import os

from ditfuse.contracts import bitexact
from ditfuse.kernels.env import env


def test_env_follows_os_environ(monkeypatch):
    monkeypatch.delenv("DITFUSE_TEST_ENV", raising=False)
    assert env("DITFUSE_TEST_ENV", "dflt") == "dflt"
    monkeypatch.setenv("DITFUSE_TEST_ENV", "a,b")
    assert env("DITFUSE_TEST_ENV") == "a,b"
    os.environ["DITFUSE_TEST_ENV"] = "ünïcode"
    assert env("DITFUSE_TEST_ENV") == "ünïcode"
    del os.environ["DITFUSE_TEST_ENV"]
    assert env("DITFUSE_TEST_ENV") == ""
    assert env("DITFUSE_TEST_ENV", "x") == "x"


def test_verify_mode_cache_follows_env(monkeypatch):
    monkeypatch.setenv("DITFUSE_VERIFY", "always")
    assert bitexact.verify_mode() == "always"
    monkeypatch.setenv("DITFUSE_VERIFY", " OFF ")
    assert bitexact.verify_mode() == "off"
    monkeypatch.delenv("DITFUSE_VERIFY")
    assert bitexact.verify_mode() == "first"
    monkeypatch.setenv("DITFUSE_VERIFY", "sometimes")
    try:
        bitexact.verify_mode()
    except ValueError as e:
        assert "sometimes" in str(e)
    else:
        raise AssertionError("a bad DITFUSE_VERIFY must raise")


def test_host_launch_arithmetic_matches_triton():
    """common/host.py cdiv / next_pow2 (plain ints: triton's are ~2 us constexpr_function calls)
    give triton.cdiv / triton.next_power_of_2's values."""
    import triton

    from ditfuse.kernels.common.host import cdiv, next_pow2

    for n in [*range(0, 2100), 2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1, 2**40 + 3]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for b in (1, 2, 3, 7, 128, 1000, 1024):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
