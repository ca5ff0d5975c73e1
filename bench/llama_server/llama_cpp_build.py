"""llama.cpp's ``llama-server`` and ``llama-quantize``, built from the llama.cpp vendored in the
llama-cpp-python sdist, for the benchmarks that compare baton with it (nothing in the engine
needs them); and its ``convert_hf_to_gguf.py``, which the architecture tests run on tiny
Hugging Face folders (``convert_hf``: only the converter's files are unpacked, nothing built).

The recipe, which this module runs
(``python -m baton.bench.llama_server.llama_cpp_build [--dest DIR]``):

1. ``pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36`` and unpack it;
2. configure ``vendor/llama.cpp`` with CMake + Ninja: ``-DGGML_NATIVE=OFF
   -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DLLAMA_CURL=OFF``: one build whose CPU
   kernels are shared libraries, one per instruction-set variant, of which llama.cpp loads the
   best one the CPU at hand runs. A native build (``-march=native``) is not portable: the
   machines that run the benchmarks differ (AVX2-only AMD EPYC, AVX-512 Intel Xeon and AMD
   EPYC), and AVX-512 code dies with SIGILL on the first;
3. of those variants, build only ``VARIANTS`` (the vendored CMakeLists.txt is patched to drop
   the others; the full list compiles the kernels 14 times, about 40 minutes on 2 cores).
   ``sapphirerapids`` (AMX) is left out on purpose: on the Intel machines that advertise AMX,
   AMX builds died with SIGILL, and without it llama.cpp picks the best AVX-512 variant there;
4. build the targets ``llama-server llama-quantize`` and the kept variants.

Which variant a server loaded is in its log (``load_backend: loaded CPU backend from ...``);
``loaded_variant`` reads it, and the benchmarks record it beside the CPU they ran on.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
# x64: any x86-64; haswell: AVX2+FMA (AVX2-only EPYC); skylakex, icelake: AVX-512 Xeons
# (icelake adds VNNI and VBMI); zen4: AVX-512 with BF16 (EPYC Genoa, Xeons with AVX512_BF16).
VARIANTS = ("x64", "haswell", "skylakex", "icelake", "zen4")
TARGETS = ("llama-server", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_BACKEND_DL=ON",
    "-DGGML_CPU_ALL_VARIANTS=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)
DEFAULT_DEST = Path.home() / ".cache" / "baton" / f"llama-cpp-{LLAMA_CPP_PYTHON}"
_VARIANT_LINE = re.compile(r"^(\s*)ggml_add_cpu_backend_variant\((\w[\w.]*)\b", re.MULTILINE)


@dataclass(frozen=True)
class LlamaCppBuild:
    """Where a finished build's programs are (its CPU variant libraries lie beside them)."""

    source: Path
    bin_dir: Path

    @property
    def server(self) -> Path:
        return self.bin_dir / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.bin_dir / "llama-quantize"

    @property
    def convert_script(self) -> Path:
        """The vendored ``convert_hf_to_gguf.py``."""
        return self.source / "convert_hf_to_gguf.py"

    def complete(self) -> bool:
        """Whether both programs and at least one CPU variant library exist."""
        libs = list(self.bin_dir.glob("libggml-cpu-*.so"))
        return self.server.is_file() and self.quantize.is_file() and bool(libs)

    def one_variant(self, variant: str) -> Path:
        """A ``llama-server``, in a folder beside the build's, that can load only the CPU
        variant ``variant`` (say ``haswell``: AVX2 kernels on an AVX-512 machine, as on an
        AVX2-only CPU). llama.cpp looks for its variants beside the running program (the
        resolved path), so the program is copied there, beside links to the build's libraries
        less the other variants.

        Side effects: replaces that folder's contents.

        Raises:
            ValueError: this build has no library for ``variant`` (names the ones it has).
        """
        lib = self.bin_dir / f"libggml-cpu-{variant}.so"
        if not lib.is_file():
            have = sorted(
                p.name[len("libggml-cpu-") : -3] for p in self.bin_dir.glob("libggml-cpu-*.so")
            )
            raise ValueError(
                f"llama.cpp variant {variant!r} is not built; built: {', '.join(have)}"
            )
        dest = self.bin_dir.parent / f"bin-only-{variant}"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        shutil.copy2(self.server, dest / self.server.name)
        for path in self.bin_dir.glob("*.so*"):
            if not path.name.startswith("libggml-cpu-") or path == lib:
                (dest / path.name).symlink_to(path)
        return dest / self.server.name


