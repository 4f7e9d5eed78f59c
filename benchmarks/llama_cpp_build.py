"""Build llama.cpp's server from the ``llama-cpp-python`` source distribution's vendored tree.

A benchmark step, never a test or CI step: about 13 minutes on two cores. The build is cached
under ``~/.cache/ifb/llama.cpp/<version>/`` (``IFB_LLAMA_CPP_CACHE`` moves it), so a second run
starts at once. The version is pinned so that every run of ``vs_llama_cpp.py`` measures the same
llama.cpp; ``--version`` picks another.

    python benchmarks/llama_cpp_build.py            # prints the path of llama-server
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

#: llama-cpp-python's release whose vendored llama.cpp is measured
DEFAULT_VERSION = "0.3.36"


def cache_dir(version: str) -> Path:
    root = os.environ.get("IFB_LLAMA_CPP_CACHE") or Path.home() / ".cache" / "ifb" / "llama.cpp"
    return Path(root) / version


def server_path(version: str = DEFAULT_VERSION) -> Path:
    return cache_dir(version) / "build" / "bin" / "llama-server"


def _download_sdist(version: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "--disable-pip-version-check", "-q", "-d", str(into),
                    f"llama-cpp-python=={version}"], check=True)
    (sdist,) = into.glob("llama_cpp_python-*.tar.gz")
    return sdist


def build(version: str = DEFAULT_VERSION, jobs: int | None = None, sdist: Path | None = None) -> Path:
    """The path of a built ``llama-server``; builds it first when the cache has none."""
    binary = server_path(version)
    if binary.exists():
        return binary
    root = cache_dir(version)
    root.mkdir(parents=True, exist_ok=True)
    source = root / "src"
    if not (source / "CMakeLists.txt").exists():
        with tempfile.TemporaryDirectory() as tmp:
            archive = sdist or _download_sdist(version, Path(tmp))
            with tarfile.open(archive) as tar:
                top = tar.getnames()[0].split("/")[0]
                prefix = f"{top}/vendor/llama.cpp/"
                members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
                for member in members:
                    member.name = member.name[len(prefix):]
                shutil.rmtree(source, ignore_errors=True)
                tar.extractall(source, members=[m for m in members if m.name], filter="data")
    build_dir = root / "build"
    # GGML_NATIVE: the build uses every instruction set this CPU has (AVX-512 VNNI, AMX here), as
    # ifb's kernels do; no curl, tests or examples: only the server is measured.
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server",
                    "-j", str(jobs or os.cpu_count() or 1)], check=True)
    if not binary.exists():
        raise RuntimeError(f"the build finished without {binary}")
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=DEFAULT_VERSION, help="llama-cpp-python release")
    parser.add_argument("--sdist", type=Path, help="a downloaded source distribution to build from")
    parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: every core)")
    args = parser.parse_args()
    print(build(args.version, args.jobs, args.sdist))


if __name__ == "__main__":
    main()
