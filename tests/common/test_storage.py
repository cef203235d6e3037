"""Files written whole or not at all: a ledger or results.json interrupted mid-write (Ctrl-C) keeps
its last whole version, with no half-written copy left beside it."""

import pytest

from florist.common.storage import atomic_write


def test_an_interrupted_write_keeps_the_old_file_and_leaves_no_temporary_copy(tmp_path):
    path = atomic_write(tmp_path / "ledger.json", lambda f: f.write(b'{"steps": 1}'))

    def interrupted(f):
        f.write(b'{"steps": ')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, interrupted)
    assert path.read_bytes() == b'{"steps": 1}' and [p.name for p in tmp_path.iterdir()] == ["ledger.json"]
