#!/usr/bin/env python3
"""The one tool for mlx-h2o's two patch series: MLX (patches/mlx, onto the mlx/ submodule at the pinned
upstream commit) and mlx-lm (patches/mlx-lm, onto its PyPI release sdist, pinned by sha256).

    scripts/series.py apply  mlx|mlx-lm [--force]  the pinned source with the series as commits (one per
                                                   patch) checked out in mlx/ or mlx-lm/
    scripts/series.py export mlx|mlx-lm            that tree's commits -> patches/<name>/*.patch, byte-stable;
                                                   the MLX series takes its kernel files from csrc/
    scripts/series.py check  mlx|mlx-lm            the series applies to the pin, carries csrc/'s kernel
                                                   (mlx), and exporting it gives the committed files back
    scripts/series.py build  mlx|mlx-lm            apply, then build the wheel into dist/ (DIST_DIR)

Offline: mlx/ resolves from a copy of ../shared/vendor/mlx.git where one is beside the checkout
(MLX_H2O_VENDOR names another folder), else from GitHub; gguflib (mx.load of .gguf) likewise. The
mlx-lm sdist comes from PyPI once and is checked against its sha256. Contributor loop: apply, edit and
commit in mlx/ or mlx-lm/ (one commit per patch), export, build. docs/mlx-fork.md has the details.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
BUILD = ROOT / "build"
BRANCH = "h2o-series"
# Commits the tool makes are a function of the pin and the series alone: fixed committer and dates.
COMMITTER = {"GIT_COMMITTER_NAME": "mlx-h2o", "GIT_COMMITTER_EMAIL": "mlx-h2o@localhost",
             "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}
IDENTITY = {**COMMITTER, "GIT_AUTHOR_NAME": "mlx-h2o", "GIT_AUTHOR_EMAIL": "mlx-h2o@localhost",
            "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z"}
# One patch format for both series: no commit ids, signature or numbering, so an unchanged series
# exports to identical bytes and `git diff patches/` shows only real changes (--abbrev: blob ids in
# "index" lines as long in a shallow clone as in a full one).
FORMAT_PATCH = ["format-patch", "--quiet", "--zero-commit", "--no-signature", "--no-numbered", "--abbrev=9"]
# What the kernel glue in MLX uses of csrc/ (the include closure of these is vendored into the series).
KERNEL_SEEDS = ("kernels/attention_problem.h", "kernels/attention_cpu.cpp", "parallel.h",
                "kernels/quantized_matmul_problem.h", "kernels/quantized_matmul_cpu.cpp",
                "kernels/norm_rope_problem.h", "kernels/norm_rope_cpu.cpp",
                "kernels/exp_ops_problem.h", "kernels/exp_ops_cpu.cpp")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
_DEFINED_FILE = re.compile(r'^\s*#\s*define\s+\w+\s+"([^"]+\.(?:h|inc))"', re.M)  # a file included via a macro


sys.modules.setdefault("series", sys.modules[__name__])  # series_build imports this module by name


class SeriesError(Exception):
    pass


def say(msg: str) -> None:
    print(f"series: {msg}", flush=True)


def git(cwd: Path, *args: str, env: dict | None = None, check: bool = True) -> str:
    r = subprocess.run(["git", "-C", str(cwd), *args], text=True, capture_output=True,
                       env={**os.environ, **(env or {})})
    if check and r.returncode != 0:
        raise SeriesError(f"git {' '.join(args[:3])} failed in {cwd}:\n{r.stderr.strip()}")
    return r.stdout.strip()


def read_pin(name: str) -> dict:
    pin = {}
    for line in (ROOT / "patches" / name / "pin.env").read_text().splitlines():
        m = re.match(r"^([A-Z0-9_]+)=(.*)$", line.strip())
        if m:
            pin[m.group(1)] = m.group(2).strip().strip('"')
    return pin


def vendor_copy(repo: str) -> Path | None:
    """A writable copy of ../shared/vendor/<repo> (a shallow bare repository; git wants refs/ to exist,
    which the read-only original lacks), or None where there is no vendor folder."""
    vendor = Path(os.environ.get("MLX_H2O_VENDOR", ROOT.parent / "shared" / "vendor"))
    if not (vendor / repo).is_dir():
        return None
    copy = BUILD / "vendor" / repo
    if not (copy / "refs").is_dir():
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(vendor / repo, copy)
        for d in (copy, *copy.rglob("*")):
            d.chmod(d.stat().st_mode | 0o200)
        for d in ("refs/heads", "refs/tags"):
            (copy / d).mkdir(parents=True, exist_ok=True)
    return copy


# ---- the two sources -------------------------------------------------------------------------------

class Series:
    name: str

    def __init__(self):
        self.pin = read_pin(self.name)
        self.dir = ROOT / "patches" / self.name
        self.tree = ROOT / self.name

    def patches(self) -> list[Path]:
        return sorted(self.dir.glob("[0-9][0-9][0-9][0-9]-*.patch"))

    def ensure_source(self) -> None:
        raise NotImplementedError

    @property
    def base(self) -> str:
        raise NotImplementedError

    def commit_series(self, patches: list[Path] | None = None, after=None) -> str:
        """The series as commits on the pin, made in a scratch worktree (the tree's files are not
        touched); returns the tip. `after(patch, worktree)` may amend each commit. A patch that does
        not apply stops with git's message."""
        self.ensure_source()
        scratch = Path(tempfile.mkdtemp(prefix=f"{self.name}-series-"))
        work = scratch / "tree"
        git(self.tree, "worktree", "add", "--quiet", "--detach", str(work), self.base)
        try:
            for p in patches if patches is not None else self.patches():
                r = subprocess.run(["git", "-C", str(work), "am", "--quiet", "--keep-cr", "--committer-date-is-author-date",
                                    str(p)], text=True, capture_output=True, env={**os.environ, **COMMITTER})
                if r.returncode != 0:
                    raise SeriesError(f"{p.name} does not apply to {self.describe_base()} + the patches before it:\n"
                                      f"{(r.stdout + r.stderr).strip()}")
                if after is not None:
                    after(p, work)
            return git(work, "rev-parse", "HEAD")
        finally:
            git(self.tree, "worktree", "remove", "--force", str(work), check=False)
            git(self.tree, "worktree", "prune", check=False)
            shutil.rmtree(scratch, ignore_errors=True)

    def describe_base(self) -> str:
        raise NotImplementedError

    def format(self, tip: str, out: Path) -> None:
        """tip's commits on the pin as patch files in out (replacing what is there)."""
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("*.patch"):
            old.unlink()
        if git(self.tree, "rev-list", "--merges", f"{self.base}..{tip}"):
            raise SeriesError("the series must be linear (no merge commits)")
        git(self.tree, *FORMAT_PATCH, "-o", str(out), f"{self.base}..{tip}")

    def export_from(self, tip: str, out: Path) -> None:
        self.format(tip, out)


