"""Bundles: byte-reproducible, verified on read, refusing unsafe members, 1:1 references."""

from __future__ import annotations

import io
import json
import tarfile

import polars as pl
import pytest

from jex.errors import InputError
from jex.tasks.bundle.bundle_file import BundleError, build_bundle, open_bundle
from tests.conftest import row, write_suite


def test_two_builds_are_byte_identical(sample_suite, tmp_path):
    a = build_bundle(sample_suite, tmp_path / "a.tar.gz")
    b = build_bundle(sample_suite, tmp_path / "b.tar.gz", shard_rows=16384)
    assert a.sha256 == b.sha256
    assert (tmp_path / "a.tar.gz").read_bytes() == (tmp_path / "b.tar.gz").read_bytes()


def test_members_are_sorted_with_fixed_metadata(sample_suite, tmp_path):
    build_bundle(sample_suite, tmp_path / "a.tar.gz", shard_rows=100)
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted(m.name for m in members)
    assert {(m.mtime, m.uid, m.gid, m.mode) for m in members} == {(0, 0, 0, 0o644)}
    assert (tmp_path / "a.tar.gz").read_bytes()[4:8] == b"\0\0\0\0"  # gzip header mtime


def test_round_trip_keeps_rows_order_and_counts(sample_suite, tmp_path):
    result = build_bundle(sample_suite, tmp_path / "a.tar.gz", shard_rows=50)
    bundle = open_bundle(tmp_path / "a.tar.gz", tmp_path / "x")
    rows = bundle.rows()
    assert len(bundle.row_shards()) == 8 and rows.height == 360 == result.rows
    assert rows["run_id"][0] == "arith-000000-0"
    counts = {c.id: c.rows for c in bundle.catalogs()}
    assert sum(counts.values()) == 360
    assert all(len(m.sha256) == 64 for m in bundle.manifest.members.values())
    assert bundle.manifest.provenance is None and "provenance" not in bundle.manifest.model_dump()


def test_provenance_lies_beside_the_bundle_not_in_its_bytes(sample_suite, tmp_path, monkeypatch):
    """Another jex commit or library version builds the same bytes; what built it is in the sidecar."""
    from jex import provenance as prov
    from jex.tasks.bundle.bundle_file import provenance_sidecar

    first = build_bundle(sample_suite, tmp_path / "a.tar.gz", provenance_out=provenance_sidecar(tmp_path / "a.tar.gz"))
    monkeypatch.setattr(prov, "git_commit", lambda: {"commit": "0" * 40, "dirty": False})
    monkeypatch.setattr(prov, "package_versions", lambda: {"polars": "99.0", "torch": "99.0"})
    second = build_bundle(sample_suite, tmp_path / "b.tar.gz", provenance_out=provenance_sidecar(tmp_path / "b.tar.gz"))
    assert first.sha256 == second.sha256
    sidecar = json.loads((tmp_path / "b.provenance.json").read_text())
    assert sidecar["packages"]["polars"] == "99.0" and sidecar["inputs"]["suite/suite.toml"]


def test_default_chance_is_mean_inverse_option_count(tmp_path):
    suite = write_suite(tmp_path / "s", {"a": [row("a1", "a", k=2), row("a2", "a", k=4), row("a3", "a", k=4)]})
    build_bundle(suite, tmp_path / "b.tar.gz")
    cat = open_bundle(tmp_path / "b.tar.gz", tmp_path / "x").catalogs()[0]
    assert cat.chance == (1 / 2 + 1 / 4 + 1 / 4) / 3


def _rewrite(src, dst, mutate):
    with tarfile.open(src) as tin, tarfile.open(dst, "w:gz") as tout:
        for m in tin.getmembers():
            data = tin.extractfile(m).read()
            m, data = mutate(m, data)
            tout.addfile(m, io.BytesIO(data))


