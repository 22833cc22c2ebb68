#!/usr/bin/env python3
"""Regenerate patches/mlx/*.patch so that the CPU kernel inside the series is csrc/'s, byte for byte.

The series has two kinds of content. The glue (the op in mlx/fast.{h,cpp}, the primitive, its
eval_cpu, CMake, the binding, docs, tests) is written by hand in an MLX clone and lives only in the
patches. The kernel is not: the patch that owns MLX_KERNEL_DIR (pin.env) carries a copy of the files
csrc/ builds the kernel from (the include closure of KERNEL_SEEDS) plus a generated CMakeLists.txt
listing their sources. This script rebuilds the series on a scratch work tree of the pinned tag: it
applies each patch without its MLX_KERNEL_DIR files (`git am`, keeping message, author and date),
writes the current csrc/ files into the owning patch's commit, and formats the commits back into
patches/mlx with scripts/regen_mlx_patches.sh. Run it after any change to csrc/'s kernel or to the
glue; tests/test_mlx_patches.py fails while the committed patches differ from csrc/.

Usage: scripts/gen_mlx_patches.py SRC_DIR [--out DIR]
  SRC_DIR  a clone of ml-explore/mlx holding the pinned tag; its own checkout is not touched (the
           work happens in a temporary `git worktree`)
  --out    write the series to DIR instead of patches/mlx (to compare)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERIES_DIR = ROOT / "patches" / "mlx"
CSRC = ROOT / "csrc"

# What the glue (mlx/backend/cpu/scaled_dot_product_attention_with_scores.cpp) uses of csrc/: the
# problem description and kernel entry point, the kernel's translation unit, the thread count.
KERNEL_SEEDS = ("kernels/attention_problem.h", "kernels/attention_cpu.cpp", "parallel.h")

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# `#define MLX_H2O_KERNEL_IMPL "attention_cpu_impl.h"`: a file included through a macro.
_DEFINED_FILE = re.compile(r'^\s*#\s*define\s+\w+\s+"([^"]+\.(?:h|inc))"', re.M)


def read_pin(series_dir: Path = SERIES_DIR) -> dict:
    pin = {}
    for line in (series_dir / "pin.env").read_text().splitlines():
        m = re.match(r"^([A-Z_]+)=(.*)$", line.strip())
        if m:
            pin[m.group(1)] = m.group(2).strip().strip('"')
    return pin


def kernel_closure(csrc: Path = CSRC, seeds=KERNEL_SEEDS) -> list[str]:
    """csrc/-relative paths of the kernel: the seeds, every file they include (quoted includes, also
    through a `#define NAME "file"`), and for each header X.h its X.cpp where one exists. A quoted
    include that is not a file under csrc/ is an error: the kernel must not depend on MLX's headers
    (it is compiled into MLX and into the extension alike)."""
    csrc = csrc.resolve()
    seen: list[str] = []
    todo = list(seeds)
    while todo:
        rel = todo.pop(0)
        if rel in seen:
            continue
        path = csrc / rel
        if not path.is_file():
            raise FileNotFoundError(f"kernel file {rel} is not in {csrc}")
        seen.append(rel)
        text = path.read_text()
        for name in _INCLUDE.findall(text) + _DEFINED_FILE.findall(text):
            target = (path.parent / name).resolve()
            if not target.is_file() or csrc not in target.parents:
                raise ValueError(f"{rel} includes \"{name}\", which is not a file under {csrc} "
                                 "(the kernel sources may include only each other)")
            todo.append(target.relative_to(csrc).as_posix())
        if path.suffix == ".h" and path.with_suffix(".cpp").is_file():
            todo.append(path.with_suffix(".cpp").relative_to(csrc).as_posix())
    return sorted(seen)


def cmake_lists(sources: list[str]) -> str:
    listed = "\n          ".join(f"${{CMAKE_CURRENT_SOURCE_DIR}}/{s}" for s in sources)
    return (
        "# The CPU kernel of fast::ScaledDotProductAttentionWithScores, vendored from mlx-h2o's csrc/\n"
        "# and kept identical to it by mlx-h2o's scripts/gen_mlx_patches.py (which writes this file).\n"
        f"target_sources(\n  mlx\n  PRIVATE {listed})\n"
    )


def vendored_files(csrc: Path = CSRC, pin: dict | None = None) -> dict[str, bytes]:
    """The files the owning patch adds under MLX_KERNEL_DIR: MLX path -> contents."""
    kdir = (pin or read_pin())["MLX_KERNEL_DIR"]
    closure = kernel_closure(csrc)
    files = {f"{kdir}/{rel}": (csrc / rel).read_bytes() for rel in closure}
    files[f"{kdir}/CMakeLists.txt"] = cmake_lists([r for r in closure if r.endswith(".cpp")]).encode()
    return files


def split_patch(text: str) -> tuple[str, list[tuple[str, str]]]:
    """A format-patch file as (mail header + message + diffstat, [(path, its `diff --git` section)])."""
    parts = re.split(r"(?m)^(?=diff --git )", text)
    sections = []
    for sec in parts[1:]:
        m = re.match(r"diff --git a/(\S+) b/(\S+)", sec)
        sections.append((m.group(2), sec))
    return parts[0], sections


def new_file_contents(section: str) -> bytes | None:
    """The contents of a file a `diff --git` section creates, or None if it does not create one."""
    if not re.search(r"(?m)^new file mode ", section):
        return None
    out, lines = [], section.split("\n")
    in_hunk = False
    for i, line in enumerate(lines):
        if line.startswith("@@ "):
            in_hunk = True
        elif in_hunk and line.startswith("+"):
            out.append(line[1:] + "\n")
        elif in_hunk and line.startswith("\\ No newline") and out:
            out[-1] = out[-1][:-1]
    return "".join(out).encode()


def git(cwd: Path, *args: str, **kw) -> str:
    env = dict(os.environ, GIT_COMMITTER_NAME="mlx-h2o", GIT_COMMITTER_EMAIL="mlx-h2o@localhost")
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, text=True, stdout=subprocess.PIPE,
                          env=env, **kw).stdout


def regenerate(src: Path, out: Path | None = None) -> None:
    pin = read_pin()
    kdir = pin["MLX_KERNEL_DIR"]
    patches = sorted(SERIES_DIR.glob("*.patch"))
    owner = next((p for p in patches if any(path.startswith(kdir + "/") for path, _ in split_patch(p.read_text())[1])),
                 None)
    if owner is None:
        sys.exit(f"gen_mlx_patches.py: no patch in {SERIES_DIR} adds files under {kdir}: add the kernel's glue "
                 "patch (with a first copy of the kernel there) before generating")
    files = vendored_files(pin=pin)
    work = Path(tempfile.mkdtemp(prefix="mlx-series-"))
    tree = work / "mlx"
    git(src, "worktree", "add", "--quiet", "--detach", str(tree), pin["MLX_COMMIT"])
    try:
        for p in patches:
            header, sections = split_patch(p.read_text())
            kept = [sec for path, sec in sections if not path.startswith(kdir + "/")]
            if p != owner and len(kept) != len(sections):
                sys.exit(f"gen_mlx_patches.py: {p.name} touches {kdir}, which only {owner.name} may")
            mbox = work / p.name
            mbox.write_text(header + "".join(kept))
            try:
                git(tree, "am", "--quiet", "--keep-cr", str(mbox), stderr=subprocess.PIPE)
            except subprocess.CalledProcessError as e:
                sys.exit(f"gen_mlx_patches.py: {p.name} (without {kdir}) does not apply:\n{e.stderr}")
            if p == owner:
                shutil.rmtree(tree / kdir, ignore_errors=True)
                for rel, data in files.items():
                    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                    (tree / rel).write_bytes(data)
                git(tree, "add", "-A", kdir)
                git(tree, "commit", "--quiet", "--amend", "--no-edit", "--allow-empty")
        env = dict(os.environ, MLX_SERIES_OUT=str(out or SERIES_DIR))
        subprocess.run([str(ROOT / "scripts" / "regen_mlx_patches.sh"), str(tree)], check=True, env=env)
    finally:
        git(src, "worktree", "remove", "--force", str(tree))
        shutil.rmtree(work, ignore_errors=True)
    print(f"gen_mlx_patches.py: {owner.name} carries {len(files)} kernel files from csrc/ under {kdir}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="a clone of ml-explore/mlx holding the pinned tag")
    ap.add_argument("--out", type=Path, help="write the series there instead of patches/mlx")
    args = ap.parse_args(argv)
    if not (args.src / ".git").exists():
        sys.exit(f"gen_mlx_patches.py: {args.src} is not a git clone of ml-explore/mlx")
    regenerate(args.src.resolve(), args.out.resolve() if args.out else None)


if __name__ == "__main__":
    main()