class MLXSeries(Series):
    name = "mlx"

    @property
    def base(self) -> str:
        return self.pin["MLX_COMMIT"]

    def describe_base(self) -> str:
        return f"MLX {self.pin['MLX_TAG']} ({self.base[:12]})"

    def ensure_source(self) -> None:
        if not (self.tree / ".git").exists():
            copy = vendor_copy("mlx.git")
            if copy is not None:
                say(f"mlx/: submodule from the offline copy of upstream ({copy.relative_to(ROOT)})")
                git(ROOT, "config", "submodule.mlx.url", str(copy))
                git(ROOT, "-c", "protocol.file.allow=always", "submodule", "update", "--init", "mlx")
            else:
                say("mlx/: submodule from upstream (github.com/ml-explore/mlx)")
                git(ROOT, "submodule", "update", "--init", "--depth", "1", "mlx")
        if subprocess.run(["git", "-C", str(self.tree), "cat-file", "-e", f"{self.base}^{{commit}}"],
                          capture_output=True).returncode:
            raise SeriesError(f"mlx/ lacks the pinned commit {self.base} ({self.pin['MLX_TAG']}): "
                              "git submodule update --init mlx")

    def export_from(self, tip: str, out: Path) -> None:
        """Format the commits, then make the patch that owns MLX_KERNEL_DIR carry csrc/'s kernel files."""
        raw = Path(tempfile.mkdtemp(prefix="mlx-raw-"))
        try:
            self.format(tip, raw)
            kernel_tip = self.commit_series_with_kernel(sorted(raw.glob("*.patch")))
            self.format(kernel_tip, out)
        finally:
            shutil.rmtree(raw, ignore_errors=True)

    def commit_series_with_kernel(self, patches: list[Path]) -> str:
        """The series as commits, with the files under MLX_KERNEL_DIR of the one patch that adds them
        replaced by csrc/'s kernel (and no other patch may touch that folder)."""
        kdir = self.pin["MLX_KERNEL_DIR"]
        owner = [p.name for p in patches if any(path.startswith(kdir + "/") for path, _ in split_patch(p.read_text())[1])]
        if len(owner) != 1:
            raise SeriesError(f"exactly one patch may add files under {kdir} (found {owner})")

        def put_kernel(patch: Path, work: Path) -> None:
            if patch.name != owner[0]:
                return
            for rel, data in vendored_kernel_files(kdir).items():
                (work / rel).parent.mkdir(parents=True, exist_ok=True)
                (work / rel).write_bytes(data)
            git(work, "add", "-A", kdir)
            git(work, "commit", "--quiet", "--amend", "--no-edit", "--allow-empty", env=COMMITTER)

        stripped = Path(tempfile.mkdtemp(prefix="mlx-stripped-"))
        try:
            for p in patches:
                header, sections = split_patch(p.read_text())
                (stripped / p.name).write_text(header + "".join(sec for path, sec in sections if not path.startswith(kdir + "/")))
            return self.commit_series(sorted(stripped.glob("*.patch")), after=put_kernel)
        finally:
            shutil.rmtree(stripped, ignore_errors=True)

    def carried_kernel_files(self) -> tuple[dict[str, bytes | None], set[str]]:
        """{MLX path: contents (None where a patch edits rather than adds it)} of the files the series
        puts under MLX_KERNEL_DIR, and the names of the patches that do."""
        kdir = self.pin["MLX_KERNEL_DIR"]
        carried, owners = {}, set()
        for p in self.patches():
            for path, section in split_patch(p.read_text())[1]:
                if path.startswith(kdir + "/"):
                    owners.add(p.name)
                    carried[path] = new_file_contents(section)
        return carried, owners

    def stale_kernel_files(self, csrc: Path = CSRC) -> list[str]:
        """The MLX paths where the series' kernel files differ from csrc/'s (or one side lacks them)."""
        carried, _ = self.carried_kernel_files()
        expected = vendored_kernel_files(self.pin["MLX_KERNEL_DIR"], csrc)
        return sorted(k for k in expected.keys() | carried.keys() if expected.get(k) != carried.get(k))

    def check_kernel(self) -> None:
        stale = self.stale_kernel_files()
        if stale:
            raise SeriesError(f"the series' kernel files differ from csrc/: {stale}; run scripts/series.py export mlx")


