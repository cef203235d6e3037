"""The decoded-data cache: what goes in comes back, memory-mapped, in a fresh process's view;
a damaged entry is decoded again; a cache that cannot be written costs time, not the data."""

import numpy as np

from florist.common import datacache
from florist.common.data import ClientData


def _client(labelled=True):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (30, 1, 4, 4), dtype=np.uint8)
    y = rng.integers(0, 3, 30) if labelled else None
    return ClientData(
        x[:20],
        None if y is None else y[:20],
        x[20:25],
        None if y is None else y[20:25],
        x[25:],
        None if y is None else y[25:],
        3,
    )


def _fresh(monkeypatch):
    monkeypatch.setattr(datacache, "_MEMORY", {})  # as a new process: nothing remembered


def test_an_entry_comes_back_as_it_went_in_labelled_or_not(monkeypatch):
    for labelled in (True, False):
        built = []
        original = _client(labelled)
        datacache.cached({"case": labelled}, lambda o=original: built.append(1) or o)
        _fresh(monkeypatch)
        again = datacache.cached({"case": labelled}, lambda: built.append(1) or original)
        assert built == [1] and again.num_classes == 3 and (again.y_train is None) == (not labelled)
        assert all(
            np.array_equal(getattr(again, k), getattr(original, k))
            for k in datacache.ARRAYS
            if getattr(original, k) is not None
        )
        assert isinstance(again.x_train, np.memmap) and not again.x_train.flags.writeable


def test_an_edited_cache_file_is_decoded_again_with_a_warning(monkeypatch, caplog):
    original = _client()
    first = datacache.cached({"case": "edited"}, lambda: original)
    path = datacache.entry({"case": "edited"}) / "y_test.npy"
    del first
    _fresh(monkeypatch)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # same size, other bytes, other time
    path.write_bytes(bytes(raw))
    with caplog.at_level("WARNING"):
        again = datacache.cached({"case": "edited"}, lambda: original)
    assert "damaged" in caplog.text and np.array_equal(again.y_test, original.y_test)


def test_a_cache_that_cannot_be_written_costs_speed_not_the_data(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(datacache, "cache_dir", lambda: blocker)  # no folder can be made below a file
    _fresh(monkeypatch)
    original = _client()
    with caplog.at_level("WARNING"):
        got = datacache.cached({"case": "unwritable"}, lambda: original)
    assert got is original and "cannot keep decoded data" in caplog.text


def test_a_write_cut_short_leaves_no_half_entry(monkeypatch):
    _fresh(monkeypatch)
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second array: a Ctrl-C mid-write
            raise KeyboardInterrupt
        return real_save(*args, **kwargs)

    real_save = np.save
    monkeypatch.setattr(datacache.np, "save", interrupted)
    try:
        datacache.cached({"case": "cut"}, _client)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the Ctrl-C did not reach the caller")
    folder = datacache.entry({"case": "cut"})
    assert not folder.exists() and not [p for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}")]