def test_tampered_member_fails_checksum(sample_suite, tmp_path):
    build_bundle(sample_suite, tmp_path / "a.tar.gz")

    def flip(m, data):
        if m.name.startswith("rows/"):
            data = data[:-20] + bytes(20)
        return m, data

    _rewrite(tmp_path / "a.tar.gz", tmp_path / "bad.tar.gz", flip)
    with pytest.raises(BundleError, match="checksum mismatch for 'rows/shard-00000.parquet'"):
        open_bundle(tmp_path / "bad.tar.gz", tmp_path / "x")


def test_a_manifest_with_a_renamed_key_is_refused_by_its_record(sample_suite, tmp_path):
    build_bundle(sample_suite, tmp_path / "a.tar.gz")

    def rename(m, data):
        if m.name == "manifest.json":
            doc = json.loads(data)
            doc["row_count"] = doc.pop("rows")
            data = json.dumps(doc).encode()
            m.size = len(data)
        return m, data

    _rewrite(tmp_path / "a.tar.gz", tmp_path / "bad.tar.gz", rename)
    with pytest.raises(BundleError, match=r"not a valid bundle manifest(.|\n)*row_count"):
        open_bundle(tmp_path / "bad.tar.gz", tmp_path / "x")


def test_unlisted_member_is_refused(sample_suite, tmp_path):
    build_bundle(sample_suite, tmp_path / "a.tar.gz")
    with tarfile.open(tmp_path / "a.tar.gz") as tin, tarfile.open(tmp_path / "bad.tar.gz", "w:gz") as tout:
        for m in tin.getmembers():
            tout.addfile(m, tin.extractfile(m))
        extra = tarfile.TarInfo("rows/extra.parquet")
        extra.size = 3
        tout.addfile(extra, io.BytesIO(b"abc"))
    with pytest.raises(BundleError, match="unlisted"):
        open_bundle(tmp_path / "bad.tar.gz", tmp_path / "x")


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink", "hardlink", "device"])
def test_unsafe_members_are_refused(tmp_path, kind):
    path = tmp_path / "evil.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo({"absolute": "/etc/evil", "dotdot": "../evil"}.get(kind, "rows/evil"))
        if kind == "symlink":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        elif kind == "hardlink":
            info.type, info.linkname = tarfile.LNKTYPE, "manifest.json"
        elif kind == "device":
            info.type = tarfile.CHRTYPE
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(BundleError, match="unsafe member"):
        open_bundle(path, tmp_path / "x")
    assert not (tmp_path / "evil").exists()


def _reference(path, rows):
    with open(path, "w") as f:
        for rid, choice in rows:
            f.write(json.dumps({"run_id": rid, "choice": choice, "probs": [0.5, 0.5, 0.0, 0.0]}) + "\n")
    return path


@pytest.fixture
def small(tmp_path):
    return write_suite(tmp_path / "s", {"a": [row(f"a{i}", "a") for i in range(5)]})


def test_reference_rows_travel_in_suite_order(small, tmp_path):
    ref = _reference(tmp_path / "ref.jsonl", [(f"a{i}", i % 4) for i in reversed(range(5))])
    build_bundle(small, tmp_path / "b.tar.gz", reference=ref)
    got = open_bundle(tmp_path / "b.tar.gz", tmp_path / "x").reference()
    assert got["run_id"].to_list() == [f"a{i}" for i in range(5)]
    assert got["choice"].to_list() == [0, 1, 2, 3, 0]


@pytest.mark.parametrize("rows, words", [
    ([(f"a{i}", 0) for i in range(4)], "missing: 1 (first: ['a4'])"),
    ([(f"a{i}", 0) for i in range(5)] + [("zz", 1)], "extra: 1 (first: ['zz'])"),
    ([(f"a{i}", 0) for i in range(5)] + [("a2", 1)], "duplicated: 1 (first: ['a2'])"),
])
def test_reference_must_match_one_to_one(small, tmp_path, rows, words):
    ref = _reference(tmp_path / "ref.jsonl", rows)
    with pytest.raises(InputError, match=r"1:1") as e:
        build_bundle(small, tmp_path / "b.tar.gz", reference=ref)
    assert words in str(e.value)
    assert not (tmp_path / "b.tar.gz").exists()


