"""The file stores of a group's rendezvous: which files a stopping rank and a new forming's owner
remove (hand-made names in a private temporary directory)."""

import tempfile

import pytest

from engine.rendezvous import Rendezvous, remove_store_files


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def names(tmp) -> list[str]:
    return sorted(p.name for p in tmp.iterdir())


def test_an_owner_removes_the_earlier_formings_of_its_group_only(tmp):
    files = ["c1-decode-g0-aaaa", "c1-decode-g1-bbbb", "c1-decode-g2-cccc", "c1-prefill-g0-dddd",
             "c1-kv-eeee", "c2-decode-g0-ffff", "c1-decoder-g0-gggg"]  # fmt: skip
    for name in files:
        (tmp / f"epcluster-{name}").write_bytes(b"x")
    remove_store_files(Rendezvous("c1-decode-g2-cccc", "127.0.0.1", 1), earlier_only=True)
    assert names(tmp) == sorted(
        f"epcluster-{n}"
        for n in ["c1-decode-g2-cccc", "c1-prefill-g0-dddd", "c1-kv-eeee", "c2-decode-g0-ffff",
                  "c1-decoder-g0-gggg"]
    )  # fmt: skip
    (tmp / "epcluster-c1-kv-0000").write_bytes(b"x")
    remove_store_files(Rendezvous("c1-kv-1111", "127.0.0.1", 1), earlier_only=True)
    assert "epcluster-c1-kv-eeee" not in names(tmp) and "epcluster-c1-kv-0000" not in names(tmp)
    assert len(names(tmp)) == 4


def test_a_stopping_rank_removes_its_own_and_a_tcp_store_has_no_file(tmp):
    (tmp / "epcluster-c1-prefill-g0-dddd").write_bytes(b"x")
    (tmp / "epcluster-c1-prefill-g1-eeee").write_bytes(b"x")
    remove_store_files(Rendezvous("c1-prefill-g1-eeee", "127.0.0.1", 1))
    assert names(tmp) == ["epcluster-c1-prefill-g0-dddd"]
    remove_store_files(Rendezvous("c1-prefill-g0-dddd", "10.0.0.2", 29500))  # a TCP store
    remove_store_files(Rendezvous("c1-prefill-g1-eeee", "10.0.0.2", 29500), earlier_only=True)
    assert names(tmp) == ["epcluster-c1-prefill-g0-dddd"]
