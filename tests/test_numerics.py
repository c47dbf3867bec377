"""The shared numerics and file helpers: each against the readable rule it states."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import tarfile
import zlib

import numpy as np

from jex.fileio import read_json, sha256_json, write_json, write_tar_gz
from jex.numerics import argmax, logit, named_rng, question_folds


def test_argmax_ties_go_to_the_lowest_index_and_none_stays_none():
    assert argmax([0.1, 0.5, 0.5, 0.2]) == 1
    assert argmax([-math.inf, -1.0]) == 1
    assert argmax(None) is None
    assert all(argmax(list(v)) == int(np.argmax(v)) for v in np.random.default_rng(0).integers(0, 3, (200, 4)))


def test_logit_clips_and_keeps_each_path():
    assert logit(0.5) == 0.0 and math.isfinite(logit(0.0)) and math.isfinite(logit(1.0))
    p = 0.3
    assert logit(p) == math.log(p) - math.log1p(-p)  # floats through libm
    clipped = np.clip(np.array([0.0, 0.3, 1.0]), 1e-300, 1 - 1e-16)
    assert np.array_equal(logit(np.array([0.0, 0.3, 1.0])), np.log(clipped) - np.log1p(-clipped))  # arrays: numpy


def test_question_folds_and_named_rng_follow_crc32():
    ids = ["q1", "q2", "q1", "abc"]
    assert question_folds(ids, 5).tolist() == [zlib.crc32(q.encode()) % 5 for q in ids]
    assert named_rng(7, "cat").random() == np.random.default_rng([7, zlib.crc32(b"cat")]).random()


def test_sha256_json_is_the_pinned_key_hash():
    doc = {"b": [1, 2.5], "a": None}
    assert sha256_json(doc) == hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def test_read_json_reads_what_write_json_wrote(tmp_path):
    write_json(tmp_path / "x.json", {"k": [1, "é"]})
    assert read_json(tmp_path / "x.json") == {"k": [1, "é"]}


def test_tar_gz_is_byte_reproducible_and_owner_free(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.bin").write_bytes(b"\0\1")
    members = [("b.bin", tmp_path / "b.bin"), ("dir/a.txt", tmp_path / "a.txt")]
    first, second = io.BytesIO(), io.BytesIO()
    write_tar_gz(first, members)
    (tmp_path / "a.txt").touch()  # a new mtime changes nothing
    write_tar_gz(second, members)
    assert first.getvalue() == second.getvalue()
    with tarfile.open(fileobj=gzip.GzipFile(fileobj=io.BytesIO(first.getvalue()))) as tar:
        infos = tar.getmembers()
        assert [i.name for i in infos] == ["b.bin", "dir/a.txt"]
        assert {(i.mtime, i.uid, i.gid, i.mode, i.uname) for i in infos} == {(0, 0, 0, 0o644, "")}
