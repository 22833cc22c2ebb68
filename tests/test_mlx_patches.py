"""The patch series (patches/mlx, patches/mlx-lm) and their tool, scripts/series.py (docs/mlx-fork.md):
the kernel files the MLX series adds are csrc/'s, byte for byte, without MLX's source. Where mlx/
and mlx-lm/ are checked out (`scripts/series.py apply`), the committed series also round-trip through
the tool byte for byte (ci/run.sh runs `series.py check` on every series in any case)."""

import shutil
import subprocess
import sys

import pytest
from series_tool import ROOT, series

MLX = series.MLXSeries()
KERNEL_DIR = MLX.pin["MLX_KERNEL_DIR"]


def carried_kernel_files():
    carried, owners = MLX.carried_kernel_files()
    edited = sorted(path for path, contents in carried.items() if contents is None)
    assert not edited, f"{edited}: kernel files are only ever added whole"
    return carried, owners


def test_series_carries_the_kernels_of_csrc():
    _, owners = carried_kernel_files()
    assert len(owners) == 1, f"exactly one patch adds {KERNEL_DIR}, got {sorted(owners)}"
    assert not MLX.stale_kernel_files()
    MLX.check_kernel()  # the tool's own check agrees


def test_kernel_closure_covers_what_the_kernels_include():
    closure = series.kernel_closure()
    for rel in series.KERNEL_SEEDS + ("kernels/isa.cpp", "parallel.cpp", "kernels/attention_cpu_impl.h",
                                      "kernels/quantized_matmul_cpu_impl.h", "kernels/norm_rope_cpu_impl.h"):
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
    assert MLX.stale_kernel_files(csrc) == [
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
        series.kernel_closure(csrc)


def test_new_file_contents_round_trip():
    section = (
        "diff --git a/x/f.h b/x/f.h\nnew file mode 100644\nindex 0000000..1111111\n--- /dev/null\n+++ b/x/f.h\n"
        "@@ -0,0 +1,3 @@\n+a\n+\n+++b\n\\ No newline at end of file\n"
    )
    assert series.new_file_contents(section) == b"a\n\n++b"
    assert series.new_file_contents("diff --git a/f b/f\nindex 1..2 100644\n--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n") is None


@pytest.mark.parametrize("name", sorted(series.SERIES))
def test_series_is_pinned_and_numbered(name):
    s = series.SERIES[name]()
    patches = s.patches()
    assert patches and [p.name[:5] for p in patches] == [f"{i:04d}-" for i in range(1, len(patches) + 1)]
    if name == "mlx":
        assert len(s.pin["MLX_COMMIT"]) == 40 and s.pin["MLX_TAG"].startswith("v")
        gitlink = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "HEAD", "mlx"], capture_output=True, text=True).stdout
        if gitlink:  # the submodule points at the pinned upstream commit
            assert gitlink.split()[:3] == ["160000", "commit", s.pin["MLX_COMMIT"]], gitlink
    else:
        assert len(s.pin["MLX_LM_SHA256"]) == 64 and s.pin["MLX_LM_SERIES_REVISION"].isdigit()


def test_the_tool_explains_its_usage():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "series.py"), "build", "numpy"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice: 'numpy'" in r.stderr and "apply" in r.stderr


@pytest.mark.parametrize("name", sorted(series.SERIES))
def test_committed_series_round_trips(name):
    s = series.SERIES[name]()
    if not (s.tree / ".git").exists():
        pytest.skip(f"{name}/ is not checked out (scripts/series.py apply {name}); ci/run.sh checks it")
    tip = s.commit_series()
    assert series.exports_to_committed(s, tip)