def test_failed_build_leaves_previous_bundle_intact(small, tmp_path):
    out = tmp_path / "b.tar.gz"
    build_bundle(small, out)
    before = out.read_bytes()
    with open(small / "rows" / "a.jsonl", "a") as f:
        f.write(json.dumps(row("a0", "a")) + "\n")  # duplicate run_id
    with pytest.raises(InputError):
        build_bundle(small, out)
    assert out.read_bytes() == before


def test_metadata_survives_as_json_text(tmp_path):
    suite = write_suite(tmp_path / "s", {"a": [row("a1", "a", metadata={"source": "x", "n": 2})]})
    build_bundle(suite, tmp_path / "b.tar.gz")
    rows = open_bundle(tmp_path / "b.tar.gz", tmp_path / "x").rows()
    assert json.loads(rows["metadata"][0]) == {"n": 2, "source": "x"}
    assert rows.schema["options"] == pl.List(pl.String)


def _with_huge_member_after_manifest(src, dst, name, size):
    """The bundle with a member of `size` bytes right after manifest.json; its data is never written
    (the archive ends there), so an extractor that reads it fails differently from one that refuses it."""
    with tarfile.open(src) as tin, open(dst, "wb") as raw:
        import gzip

        with gzip.GzipFile(fileobj=raw, mode="wb") as gz:
            manifest = tin.getmember("manifest.json")
            gz.write(manifest.tobuf(format=tarfile.PAX_FORMAT))
            data = tin.extractfile(manifest).read()
            gz.write(data + bytes(-len(data) % 512))
            huge = tarfile.TarInfo(name)
            huge.size = size
            gz.write(huge.tobuf(format=tarfile.PAX_FORMAT))
            gz.write(bytes(1 << 20))  # 1 MiB of the 1 GiB: enough for any reader to start writing


def test_unlisted_1gib_member_is_refused_before_anything_is_written(small, tmp_path):
    build_bundle(small, tmp_path / "a.tar.gz")
    _with_huge_member_after_manifest(tmp_path / "a.tar.gz", tmp_path / "bad.tar.gz", "rows/huge.bin", 1 << 30)
    with pytest.raises(BundleError, match=r"unlisted \['rows/huge.bin'\] \(1073741824 bytes\)"):
        open_bundle(tmp_path / "bad.tar.gz", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_listed_member_larger_than_the_manifest_says_is_refused_before_extraction(small, tmp_path):
    build_bundle(small, tmp_path / "a.tar.gz")
    _with_huge_member_after_manifest(tmp_path / "a.tar.gz", tmp_path / "bad.tar.gz", "suite.toml", 1 << 30)
    with pytest.raises(BundleError, match="'suite.toml' is 1073741824 bytes, the manifest says"):
        open_bundle(tmp_path / "bad.tar.gz", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_engine_processes_opening_one_bundle_at_once_each_read_it_whole(tmp_path):
    """The engine processes of one machine open the same bundle into the same folder at the same time."""
    import subprocess
    import sys

    from jex.sample_suite import write_sample_suite

    built = build_bundle(write_sample_suite(tmp_path / "suite", rows=6000, seed=2), tmp_path / "b.tar.gz")
    read = ("import sys; from jex.tasks.bundle.bundle_file import open_bundle\n"
            "for _ in range(25):\n"
            "    print(open_bundle(sys.argv[1], sys.argv[2]).rows(['run_id', 'prompt']).height)")
    procs = [subprocess.Popen([sys.executable, "-c", read, str(built.path), str(tmp_path / "extracted")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-800:] for _, err in outs]
    assert all(out.split() == ["6000"] * 25 for out, _ in outs)
