#!/usr/bin/env python3
"""Writes CIFAR-10 as an ImageFolder (train/<class>/*.jpg, test/<class>/*.jpg) into the two
files the airbench anchor scripts read: OUT/train.pt and OUT/test.pt, each a dict of
"images" (uint8 N x 32 x 32 x 3, RGB), "labels" (int64 N) and "classes" (sorted folder names,
the order kiln's ImageFolder uses). Files are decoded with PIL, in sorted order.

    python3 tools/bench/cifar10_to_pt.py /tmp/cifar10 /tmp/airbench/cifar10
"""
import os
import sys
from multiprocessing import Pool

try:
    import numpy as np
    import torch
    from PIL import Image
except ImportError as e:
    sys.exit(f"cifar10_to_pt: needs numpy, torch, Pillow ({e}); it runs beside kiln where "
             "PyTorch is installed (the device machine; docs/lab/step-profiles.md)")


def decode(path):
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def split(root, pool):
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    paths, labels = [], []
    for label, c in enumerate(classes):
        names = sorted(n for n in os.listdir(os.path.join(root, c))
                       if n.lower().endswith((".jpg", ".jpeg", ".png")))
        paths += [os.path.join(root, c, n) for n in names]
        labels += [label] * len(names)
    images = np.stack(pool.map(decode, paths, chunksize=256))
    if images.shape[1:] != (32, 32, 3):
        sys.exit(f"{root}: images are {images.shape[1:]}, not 32 x 32 x 3")
    return {"images": torch.from_numpy(images), "labels": torch.tensor(labels),
            "classes": classes}


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    with Pool(os.cpu_count()) as pool:
        for name, folder in (("train", "train"), ("test", "test")):
            d = split(os.path.join(src, folder), pool)
            torch.save(d, os.path.join(out, name + ".pt"))
            print(f"{name}: {len(d['labels'])} images, {len(d['classes'])} classes")


if __name__ == "__main__":
    main()
