"""estimax's ``antialias=True`` resize against torchvision's tensor path (torch's antialiased
``interpolate``) and Pillow's, shrinking and enlarging textured uint8 images.

torchvision's ``Resize`` on a PIL image calls Pillow's ``Image.resize`` (what tests/test_skew.py
checks); on a tensor it calls ``torch.nn.functional.interpolate(..., antialias=True)``, on uint8
directly on CPU (bilinear with AVX2, and bicubic), else on float32 rounded back
(torchvision/transforms/v2/functional/_geometry.py, ``resize_image``). torch is not a test
dependency (its CPU wheel is 192 MB, 754 MB installed), so this runs by hand in a venv with torch:

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch --index-url <a CPU index> ...
    PYTHONPATH=. /tmp/tv/bin/python bench/torchvision_resize.py

torchvision itself is not needed (its PyPI wheels are CUDA builds): the tensor path above is
torch's ``interpolate`` on a ``[1, C, H, W]`` tensor, which this calls as torchvision does.
Writes ``bench/results/torchvision_resize.md``.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image

from estimax.data import preprocessing

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = [(40, 90), (64, 48), (89, 61), (120, 160), (300, 200), (333, 500), (480, 640)]
TARGETS = [(32, 32), (24, 30), (17, 23), (224, 224)]
PIL_FILTERS = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}


def textured(height: int, width: int, seed: int) -> np.ndarray:
    """Noise, a sinusoid and 5-pixel checkers: fine detail where aliasing shows."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    image = rng.integers(0, 80, (height, width, 3)).astype(np.float32)
    image[..., seed % 3] += 120 + 60 * np.sin(xx / 7.0 + yy / 11.0)
    image += 40 * (((xx // 5) + (yy // 5)) % 2)[..., None]
    return np.clip(image, 0, 255).astype(np.uint8)


def torch_resize(image: np.ndarray, height: int, width: int, method: str, as_float: bool):
    """torchvision's tensor path: uint8 (or float32 in [0, 1]) through interpolate."""
    tensor = torch.from_numpy(image).permute(2, 0, 1)[None]
    if as_float:
        tensor = tensor.float() / 255
    else:
        tensor = tensor.contiguous(memory_format=torch.channels_last)
    out = torch.nn.functional.interpolate(
        tensor, size=(height, width), mode=method, align_corners=False, antialias=True
    )
    return out[0].permute(1, 2, 0).numpy()


def main() -> None:
    rows = []
    for method in ("bilinear", "bicubic"):
        for shrink in (True, False):
            worst = {"torch uint8": 0.0, "torch float32": 0.0, "Pillow": 0.0, "Pillow-torch": 0.0}
            for i, (h, w) in enumerate(SIZES):
                image = textured(h, w, i)
                for th, tw in TARGETS:
                    if (th <= h and tw <= w) != shrink:
                        continue
                    ours = preprocessing.resize_antialias(image, th, tw, method).astype(np.int32)
                    t8 = torch_resize(image, th, tw, method, False).astype(np.int32)
                    t32 = torch_resize(image, th, tw, method, True)
                    pil = np.asarray(Image.fromarray(image).resize((tw, th), PIL_FILTERS[method]))
                    worst["torch uint8"] = max(worst["torch uint8"], np.abs(ours - t8).max())
                    worst["torch float32"] = max(
                        worst["torch float32"], 255 * np.abs(ours / 255 - t32).max()
                    )
                    worst["Pillow"] = max(worst["Pillow"], np.abs(ours - pil).max())
                    worst["Pillow-torch"] = max(worst["Pillow-torch"], np.abs(pil - t8).max())
            rows.append((method, "shrinking" if shrink else "enlarging", worst))
    lines = [
        "# estimax antialias=True vs torch's antialiased interpolate and Pillow "
        "(bench/torchvision_resize.py)",
        "",
        f"torch {torch.__version__} (CPU: {torch.backends.cpu.get_cpu_capability()}), Pillow "
        f"{Image.__version__}; images {SIZES} to {TARGETS}, textured uint8. Largest difference "
        "in levels of 0..255 (float32: times 255).",
        "",
        "| filter | | vs torch uint8 | vs torch float32 | vs Pillow | Pillow vs torch uint8 |",
        "|---|---|---|---|---|---|",
    ]
    for method, kind, worst in rows:
        lines.append(
            f"| {method} | {kind} | {worst['torch uint8']:.0f} | {worst['torch float32']:.2f} | "
            f"{worst['Pillow']:.0f} | {worst['Pillow-torch']:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(HERE, "results", "torchvision_resize.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
