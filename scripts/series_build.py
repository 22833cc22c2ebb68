"""The wheel builds behind `scripts/series.py build mlx|mlx-lm` (import it from there, not on its own).

MLX: the CPU backend and the Python bindings of the applied mlx/ tree, offline, linked with OpenBLAS,
versioned <tag>+<MLX_LOCAL_VERSION>. Every dependency MLX's CMake would download comes from the machine
(Debian packages, pip's nanobind) or from the offline copy of gguflib; ccache (when installed) keeps
its cache in the user's cache folder with paths relative to this checkout, so another clone reuses it.
mlx-lm: the applied mlx-lm/ tree as a pure-Python wheel, versioned <release>+h2o.<revision>.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

from series import BUILD, ROOT, SeriesError, git, say, vendor_copy

# Debian packages the MLX build needs (checked before anything runs).
MLX_DEBIAN_PACKAGES = ("g++", "make", "nlohmann-json3-dev", "libfmt-dev", "libopenblas-dev", "liblapack-dev",
                       "liblapacke-dev")
MLX_BUILD_TOOLS = ("setuptools>=80", "cmake>=3.27", "typing_extensions", "wheel")


def _missing_debian_packages() -> list[str]:
    if shutil.which("dpkg-query") is None:
        return []
    missing = []
    for pkg in MLX_DEBIAN_PACKAGES:
        r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
        if "install ok installed" not in r.stdout:
            missing.append(pkg)
    return missing


def _check_build_tools(nanobind: str) -> None:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    bad = []
    for req in map(Requirement, (*MLX_BUILD_TOOLS, nanobind)):
        try:
            found = version(req.name)
        except PackageNotFoundError:
            bad.append(f"{req} (not installed)")
            continue
        if not req.specifier.contains(found, prereleases=True):
            bad.append(f"{req} (found {found})")
    if bad:
        quoted = " ".join(f"'{r}'" for r in (*MLX_BUILD_TOOLS, nanobind))
        raise SeriesError(f"the build tools are missing from {sys.executable}'s environment: {', '.join(bad)}\n"
                          f"  install them with: {sys.executable} -m pip install {quoted}")


def _gguflib(s, deps: Path) -> Path:
    """gguflib at the commit MLX pins, unpacked where FETCHCONTENT_SOURCE_DIR_GGUFLIB points."""
    commit = s.pin["GGUFLIB_COMMIT"]
    pinned = re.search(r"gguflib.*?GIT_TAG\s+([0-9a-f]{40})", (s.tree / "mlx/io/CMakeLists.txt").read_text(), re.S)
    if not pinned or pinned.group(1) != commit:
        raise SeriesError(f"mlx/mlx/io/CMakeLists.txt pins gguflib {pinned and pinned.group(1)}, pin.env says {commit}")
    out = deps / "gguflib"
    if (deps / "gguflib.commit").is_file() and (deps / "gguflib.commit").read_text() == commit:
        return out
    source = os.environ.get("MLX_GGUF_SRC") or vendor_copy("gguf-tools.git")
    if source is None:
        source = BUILD / "vendor" / "gguf-tools"
        if not (source / ".git").is_dir():
            say("cloning gguflib from GitHub (no offline copy found)")
            subprocess.run(["git", "clone", "--quiet", "https://github.com/antirez/gguf-tools.git", str(source)], check=True)
    source = Path(source)
    if subprocess.run(["git", "-C", str(source), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True).returncode:
        raise SeriesError(f"{source} has no commit {commit} (a clone of antirez/gguf-tools?)")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(source), "archive", commit], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(out)
    (deps / "gguflib.commit").write_text(commit)
    return out


def _run_with_progress(cmd: list[str], cwd: Path, env: dict, log: Path, what: str) -> None:
    """Run cmd with its output in log, printing each new CMake percentage (and what it compiles) with
    the elapsed time, so a half-hour build is never silent."""
    start, last = time.time(), None
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            f.write(line)
            m = re.search(r"\[\s*(\d+)%\]\s+(Building \S+ object|Linking \S+ \S+ library|Linking \S+ shared module)\s+(\S+)", line)
            if m and m.group(1) != last:
                last = m.group(1)
                target = re.sub(r"^.*CMakeFiles/[^/]+\.dir/", "", m.group(3)).removesuffix(".o")
                print(f"  {what}: [{last:>3}%] {target} ({(time.time() - start) / 60:.1f} min)", flush=True)
        if proc.wait() != 0:
            tail = log.read_text().splitlines()[-40:]
            raise SeriesError(f"the {what} build failed (full log: {log}); its last lines:\n" + "\n".join(tail))


def build_mlx(s, dist: Path) -> Path:
    missing = _missing_debian_packages()
    if missing:
        raise SeriesError(f"missing Debian packages: {' '.join(missing)}\n"
                          f"  install them with: apt-get install -y {' '.join(missing)} ccache   (ccache: optional)")
    _check_build_tools(s.pin["NANOBIND_REQUIREMENT"])
    deps = s.tree / "build" / "h2o-deps"
    (deps / "json" / "single_include").mkdir(parents=True, exist_ok=True)
    link = deps / "json" / "single_include" / "nlohmann"  # MLX includes <json.hpp> from there: Debian's tree has it
    if not link.is_symlink():
        link.symlink_to("/usr/include/nlohmann")
    nanobind_dir = subprocess.run([sys.executable, "-m", "nanobind", "--cmake_dir"], check=True, capture_output=True,
                                  text=True).stdout.strip()
    cmake_args = [
        "-DMLX_BUILD_METAL=OFF", "-DMLX_BUILD_CUDA=OFF", "-DMLX_BUILD_CPU=ON",
        "-DUSE_SYSTEM_FMT=ON", "-DBLA_VENDOR=OpenBLAS",  # OpenBLAS, not the reference BLAS, for every float matmul
        "-DFETCHCONTENT_FULLY_DISCONNECTED=ON", "-DFETCHCONTENT_TRY_FIND_PACKAGE_MODE=ALWAYS",
        f"-DFETCHCONTENT_SOURCE_DIR_JSON={deps / 'json'}", f"-Dnanobind_DIR={nanobind_dir}",
        "-DMLX_BUILD_GGUF=ON", f"-DFETCHCONTENT_SOURCE_DIR_GGUFLIB={_gguflib(s, deps)}",
    ]
    ccache = shutil.which("ccache")
    if ccache:
        # MLX's own ccache setup hashes absolute paths (its setup.py sets CCACHE_BASEDIR to the build
        # folder): relative to this checkout instead, so a fresh clone elsewhere hits the same cache.
        cache_dir = os.environ.get("CCACHE_DIR", str(Path.home() / ".cache" / "ccache"))
        cmake_args += ["-DMLX_USE_CCACHE=OFF",
                       f"-DCMAKE_CXX_COMPILER_LAUNCHER=env;CCACHE_BASEDIR={ROOT};CCACHE_NOHASHDIR=true;"
                       f"CCACHE_DIR={cache_dir};{ccache}"]
    else:
        say("ccache not found: every build compiles from scratch (apt-get install ccache)")
    version_h = (s.tree / "mlx/version.h").read_text()
    tag_version = ".".join(re.search(rf"#define MLX_VERSION_{k} (\d+)", version_h).group(1) for k in ("MAJOR", "MINOR", "PATCH"))
    version = f"{tag_version}+{s.pin['MLX_LOCAL_VERSION']}"
    cfg = s.tree / "build" / "h2o-setup.cfg"  # setuptools' egg_info.tag_build: the local label, no MLX file edited
    cfg.write_text(f"[egg_info]\ntag_build = +{s.pin['MLX_LOCAL_VERSION']}\n")
    jobs = os.environ.get("JOBS", str(os.cpu_count() or 2))
    env = {**os.environ, "PYPI_RELEASE": "1", "DEV_RELEASE": "0", "DIST_EXTRA_CONFIG": str(cfg),
           "CMAKE_BUILD_PARALLEL_LEVEL": jobs, "CMAKE_ARGS": " ".join(cmake_args)}
    for old in dist.glob("mlx-*+h2o.*.whl"):  # earlier revisions of the series too
        old.unlink()
    log = s.tree / "build" / "h2o-build.log"
    say(f"building mlx {version} (CPU backend + Python bindings, OpenBLAS, GGUF) with -j{jobs}; "
        f"cold: about 10 min on 2 cores, with a warm ccache about 1 min; log: {log.relative_to(ROOT)}")
    start = time.time()
    _run_with_progress([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-v",
                        "-w", str(dist), "."], s.tree, env, log, "mlx")
    wheels = sorted(dist.glob(f"mlx-{version}-*.whl"))
    if not wheels:
        raise SeriesError(f"pip reported success but left no mlx-{version} wheel in {dist}")
    say(f"built {wheels[-1].relative_to(ROOT) if wheels[-1].is_relative_to(ROOT) else wheels[-1]} "
        f"({s.describe_base()} + {len(s.patches())} patches = {git(s.tree, 'rev-parse', '--short', 'HEAD')}) "
        f"in {time.time() - start:.0f} s")
    return wheels[-1]


def build_mlx_lm(s, dist: Path) -> Path:
    version = f"{s.pin['MLX_LM_VERSION']}+h2o.{s.pin['MLX_LM_SERIES_REVISION']}"
    for old in dist.glob("mlx_lm-*.whl"):
        old.unlink()
    # setuptools-scm writes mlx_lm/_version.py from this: mlx_lm.__version__ names the series.
    env = {**os.environ, "SETUPTOOLS_SCM_PRETEND_VERSION": version}
    say(f"building mlx_lm {version} (pure Python, about 30 s)")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dist), str(s.tree)],
                   check=True, env=env)
    wheel = dist / f"mlx_lm-{version}-py3-none-any.whl"
    if not wheel.is_file():
        raise SeriesError(f"expected {wheel}; found {sorted(p.name for p in dist.glob('mlx_lm-*'))}")
    text = zipfile.ZipFile(wheel).read("mlx_lm/_version.py").decode()
    if repr(version) not in text:
        raise SeriesError(f"{wheel} says {text.strip()!r}, expected __version__ = {version!r}")
    say(f"built {wheel.name}")
    return wheel
