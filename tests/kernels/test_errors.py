"""kernels.errors.env_choice: every KVCHAT_* choice is read through it (the CLI's exit-2 line for a
bad value is tested per variable in tests/cli/test_run.py)."""
import pytest

from kernels.errors import BadInputError, env_choice


def test_env_choice_defaults_trims_lowers_and_refuses(monkeypatch):
    monkeypatch.delenv("KVCHAT_TEST_CHOICE", raising=False)
    assert env_choice("KVCHAT_TEST_CHOICE", ("auto", "on"), "auto") == "auto"
    monkeypatch.setenv("KVCHAT_TEST_CHOICE", "  ")
    assert env_choice("KVCHAT_TEST_CHOICE", ("auto", "on"), "auto") == "auto"
    monkeypatch.setenv("KVCHAT_TEST_CHOICE", " On\n")
    assert env_choice("KVCHAT_TEST_CHOICE", ("auto", "on"), "auto") == "on"
    monkeypatch.setenv("KVCHAT_TEST_CHOICE", "of")
    with pytest.raises(BadInputError, match=r"^KVCHAT_TEST_CHOICE='of' is not one of auto, on$"):
        env_choice("KVCHAT_TEST_CHOICE", ("auto", "on"), "auto")

