"""Build llama.cpp's ``llama-server`` and ``llama-batched-bench`` from llama-cpp-python's source.

``bench/engine.py`` compares the embedded engine with llama.cpp's own server
built from the very llama.cpp that the installed llama-cpp-python vendors:
its sdist is fetched with pip (``--no-binary :all: --no-deps``), its
``vendor/llama.cpp`` configured with the flags the project builds the wheel
with (``-DGGML_NATIVE=OFF``) and without anything that would reach the
network at build time, and the two targets built. The binaries are cached in
``~/.cache/batchyard/llama.cpp-<version>/bin`` (``$XDG_CACHE_HOME`` if set),
with ``build.json`` recording how long the first build took; later runs reuse
them. Standard library only, so it runs before any environment exists:

    python3 bench/llama_build.py [--version 0.3.36] [--jobs 2] [--rebuild]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

DISTRIBUTION = "llama-cpp-python"

# Options passed only where the vendored CMakeLists declares them (they change
# between llama.cpp versions): no network at build time, no TLS, no web UI,
# static binaries that do not depend on the build folder's libraries.
CMAKE_OPTIONS = {
    "GGML_NATIVE": "OFF",
    "LLAMA_CURL": "OFF",
    "LLAMA_OPENSSL": "OFF",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",
    "LLAMA_BUILD_WEBUI": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_SERVER": "ON",
    "BUILD_SHARED_LIBS": "OFF",
}
TARGETS_BUILT = ("llama-server", "llama-batched-bench")


# -- the build --------------------------------------------------------------------


def cache_dir(version: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "batchyard" / f"llama.cpp-{version}"


@dataclass(frozen=True)
class Build:
    version: str
    folder: Path
    seconds: float
    fresh: bool

    def binary(self, name: str) -> Path:
        return self.folder / "bin" / name


def _cmake_flags(source: Path) -> list[str]:
    """The options of ``CMAKE_OPTIONS`` this llama.cpp declares (an unknown one is noise)."""
    declared = ""
    for sub in ("CMakeLists.txt", "ggml/CMakeLists.txt", "tools/ui/CMakeLists.txt"):
        path = source / sub
        if path.is_file():
            declared += path.read_text()
    flags = ["-DCMAKE_BUILD_TYPE=Release"]
    for name, value in CMAKE_OPTIONS.items():
        if re.search(rf"option\(\s*{name}\b", declared):
            flags.append(f"-D{name}={value}")
    return flags


def build_llama_cpp(version: str, jobs: int, rebuild: bool) -> Build:
    """The two binaries of llama.cpp ``version`` (llama-cpp-python's), built once and kept."""
    folder = cache_dir(version)
    record = folder / "build.json"
    binaries = [folder / "bin" / t for t in TARGETS_BUILT]
    if not rebuild and record.is_file() and all(b.is_file() for b in binaries):
        data = json.loads(record.read_text())
        return Build(version, folder, float(data["build_seconds"]), fresh=False)
    if rebuild:
        shutil.rmtree(folder / "build", ignore_errors=True)
    # Otherwise a build cut off (Ctrl-C, a lost session) resumes where it stopped.
    folder.mkdir(parents=True, exist_ok=True)
    sdist_folder = folder / "sdist"
    sdists = sorted(sdist_folder.glob("*.tar.gz")) if sdist_folder.is_dir() else []
    started = time.monotonic()
    if not sdists:
        print(f"downloading the {DISTRIBUTION}=={version} sdist (its vendored llama.cpp)")
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", "-q", "--no-deps"),
                *("--no-binary", ":all:", "-d", str(sdist_folder), f"{DISTRIBUTION}=={version}"),
            ],
            check=True,
        )
        sdists = sorted(sdist_folder.glob("*.tar.gz"))
    download_s = time.monotonic() - started
    source = folder / "src"
    if not (source / "CMakeLists.txt").is_file():
        shutil.rmtree(source, ignore_errors=True)
        with tarfile.open(sdists[0]) as tar:
            top = tar.getnames()[0].split("/")[0]
            prefix = f"{top}/vendor/llama.cpp/"
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix) :]
            tar.extractall(source, members=[m for m in members if m.name], filter="data")
    flags = _cmake_flags(source)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    print(
        f"building llama.cpp {version} ({' '.join(TARGETS_BUILT)}) with -j{jobs}: "
        + " ".join(flags)
    )
    log = folder / "build.log"
    built = time.monotonic()
    with log.open("a") as out:
        for cmd in (
            ["cmake", "-S", str(source), "-B", str(folder / "build"), *generator, *flags],
            [
                *("cmake", "--build", str(folder / "build"), "--config", "Release"),
                *("--target", *TARGETS_BUILT, "-j", str(jobs)),
            ],
        ):
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
            if done.returncode != 0:
                raise SystemExit(f"the llama.cpp build failed (exit {done.returncode}); see {log}")
    build_s = time.monotonic() - built
    (folder / "bin").mkdir(exist_ok=True)
    for target in TARGETS_BUILT:
        found = next((p for p in (folder / "build").rglob(target) if p.is_file()), None)
        if found is None:
            raise SystemExit(f"the llama.cpp build made no {target}; see {log}")
        shutil.copy2(found, folder / "bin" / target)
    record.write_text(
        json.dumps(
            {
                "version": version,
                "build_seconds": round(build_s, 1),
                "download_seconds": round(download_s, 1),
                "jobs": jobs,
                "cmake_flags": flags,
                "cores": len(os.sched_getaffinity(0)),
            },
            indent=2,
        )
    )
    # The build tree is large and no longer needed; the sdist stays for a rebuild.
    shutil.rmtree(folder / "build", ignore_errors=True)
    return Build(version, folder, build_s, fresh=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--version", default=None, help="default: the installed llama-cpp-python")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--rebuild", action="store_true")
    args = ap.parse_args()
    version = args.version or importlib.metadata.version(DISTRIBUTION)
    build = build_llama_cpp(version, args.jobs, args.rebuild)
    how = "built now" if build.fresh else "cached"
    print(
        f"llama.cpp {version} ({how}; the build took {build.seconds / 60:.1f} min): {build.folder}"
    )


if __name__ == "__main__":
    main()