def keep_variants(cmakelists: str, keep: tuple[str, ...] = VARIANTS) -> str:
    """``ggml/src/CMakeLists.txt`` with every x86 CPU variant not in ``keep`` commented out.

    Raises:
        ValueError: a kept variant is not in the file (another llama.cpp version).
    """
    found: set[str] = set()

    def edit(match: re.Match[str]) -> str:
        indent, name = match.group(1), match.group(2)
        found.add(name)
        return match.group(0) if name in keep else f"{indent}# (baton: not built) {name}"

    # Only the x86 block: the ARM and other variants are never built on x86 anyway.
    start = cmakelists.index(
        'GGML_SYSTEM_ARCH STREQUAL "x86"', cmakelists.index("if (GGML_CPU_ALL_VARIANTS)")
    )
    end = cmakelists.index("elseif", start)
    block = _VARIANT_LINE.sub(edit, cmakelists[start:end])
    missing = sorted(set(keep) - found)
    if missing:
        raise ValueError(f"CPU variants {missing} are not in this llama.cpp's CMakeLists.txt")
    return cmakelists[:start] + block + cmakelists[end:]


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def build(dest: Path = DEFAULT_DEST, jobs: int = 2) -> LlamaCppBuild:
    """Downloads, patches and builds llama.cpp under ``dest`` (nothing is redone that is
    already there); returns the build.

    Raises:
        subprocess.CalledProcessError: pip, cmake or the compiler failed (their output is on
            the terminal).
        RuntimeError: cmake or ninja is missing.
    """
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs {tool} on PATH")
    dest.mkdir(parents=True, exist_ok=True)
    source = dest / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    result = LlamaCppBuild(source, dest / "build" / "bin")
    if result.complete():
        return result
    if not source.is_dir():
        with tarfile.open(_sdist(dest)) as tar:
            tar.extractall(dest, filter="data")
    lists = source / "ggml" / "src" / "CMakeLists.txt"
    lists.write_text(keep_variants(lists.read_text()))
    _run(["cmake", "-S", str(source), "-B", str(dest / "build"), "-G", "Ninja", *CMAKE_FLAGS])
    targets = [*TARGETS, *(f"ggml-cpu-{v}" for v in VARIANTS)]
    _run(["cmake", "--build", str(dest / "build"), "-j", str(jobs), "--target", *targets])
    if not result.complete():
        raise RuntimeError(f"the build finished but {result.bin_dir} lacks its programs")
    return result


# What convert_hf_to_gguf.py needs of the vendored tree (it imports conversion/ and gguf-py/).
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def _sdist(dest: Path) -> Path:
    """The llama-cpp-python sdist under ``dest``, downloaded when missing."""
    sdist = dest / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        dest.mkdir(parents=True, exist_ok=True)
        _run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
            + [f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(dest)]
        )
    return sdist


def converter(dest: Path = DEFAULT_DEST) -> Path:
    """The vendored ``convert_hf_to_gguf.py``: from a full unpacked source when one is there,
    else from the sdist (downloaded when missing), of which only the converter's files are
    unpacked, into a folder of their own (renamed into place whole, so that concurrent callers
    never see half of it).

    Raises:
        subprocess.CalledProcessError: pip could not download the sdist.
    """
    full = dest / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (full / "convert_hf_to_gguf.py").is_file() and (full / "gguf-py").is_dir():
        return full / "convert_hf_to_gguf.py"
    target = dest / f"converter-{LLAMA_CPP_PYTHON}"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target / "convert_hf_to_gguf.py"
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    staging = Path(tempfile.mkdtemp(prefix="converter-", dir=dest if dest.is_dir() else None))
    with tarfile.open(_sdist(dest)) as tar:
        members = []
        for member in tar.getmembers():
            rest = member.name[len(prefix) :] if member.name.startswith(prefix) else ""
            if any(rest == p or (p.endswith("/") and rest.startswith(p)) for p in _CONVERTER_PARTS):
                member.name = rest
                members.append(member)
        tar.extractall(staging, members=members, filter="data")
    try:
        staging.rename(target)
    except OSError:  # another caller put it there first
        shutil.rmtree(staging, ignore_errors=True)
    return target / "convert_hf_to_gguf.py"


def convert_hf(folder: Path, out: Path, outtype: str = "f32", dest: Path = DEFAULT_DEST) -> Path:
    """``folder`` (a Hugging Face model folder) written to ``out`` as GGUF by llama.cpp's
    converter, tensors as ``outtype`` (f32, f16, bf16, q8_0); returns ``out``. Runs the
    converter in a subprocess with its own ``gguf-py`` first on the path (it needs torch,
    numpy, transformers and sentencepiece).

    Raises:
        subprocess.CalledProcessError: the download or the converter failed; the converter's
            output is in the error's ``stderr``.
    """
    script = converter(dest)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(script.parent / "gguf-py"), *filter(None, [env.get("PYTHONPATH")])]
    )
    cmd = [sys.executable, str(script), str(folder), "--outfile", str(out), "--outtype", outtype]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return out


def loaded_variant(server_log: str) -> str | None:
    """The CPU variant a llama.cpp program loaded, from its log (e.g. ``zen4``), or None."""
    match = re.search(r"loaded CPU backend from \S*libggml-cpu-([\w.]+)\.so", server_log)
    return match.group(1) if match else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"default: {DEFAULT_DEST}")
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args(argv)
    done = build(a.dest, a.jobs)
    print(f"llama-server: {done.server}\nllama-quantize: {done.quantize}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
