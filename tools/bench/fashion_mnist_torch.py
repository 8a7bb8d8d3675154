#!/usr/bin/env python3
"""PyTorch side of the Fashion-MNIST seed study (issue 16): kiln-train's ResNet-18 recipe.

    python3 tools/bench/fashion_mnist_torch.py /usr/share/datasets/fashion-mnist --seed 0

Recipe (as `kiln-train --arch resnet18 --data fashion-mnist --epochs 30 -b 128 --lr 0.1
--wd 5e-4 --warmup-epochs 1 --augment`):
- torchvision's ResNet-18 with a 3x3/1 stem and no max pool, 1 input channel, 10 classes;
- SGD lr 0.1, momentum 0.9 (no nesterov), weight decay 5e-4 on conv/linear weights only (kiln's
  split_weight_decay: none on BN parameters and biases; --wd-all decays everything);
- per step: linear warm-up from 0 over the first epoch, then cosine to 0 (kiln's CosineLR);
- batch 128, shuffled each epoch, the last partial batch dropped (468 steps per epoch);
- random crop 28 from the image zero-padded by 4, horizontal flip with p = 0.5;
- normalised with kiln's Fashion-MNIST statistics (mean 0.2860, std 0.3530);
- mixed precision (autocast fp16 + GradScaler, channels_last) unless --amp off;
- evaluation on the 10,000 test images after every epoch, model.eval().

Reads the IDX files (train-images-idx3-ubyte[.gz], ... , t10k-labels-idx1-ubyte[.gz], either
spelling with '-' or '.') from the folder given. Data and augmentation stay on the GPU.
Prints one JSON object per epoch, then a summary object with the final top-1 and the time.
"""
import argparse
import gzip
import json
import math
import os
import struct
import sys
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torchvision
except ImportError as e:
    sys.exit(f"fashion_mnist_torch: needs torch, torchvision ({e}); it runs beside kiln where "
             "PyTorch is installed (the device machine; docs/lab/step-profiles.md)")

MEAN, STD = 0.2860, 0.3530


def read_idx(folder, stem, kind):
    for name in (f"{stem}-{kind}-ubyte", f"{stem}.{kind}-ubyte"):
        for suffix in ("", ".gz"):
            path = os.path.join(folder, name + suffix)
            if os.path.isfile(path):
                opener = gzip.open if suffix else open
                with opener(path, "rb") as f:
                    data = f.read()
                magic, = struct.unpack(">I", data[:4])
                ndim = magic & 0xFF
                if magic >> 8 != 0x08 or ndim < 1:
                    sys.exit(f"{path}: not a u8 IDX file (magic 0x{magic:08x})")
                dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
                body = data[4 + 4 * ndim:]
                if len(body) != math.prod(dims):
                    sys.exit(f"{path}: {len(body)} data bytes for dims {dims}")
                return torch.frombuffer(bytearray(body), dtype=torch.uint8).reshape(dims)
    sys.exit(f"no {stem}-{kind}-ubyte[.gz] in {folder}")


def resnet18_small_stem(num_classes=10):
    m = torchvision.models.resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    return m


def augment(x, gen):
    """x: uint8 (B, 28, 28) on the device -> float (B, 1, 28, 28) cropped, flipped, normalised."""
    b, h, w = x.shape
    pad = 4
    padded = F.pad(x, (pad, pad, pad, pad))  # zeros, as kiln's loader
    top = torch.randint(0, 2 * pad + 1, (b,), device=x.device, generator=gen)
    left = torch.randint(0, 2 * pad + 1, (b,), device=x.device, generator=gen)
    flip = torch.rand(b, device=x.device, generator=gen) < 0.5
    rows = top[:, None] + torch.arange(h, device=x.device)[None, :]  # (B, h)
    cols = left[:, None] + torch.arange(w, device=x.device)[None, :]  # (B, w)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    out = padded[torch.arange(b, device=x.device)[:, None, None], rows[:, :, None], cols[:, None, :]]
    return normalise(out)


