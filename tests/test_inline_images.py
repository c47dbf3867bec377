"""A report's plots travel inside its Prefect artifact as `data:` URIs, small enough to load."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
from PIL import Image

from jex.tasks.outputs.inline_images import inline_images


def _png(path, width: int, height: int) -> bytes:
    """A noise PNG (it does not compress), written to `path`."""
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format="PNG")
    return path.read_bytes()


def _inlined(markdown: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r"\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown)]


def test_a_small_plot_is_inlined_byte_for_byte_and_a_missing_one_left_as_a_link(tmp_path):
    small = _png(tmp_path / "skill.png", 40, 30)
    out = inline_images("# R\n\n![per-catalog skill](skill.png)\n\n![gone](gone.png)\n", tmp_path)
    assert _inlined(out) == [small]
    assert "](skill.png)" not in out and "![gone](gone.png)" in out


def test_a_large_plot_is_downscaled_below_the_limit_for_the_artifact_only(tmp_path):
    big = _png(tmp_path / "skill.png", 800, 600)  # ~1.4 MB of noise
    [inlined] = _inlined(inline_images("![skill](skill.png)", tmp_path, max_bytes=300_000))
    image = Image.open(io.BytesIO(inlined))
    assert len(inlined) <= 300_000 and image.format == "PNG" and image.width < 800
    assert image.width * 600 == image.height * 800  # the aspect ratio is kept
    assert (tmp_path / "skill.png").read_bytes() == big  # the run folder keeps the full plot
