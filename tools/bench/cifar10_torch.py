#!/usr/bin/env python3
"""PyTorch side of kiln-train on small photos (CIFAR-10 as an ImageFolder): the same recipe.

    python3 tools/bench/cifar10_torch.py cifar10/ --seed 0 --epochs 15 --batch-size 256 \
        --lr 0.1 --warmup-epochs 1 --label-smoothing 0.1

is `kiln-train cifar10/ -a resnet18 --epochs 15 -b 256 --lr 0.1 --warmup-epochs 1
--label-smoothing 0.1 --seed 0`:
- torchvision's ResNet-18 with a 3x3/1 stem and no max pool, 3 input channels, one class per
  folder of train/ (sorted names, as kiln's ImageFolder); or with --arch vit_t_4 torchvision's
  VisionTransformer in kiln's vit_t_4 shape (32x32 images, 4x4 patches, 12 layers, 3 heads,
  hidden 192, MLP 768), which kiln-train -a vit_t_4 trains with AdamW (--optimizer adamw) and
  gradient clipping (--clip-grad);
- every image decoded once (PIL, all cores) into memory at its own size, then kept on the GPU;
- normalised by the training set's per-channel mean and standard deviation (kiln's
  channel_stats);
- per step: random crop of the image zero-padded by 4, horizontal flip with p = 0.5 (on the GPU);
- SGD momentum 0.9 (no nesterov) or AdamW (betas 0.9, 0.999, eps 1e-8), weight decay on
  weights of more than one dimension only (not on biases, norms, a ViT's class token and
  position embedding), gradient clipping by global norm when --clip-grad > 0, linear warm-up from 0
  over --warmup-epochs (kiln-train's default 0.05), then cosine to 0, per step;
- cross-entropy with --label-smoothing; batch shuffled each epoch, last partial batch dropped;
- mixed precision (autocast fp16 + GradScaler, channels_last); --compile for torch.compile;
- evaluation on test/ (or val/) after every epoch, model.eval(), batch 1000.

Prints one JSON object per epoch, then a summary with the final top-1, the set-up time (decoding)
and the total time from the start of main().
"""
import argparse
import json
import math
import os
import sys
import time
from multiprocessing import Pool

try:
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torchvision
    from PIL import Image
except ImportError as e:
    sys.exit(f"cifar10_torch: needs numpy, torch, torchvision, Pillow ({e}); it runs beside kiln where "
             "PyTorch is installed (the device machine; docs/lab/step-profiles.md)")

EXTENSIONS = (".jpg", ".jpeg", ".png")


def list_folder(root, classes=None):
    """(paths, labels, classes) of an ImageFolder, in kiln's order (sorted classes and files)."""
    if classes is None:
        classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    paths, labels = [], []
    for label, c in enumerate(classes):
        files = []
        for dirpath, _, names in os.walk(os.path.join(root, c)):
            files += [os.path.join(dirpath, n) for n in names if n.lower().endswith(EXTENSIONS)]
        files.sort()
        paths += files
        labels += [label] * len(files)
    return paths, labels, classes


def decode(path):
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def load(root, classes, pool):
    paths, labels, classes = list_folder(root, classes)
    if not paths:
        sys.exit(f"{root}: no images")
    images = pool.map(decode, paths, chunksize=256)
    sizes = {im.shape for im in images}
    if len(sizes) != 1:
        sys.exit(f"{root}: images of several sizes {sorted(sizes)[:4]}; this script wants one")
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()  # (N, 3, S, S) u8
    return x, torch.tensor(labels, dtype=torch.long), classes


def resnet18_small_stem(num_classes):
    m = torchvision.models.resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    return m


def vit_t_4(num_classes, image_size):
    return torchvision.models.VisionTransformer(image_size=image_size, patch_size=4, num_layers=12,
                                                num_heads=3, hidden_dim=192, mlp_dim=768,
                                                num_classes=num_classes)


