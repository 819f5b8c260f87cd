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