class MLXLMSeries(Series):
    name = "mlx-lm"

    @property
    def base(self) -> str:
        return "base"

    def describe_base(self) -> str:
        return f"the mlx-lm {self.pin['MLX_LM_VERSION']} sdist"

    def sdist(self) -> Path:
        """The pinned sdist from PyPI (once), sha256-checked."""
        version, digest = self.pin["MLX_LM_VERSION"], self.pin["MLX_LM_SHA256"]
        dest = BUILD / "mlx-lm"
        archive = dest / f"mlx_lm-{version}.tar.gz"
        if not archive.is_file() or sha256(archive) != digest:
            archive.unlink(missing_ok=True)
            say(f"downloading the mlx-lm {version} sdist from PyPI")
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            f"mlx-lm=={version}", "-d", str(dest)], check=True)
            if sha256(archive) != digest:
                raise SeriesError(f"{archive} does not match the pinned sha256 {digest} (patches/mlx-lm/pin.env)")
        return archive

    def ensure_source(self) -> None:
        """mlx-lm/: a git repository whose commit `base` is the sdist as released."""
        if (self.tree / ".git").exists() and git(self.tree, "rev-parse", "-q", "--verify", "base", check=False):
            return
        archive = self.sdist()
        shutil.rmtree(self.tree, ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(tmp)
            (top,) = Path(tmp).iterdir()
            shutil.move(str(top), self.tree)
        git(self.tree, "init", "--quiet")
        git(self.tree, "add", "--all")
        git(self.tree, "commit", "--quiet", "-m", f"mlx-lm {self.pin['MLX_LM_VERSION']} (PyPI sdist, sha256 {self.pin['MLX_LM_SHA256'][:12]})",
            env=IDENTITY)
        git(self.tree, "tag", "base")
        say(f"mlx-lm/: the sdist as commit 'base' ({git(self.tree, 'rev-parse', '--short', 'base')})")


SERIES = {"mlx": MLXSeries, "mlx-lm": MLXLMSeries}


# ---- kernel files vendored from csrc/ --------------------------------------------------------------

def kernel_closure(csrc: Path = CSRC, seeds=KERNEL_SEEDS) -> list[str]:
    """csrc/-relative paths of the kernels the MLX glue uses: the seeds, every file they include (quoted
    includes, also through `#define NAME "file"`), and for each X.h its X.cpp where one exists. A quoted
    include that is not a file under csrc/ is an error: the kernels must not depend on MLX's headers
    (they compile into MLX and into the extension alike)."""
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
        "# mlx-h2o's CPU kernels (attention with scores, integer-dot quantized matmul, rms_norm, rope),\n"
        "# vendored from mlx-h2o's csrc/ and kept identical to it by its scripts/series.py (which writes this file).\n"
        f"target_sources(\n  mlx\n  PRIVATE {listed})\n"
    )