def main():
    start = time.time()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data", help="ImageFolder root holding train/ and test/ (or val/)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--warmup-epochs", type=float, default=0.05)
    ap.add_argument("--label-smoothing", type=float, default=0.0)
    ap.add_argument("--arch", choices=("resnet18", "vit_t_4"), default="resnet18")
    ap.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    ap.add_argument("--clip-grad", type=float, default=0.0)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    dev = torch.device("cuda")
    test_dir = os.path.join(args.data, "val")
    if not os.path.isdir(test_dir):
        test_dir = os.path.join(args.data, "test")
    with Pool(args.workers) as pool:
        xtr, ytr, classes = load(os.path.join(args.data, "train"), None, pool)
        xte, yte, _ = load(test_dir, classes, pool)
    xtr, ytr, xte, yte = xtr.to(dev), ytr.to(dev), xte.to(dev), yte.to(dev)
    f = xtr.float() / 255.0
    mean = f.mean(dim=(0, 2, 3)).view(1, 3, 1, 1)
    std = f.std(dim=(0, 2, 3), unbiased=False).view(1, 3, 1, 1)
    del f
    setup_seconds = time.time() - start

    def normalise(x):
        return ((x.float() / 255.0 - mean) / std).contiguous(memory_format=torch.channels_last)

    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)

    def augment(x):
        b, _, h, w = x.shape
        pad = 4
        padded = F.pad(x, (pad, pad, pad, pad))
        top = torch.randint(0, 2 * pad + 1, (b,), device=dev, generator=gen)
        left = torch.randint(0, 2 * pad + 1, (b,), device=dev, generator=gen)
        flip = torch.rand(b, device=dev, generator=gen) < 0.5
        rows = top[:, None] + torch.arange(h, device=dev)[None, :]
        cols = left[:, None] + torch.arange(w, device=dev)[None, :]
        cols = torch.where(flip[:, None], cols.flip(1), cols)
        idx = torch.arange(b, device=dev)[:, None, None, None]
        ch = torch.arange(3, device=dev)[None, :, None, None]
        return normalise(padded[idx, ch, rows[:, None, :, None], cols[:, None, None, :]])

    if args.arch == "vit_t_4":
        model = vit_t_4(len(classes), xtr.shape[-1]).to(dev)
    else:
        model = resnet18_small_stem(len(classes)).to(dev).to(memory_format=torch.channels_last)
    exempt = {"class_token", "encoder.pos_embedding"}
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() > 1 and n not in exempt]
    no_decay = [p for n, p in named if p.dim() <= 1 or n in exempt]
    groups = [{"params": decay, "weight_decay": args.wd},
              {"params": no_decay, "weight_decay": 0.0}]
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, fused=True)
    else:
        opt = torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum, nesterov=False)
    scaler = torch.amp.GradScaler("cuda")
    net = torch.compile(model) if args.compile else model

    steps = xtr.shape[0] // args.batch_size
    total = steps * args.epochs
    warm = round(args.warmup_epochs * steps)

    def lr_at(t):
        if t < warm:
            return args.lr * t / warm
        if t >= total:
            return 0.0
        return args.lr * 0.5 * (1 + math.cos(math.pi * (t - warm) / (total - warm)))

    history = []
    t = 0
    for epoch in range(args.epochs):
        model.train()
        e0 = time.time()
        perm = torch.randperm(xtr.shape[0], device=dev, generator=gen)
        loss_sum = torch.zeros((), device=dev)
        hits = torch.zeros((), device=dev)
        for i in range(steps):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            x, y = augment(xtr[idx]), ytr[idx]
            for g in opt.param_groups:
                g["lr"] = lr_at(t)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = net(x)
                loss = F.cross_entropy(logits, y, label_smoothing=args.label_smoothing)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if args.clip_grad > 0:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(opt)
            scaler.update()
            t += 1
            loss_sum += loss.detach().float()
            hits += (logits.detach().argmax(1) == y).sum()
        train_loss, train_top1 = loss_sum.item() / steps, hits.item() / (steps * args.batch_size)

        model.eval()
        test_hits = 0
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for i in range(0, xte.shape[0], 1000):
                logits = net(normalise(xte[i:i + 1000]))
                test_hits += (logits.argmax(1) == yte[i:i + 1000]).sum().item()
        row = {"epoch": epoch + 1, "train_loss": train_loss, "train_top1": train_top1,
               "test_top1": test_hits / xte.shape[0], "seconds": time.time() - e0}
        history.append(row["test_top1"])
        print(json.dumps(row), flush=True)

    print(json.dumps({"seed": args.seed, "epochs": args.epochs, "arch": args.arch,
                      "optimizer": args.optimizer, "compile": args.compile,
                      "final_test_top1": history[-1], "setup_seconds": setup_seconds,
                      "total_seconds": time.time() - start, "torch": torch.__version__}),
          flush=True)


if __name__ == "__main__":
    main()