def normalise(x):
    return ((x.float() / 255.0 - MEAN) / STD).unsqueeze(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data", help="folder with the Fashion-MNIST IDX files")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--wd-all", action="store_true", help="weight decay on BN and biases too")
    ap.add_argument("--warmup-epochs", type=float, default=1.0)
    ap.add_argument("--amp", choices=["on", "off"], default="on")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    xtr = read_idx(args.data, "train-images", "idx3").to(dev)
    ytr = read_idx(args.data, "train-labels", "idx1").long().to(dev)
    xte = read_idx(args.data, "t10k-images", "idx3").to(dev)
    yte = read_idx(args.data, "t10k-labels", "idx1").long().to(dev)
    if xtr.shape[0] != ytr.shape[0] or xte.shape[0] != yte.shape[0]:
        sys.exit("image and label counts differ")
    if int(ytr.max()) >= 10 or int(yte.max()) >= 10:
        sys.exit("labels outside 0..9")

    amp = args.amp == "on" and dev.type == "cuda"
    mem = torch.channels_last if amp else torch.contiguous_format
    model = resnet18_small_stem().to(dev).to(memory_format=mem)
    decay = [p for p in model.parameters() if args.wd_all or p.dim() > 1]
    no_decay = [p for p in model.parameters() if not (args.wd_all or p.dim() > 1)]
    groups = [{"params": decay, "weight_decay": args.wd}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    opt = torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum, nesterov=False)
    scaler = torch.amp.GradScaler("cuda", enabled=amp)

    steps = xtr.shape[0] // args.batch_size
    total = steps * args.epochs
    warm = round(args.warmup_epochs * steps)

    def lr_at(t):  # kiln's Warmup{warm, 0} + CosineLR(total, 0)
        if t < warm:
            return args.lr * t / warm
        if t >= total:
            return 0.0
        return args.lr * 0.5 * (1 + math.cos(math.pi * (t - warm) / (total - warm)))

    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    history = []
    start = time.time()
    t = 0
    for epoch in range(args.epochs):
        model.train()
        e0 = time.time()
        perm = torch.randperm(xtr.shape[0], device=dev, generator=gen)
        loss_sum = torch.zeros((), device=dev)
        hits = torch.zeros((), device=dev)
        for i in range(steps):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            x = augment(xtr[idx], gen).contiguous(memory_format=mem)
            y = ytr[idx]
            for g in opt.param_groups:
                g["lr"] = lr_at(t)
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                logits = model(x)
                loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            t += 1
            loss_sum += loss.detach().float() * y.shape[0]
            hits += (logits.detach().argmax(1) == y).sum()
        seen = steps * args.batch_size
        train_loss, train_top1 = loss_sum.item() / seen, hits.item() / seen

        model.eval()
        test_loss = test_hits = 0.0
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            for i in range(0, xte.shape[0], 1000):
                x = normalise(xte[i:i + 1000]).contiguous(memory_format=mem)
                logits = model(x).float()
                test_loss += F.cross_entropy(logits, yte[i:i + 1000], reduction="sum").item()
                test_hits += (logits.argmax(1) == yte[i:i + 1000]).sum().item()
        n = xte.shape[0]
        row = {"epoch": epoch + 1, "train_loss": train_loss, "train_top1": train_top1,
               "test_loss": test_loss / n, "test_top1": test_hits / n,
               "lr": opt.param_groups[0]["lr"], "seconds": time.time() - e0}
        history.append(row["test_top1"])
        print(json.dumps(row), flush=True)

    print(json.dumps({"seed": args.seed, "epochs": args.epochs, "amp": amp,
                      "final_test_top1": history[-1], "best_test_top1": max(history),
                      "test_top1_per_epoch": history, "total_seconds": time.time() - start,
                      "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
