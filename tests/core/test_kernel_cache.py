"""The kernel cache guard: cached kernels go when any kernel module's source changes, and stay otherwise."""

from __future__ import annotations

from pathlib import Path

from spiderflow.kernel_cache import STAMP, drop_stale, sources_digest


def _package(tmp_path: Path) -> Path:
    pkg = tmp_path / "kernels"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "level2.py").write_text("A = 1\n")
    (pkg / "search.py").write_text("B = 2\n")
    return pkg


def test_a_change_in_any_kernel_module_drops_every_cached_kernel(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    cached = [pkg / "__pycache__" / "search.block_layer_cap-10.py311.nbi",
              pkg / "__pycache__" / "search.block_layer_cap-10.py311.1.nbc"]
    for path in cached:
        path.write_bytes(b"x")
    assert drop_stale(pkg)  # no stamp yet: nothing vouches for the cache
    assert not any(path.exists() for path in cached)
    assert (pkg / "__pycache__" / STAMP).read_text().strip() == sources_digest(pkg)
    for path in cached:
        path.write_bytes(b"x")
    assert not drop_stale(pkg)  # same sources: the cache stays
    assert all(path.exists() for path in cached)
    (pkg / "level2.py").write_text("A = 3\n")  # the callee's module, not search.py, changed
    assert drop_stale(pkg)
    assert not any(path.exists() for path in cached)


def test_a_fresh_checkout_is_stamped_before_its_first_kernel_is_cached(tmp_path: Path) -> None:
    """No cache directory yet (nothing compiled): it is created and stamped, so the kernels compiled next are
    kept by every later check instead of being dropped as unvouched for."""
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "level2.py").write_text("A = 1\n")
    assert not drop_stale(pkg)
    assert (pkg / "__pycache__" / STAMP).read_text().strip() == sources_digest(pkg)
    compiled = pkg / "__pycache__" / "level2.f-1.py311.nbi"
    compiled.write_bytes(b"x")
    assert not drop_stale(pkg)
    assert compiled.exists()