def vendored_kernel_files(kdir: str, csrc: Path = CSRC) -> dict[str, bytes]:
    closure = kernel_closure(csrc)
    files = {f"{kdir}/{rel}": (csrc / rel).read_bytes() for rel in closure}
    files[f"{kdir}/CMakeLists.txt"] = cmake_lists([r for r in closure if r.endswith(".cpp")]).encode()
    return files


def split_patch(text: str) -> tuple[str, list[tuple[str, str]]]:
    """A format-patch file as (mail header + message + diffstat, [(path, its `diff --git` section)])."""
    parts = re.split(r"(?m)^(?=diff --git )", text)
    return parts[0], [(re.match(r"diff --git a/(\S+) b/(\S+)", s).group(2), s) for s in parts[1:]]


def new_file_contents(section: str) -> bytes | None:
    """The contents of a file a `diff --git` section creates, or None if it does not create one."""
    if not re.search(r"(?m)^new file mode ", section):
        return None
    out, in_hunk = [], False
    for line in section.split("\n"):
        if line.startswith("@@ "):
            in_hunk = True
        elif in_hunk and line.startswith("+"):
            out.append(line[1:] + "\n")
        elif in_hunk and line.startswith("\\ No newline") and out:
            out[-1] = out[-1][:-1]
    return "".join(out).encode()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- commands --------------------------------------------------------------------------------------

