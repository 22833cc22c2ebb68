"""The MLX patch series (patches/mlx, docs/mlx-fork.md) against this checkout, without MLX's source:
the kernel files it adds to MLX are csrc/'s, byte for byte, and the build script explains itself.
With a clone of ml-explore/mlx in MLX_SRC_DIR, the series is also regenerated and compared whole."""

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERIES = ROOT / "patches" / "mlx"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_mlx_patches", ROOT / "scripts" / "gen_mlx_patches.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _generator()
PIN = gen.read_pin()
KERNEL_DIR = PIN["MLX_KERNEL_DIR"]


def carried_kernel_files(series_dir=SERIES):
    """{MLX path: contents} of the files the series adds under MLX_KERNEL_DIR, and the patches doing it."""
    carried, owners = {}, set()
    for patch in sorted(series_dir.glob("*.patch")):
        for path, section in gen.split_patch(patch.read_text())[1]:
            if path.startswith(KERNEL_DIR + "/"):
                owners.add(patch.name)
                contents = gen.new_file_contents(section)
                assert contents is not None, f"{patch.name} edits {path}: kernel files are only ever added whole"
                carried[path] = contents
    return carried, owners


def stale_files(carried, expected):
    return sorted(p for p in carried.keys() | expected.keys() if carried.get(p) != expected.get(p))


def test_series_carries_the_kernel_of_csrc():
    carried, owners = carried_kernel_files()
    assert len(owners) == 1, f"exactly one patch adds {KERNEL_DIR}, got {sorted(owners)}"
    stale = stale_files(carried, gen.vendored_files(pin=PIN))
    assert not stale, (
        f"patches/mlx differs from csrc/ in {stale}: regenerate the series with "
        "scripts/gen_mlx_patches.py SRC_DIR (docs/mlx-fork.md)"
    )


def test_kernel_closure_covers_what_the_kernel_includes():
    closure = gen.kernel_closure()
    for rel in gen.KERNEL_SEEDS + ("kernels/isa.cpp", "parallel.cpp", "kernels/attention_cpu_impl.h"):
        assert rel in closure
    assert not any(rel.startswith("blas/") or rel.endswith("bindings.cpp") for rel in closure)


def test_a_changed_kernel_file_is_reported(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", csrc)
    simd = csrc / "kernels" / "simd.h"
    simd.write_text(simd.read_text() + "// changed\n")
    (csrc / "kernels" / "extra.h").write_text("#pragma once\n")
    impl = csrc / "kernels" / "attention_cpu_impl.h"
    impl.write_text('#include "extra.h"\n' + impl.read_text())
    carried, _ = carried_kernel_files()
    assert stale_files(carried, gen.vendored_files(csrc, PIN)) == [
        f"{KERNEL_DIR}/kernels/attention_cpu_impl.h",
        f"{KERNEL_DIR}/kernels/extra.h",
        f"{KERNEL_DIR}/kernels/simd.h",
    ]


def test_kernel_files_may_not_include_mlx(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", csrc)
    work = csrc / "kernels" / "work.h"
    work.write_text('#include "mlx/array.h"\n' + work.read_text())
    with pytest.raises(ValueError, match="may include only each other"):
        gen.kernel_closure(csrc)


def test_new_file_contents_round_trip():
    section = (
        "diff --git a/x/f.h b/x/f.h\nnew file mode 100644\nindex 0000000..1111111\n--- /dev/null\n+++ b/x/f.h\n"
        "@@ -0,0 +1,3 @@\n+a\n+\n+++b\n\\ No newline at end of file\n"
    )
    assert gen.new_file_contents(section) == b"a\n\n++b"
    assert gen.new_file_contents("diff --git a/f b/f\nindex 1..2 100644\n--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n") is None


def test_series_is_pinned():
    patches = sorted(SERIES.glob("*.patch"))
    assert [p.name[:5] for p in patches] == [f"{i:04d}-" for i in range(1, len(patches) + 1)]
    assert len(PIN["MLX_COMMIT"]) == 40 and PIN["MLX_TAG"].startswith("v")


def test_build_script_without_source_says_how_to_get_it():
    res = subprocess.run([str(ROOT / "scripts" / "build_mlx.sh")], capture_output=True, text=True)
    assert res.returncode != 0
    assert "git clone https://github.com/ml-explore/mlx.git" in res.stderr
    assert PIN["MLX_TAG"] in res.stderr


MLX_SRC = os.environ.get("MLX_SRC_DIR")


@pytest.mark.skipif(not MLX_SRC, reason="needs a clone of ml-explore/mlx: set MLX_SRC_DIR (docs/mlx-fork.md)")
def test_regenerated_series_is_the_committed_one(tmp_path):
    out = tmp_path / "series"
    subprocess.run(["python3", str(ROOT / "scripts" / "gen_mlx_patches.py"), MLX_SRC, "--out", str(out)], check=True)
    for patch in sorted(SERIES.glob("*.patch")):
        assert (out / patch.name).read_bytes() == patch.read_bytes(), patch.name
    assert sorted(p.name for p in out.glob("*.patch")) == sorted(p.name for p in SERIES.glob("*.patch"))
