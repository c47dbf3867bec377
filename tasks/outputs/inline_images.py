"""A report's plots inlined as `data:` URIs for its Prefect artifact: the UI shows the Markdown it is
given and cannot open the run folder's `skill.png`, so a relative link there is a broken image."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

MAX_INLINE_PNG_BYTES = 300_000
"""A plot above this is downscaled for the artifact (the run folder keeps the full one): a wide
per-catalog plot of a large suite would otherwise make every load of the artifact megabytes."""

_IMAGE = re.compile(r"!\[([^\]]*)\]\(([\w@.-]+\.png)\)")
"""A Markdown image whose target is a PNG file name in the report's folder."""


def inline_images(markdown: str, folder: Path, *, max_bytes: int = MAX_INLINE_PNG_BYTES) -> str:
    """The Markdown with each image link to a PNG in `folder` replaced by the image as a base64
    `data:image/png` URI (downscaled to at most `max_bytes`); a link to a missing file is left as is."""

    def inline(m: re.Match[str]) -> str:
        png = folder / m[2]
        if not png.is_file():
            return m[0]
        data = base64.b64encode(png_at_most(png.read_bytes(), max_bytes)).decode()
        return f"![{m[1]}](data:image/png;base64,{data})"

    return _IMAGE.sub(inline, markdown)


def png_at_most(png: bytes, max_bytes: int) -> bytes:
    """The PNG as is when it fits in `max_bytes`, else halved in width and height until it does (or is
    64 px wide: a plot smaller than that shows nothing)."""
    if len(png) <= max_bytes:
        return png
    from PIL import Image

    image: Image.Image = Image.open(io.BytesIO(png))
    while len(png) > max_bytes and image.width > 64:
        image = image.resize((max(image.width // 2, 1), max(image.height // 2, 1)), Image.Resampling.LANCZOS)
        out = io.BytesIO()
        image.save(out, format="PNG", optimize=True)
        png = out.getvalue()
    return png
