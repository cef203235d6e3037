"""PerFed-CKT's public unlabeled set P when no node config names a folder: which dataset it
is drawn from (`public-dataset`), and whether it shows every cluster's view of a covariate
shift (`public-shift`). The server and every node build it with this one function, so their
fingerprints agree; only numpy here, torch only when images are resized or rotated."""

from __future__ import annotations

import re

import numpy as np

from florist.common import data as data_lib
from florist.common import scenarios

SAME = "same"
PUBLIC_DATASETS = (
    "'same' (samples of the clients' own embedded dataset that no client owns), 'digits' or 'mnist5k' "
    "(resized to the clients' input shape)"
)
PUBLIC_SHIFTS = ("clients", "none")


def parse(text: str) -> str:
    """`same`, an embedded dataset's name, or `hub` for a dataset id or folder (kept for a later
    version: P from the hub is given per node with `public-dir` today); a ValueError otherwise."""
    if text == SAME or text in data_lib.EMBEDDED_SHAPES:
        return text
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text):
        return "hub"
    raise ValueError(f"public-dataset {text!r} is not one of {PUBLIC_DATASETS}")


def checks(text: str, shift: str) -> list[tuple[bool, str]]:
    """The settings' validation, for `CktSettings.checks`."""
    try:
        known = parse(text) != "hub"
    except ValueError as err:
        return [(False, str(err))]
    return [
        (known, f"public-dataset {text!r}: a hub id is not read as P yet; put its images in public-dir on each node"),
        (shift in PUBLIC_SHIFTS, f"public-shift must be one of {', '.join(PUBLIC_SHIFTS)}, got {shift!r}"),
    ]


def public_set(cfg, input_shape: tuple[int, ...]) -> np.ndarray:
    """P for run config `cfg` whose clients hold samples of `input_shape`: `public-size`
    samples of `public-dataset` (`same`: the clients' own dataset, none of them owned by a
    client), and under `shift = rotate:K` with `public-shift = clients` dealt into K groups,
    group k rotated as cluster k's images are, so P holds every cluster's view."""
    text = parse(cfg.settings.public_dataset)
    if text in (SAME, cfg.dataset):
        x = scenarios.public_set(cfg)
    else:
        x = data_lib.embedded_public(cfg.public_size, cfg.seed, text, shape=input_shape)
    if x.shape[1:] != tuple(input_shape):
        raise ValueError(f"the public set P has samples of shape {x.shape[1:]}, the clients' data {input_shape}")
    kind, clusters = scenarios.parse_shift(cfg.shift)
    if kind != "rotate" or cfg.settings.public_shift == "none" or clusters == 1:
        return x
    views = [scenarios.rotate(x[k::clusters], k * 360.0 / clusters) for k in range(clusters)]
    out = np.empty_like(views[0], shape=x.shape)
    for k, view in enumerate(views):
        out[k::clusters] = view
    return out
