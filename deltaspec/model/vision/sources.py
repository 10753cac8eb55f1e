"""Where a request's images come from, as encoded bytes (what the engine decodes, hashes for the prefix cache and
sends to other ranks): bytes as they are, a Pillow image as PNG, a `data:` URL decoded, and a local file (a path,
or a `file://` URL) only under the directory the operator allowed (`allowed_local_media_path`, as vLLM names it).
Nothing is ever fetched from the network.

Chat messages carry images as content parts: OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` (or the
URL alone), and `{"type": "image", "image": ...}` as transformers' and vLLM's Python APIs write them. The chat
templates of the multimodal checkpoints put one `<|vision_start|><|image_pad|><|vision_end|>` where each such part
is, so the images are taken in the order of their parts."""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from urllib.parse import unquote, urlparse

from deltaspec.errors import DeltaspecError

IMAGE_PART_TYPES = ("image_url", "image")


def image_bytes(source, local_root: str | None = None) -> bytes:
    """The encoded image `source` names (see the module docstring); one sentence for anything else."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if hasattr(source, "save") and hasattr(source, "size"):  # a Pillow image
        buffer = io.BytesIO()
        source.save(buffer, format="PNG")
        return buffer.getvalue()
    if isinstance(source, Path):
        return _local_file(source, local_root)
    if not isinstance(source, str):
        raise DeltaspecError(
            f"An image is bytes, a Pillow image, a data: URL or an allowed local file, not {type(source).__name__}."
        )
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if not header.endswith(";base64"):
            raise DeltaspecError("An image data: URL must be base64-encoded (data:image/png;base64,...).")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise DeltaspecError("The image data: URL does not hold valid base64.") from None
    url = urlparse(source)
    if url.scheme in ("http", "https"):
        raise DeltaspecError("deltaspec does not fetch images from the network; send the image inline as a data: URL.")
    if url.scheme == "file":
        return _local_file(Path(unquote(url.path)), local_root)
    if url.scheme == "" and source:
        return _local_file(Path(source), local_root)
    raise DeltaspecError(f"Images come as data: URLs or allowed local files; {url.scheme}: URLs are not read.")


def _local_file(path: Path, local_root: str | None) -> bytes:
    if local_root is None:
        raise DeltaspecError(
            "Local image files are read only under the directory given by --allowed-local-media-path; send the image "
            "as a data: URL instead."
        )
    root, resolved = Path(local_root).resolve(), path.resolve()
    if not resolved.is_relative_to(root):
        raise DeltaspecError(f"The image file {path} lies outside the allowed local media path {root}.")
    if not resolved.is_file():
        raise DeltaspecError(f"The image file {path} does not exist.")
    return resolved.read_bytes()


def part_image(part: dict):
    """The image a content part names (its URL, or the object itself), or None for a part of another type."""
    kind = part.get("type")
    if kind == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    if kind == "image":
        return part.get("image", part.get("url"))
    return None


def message_images(messages: list[dict], local_root: str | None = None) -> list[bytes]:
    """The images of the messages' content parts, in order, as encoded bytes."""
    images = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                source = part_image(part)
                if source is None:
                    raise DeltaspecError(f"An {part['type']} content part names no image; give its URL or data.")
                images.append(image_bytes(source, local_root))
    return images