def exports_to_committed(s: Series, tip: str) -> bool:
    """Whether exporting tip's commits gives patches/<name> byte for byte."""
    out = Path(tempfile.mkdtemp(prefix="series-check-"))
    try:
        s.export_from(tip, out)
        exported, committed = sorted(out.glob("*.patch")), s.patches()
        return [(p.name, p.read_bytes()) for p in exported] == [(p.name, p.read_bytes()) for p in committed]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def cmd_apply(s: Series, force: bool = False) -> str:
    s.ensure_source()
    tip = s.commit_series()
    if git(s.tree, "rev-parse", "HEAD") == tip:
        say(f"{s.name}/ already holds {s.describe_base()} + {len(s.patches())} patches (branch {BRANCH})")
        return tip
    if not force:
        if git(s.tree, "status", "--porcelain", "--untracked-files=no"):
            raise SeriesError(f"{s.name}/ has uncommitted changes; commit and export them, or apply --force")
        ahead = git(s.tree, "rev-list", f"{s.base}..HEAD", check=False)
        if ahead and git(s.tree, "rev-parse", "HEAD^{tree}") != git(s.tree, "rev-parse", f"{tip}^{{tree}}") \
                and not exports_to_committed(s, git(s.tree, "rev-parse", "HEAD")):
            raise SeriesError(f"{s.name}/ holds commits that differ from patches/{s.name}: export them "
                              f"(scripts/series.py export {s.name}), or apply --force to drop them")
    # Only files that differ are rewritten, so unchanged sources keep their timestamps (no rebuild).
    git(s.tree, "checkout", "-q", "-f", "-B", BRANCH, tip)
    say(f"{s.name}/ now at {tip[:12]} = {s.describe_base()} + {len(s.patches())} patches (branch {BRANCH})")
    return tip


def cmd_export(s: Series) -> None:
    s.ensure_source()
    if git(s.tree, "status", "--porcelain", "--untracked-files=no"):
        raise SeriesError(f"{s.name}/ has uncommitted changes: commit them (one commit per patch) first")
    head = git(s.tree, "rev-parse", "HEAD")
    if not git(s.tree, "rev-list", f"{s.base}..{head}"):
        raise SeriesError(f"{s.name}/ has no commits on top of {s.describe_base()}: nothing to export")
    before = {p.name: p.read_bytes() for p in s.patches()}
    s.export_from(head, s.dir)
    after = {p.name: p.read_bytes() for p in s.patches()}
    changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    say(f"exported {len(after)} patches to patches/{s.name}: " + (", ".join(changed) + " changed" if changed else "unchanged"))
    if changed:
        key = "MLX_LOCAL_VERSION" if s.name == "mlx" else "MLX_LM_SERIES_REVISION"
        say(f"a patch changed: bump {key} in patches/{s.name}/pin.env")


def cmd_check(s: Series) -> None:
    committed = s.patches()
    if not committed:
        raise SeriesError(f"no patches in patches/{s.name}")
    if s.name == "mlx":
        s.check_kernel()
        say(f"the kernel files in the series are csrc/'s ({len(kernel_closure())} files)")
    tip = s.commit_series()
    say(f"all {len(committed)} patches apply to {s.describe_base()}")
    if not exports_to_committed(s, tip):
        raise SeriesError(f"exporting the applied series does not give patches/{s.name} back; "
                          f"run scripts/series.py export {s.name}")
    say(f"patches/{s.name} is what the applied series exports, byte for byte")


def cmd_build(s: Series) -> Path:
    cmd_apply(s)
    from series_build import build_mlx, build_mlx_lm  # noqa: PLC0415  (the build steps, beside this file)

    dist = Path(os.environ.get("DIST_DIR", ROOT / "dist"))
    dist.mkdir(parents=True, exist_ok=True)
    return build_mlx(s, dist) if s.name == "mlx" else build_mlx_lm(s, dist)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("command", choices=["apply", "export", "check", "build"])
    ap.add_argument("series", choices=sorted(SERIES))
    ap.add_argument("--force", action="store_true", help="apply: discard uncommitted or unexported work in the tree")
    args = ap.parse_args(argv)
    s = SERIES[args.series]()
    start = time.time()
    try:
        if args.command == "apply":
            cmd_apply(s, force=args.force)
        elif args.command == "export":
            cmd_export(s)
        elif args.command == "check":
            cmd_check(s)
        else:
            cmd_build(s)
    except (SeriesError, FileNotFoundError, ValueError, subprocess.CalledProcessError) as e:
        print(f"series.py {args.command} {args.series}: error: {e}", file=sys.stderr)
        return 1
    say(f"{args.command} {args.series}: done in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
