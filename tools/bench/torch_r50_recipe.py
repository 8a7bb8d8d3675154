"""PyTorch's side of kiln-train's ResNet-50 ImageFolder recipe, step by step: whether the early
loss spike kiln's runs show (docs/lab/norm-conv.md, v25) is the recipe's or kiln's.

Trains torchvision's resnet50 (random init, no zero-init of the residual BNs: kiln-train's
--arch resnet50) on ROOT/train with what kiln-train does for an ImageFolder: RandomResizedCrop
(image size) + horizontal flip, ImageNet mean and std, batch 128, SGD momentum 0.9 with weight
decay on every parameter, a linear warm-up from 0 over --warmup-epochs then cosine to 0 over
--epochs, label smoothing, AMP f16 with a dynamic loss scale, channels-last. Runs --steps steps
and prints the losses at the steps tools/device/step_trace.sh prints, and the highest loss of the
first 300 steps. Needs torch and torchvision (the GPU machine has them):
  python3 tools/bench/torch_r50_recipe.py /tmp/imn112 --seeds 0,1,2 --steps 300
"""
import argparse
import math
import sys

try:
    import torch
    import torch.nn as nn
    import torchvision
    from torchvision import transforms as T
except ImportError as e:
    sys.exit(f"torch_r50_recipe: needs torch, torchvision ({e}); it runs beside kiln where "
             "PyTorch is installed (the device machine; docs/lab/step-profiles.md)")

p = argparse.ArgumentParser()
p.add_argument("root")
p.add_argument("--steps", type=int, default=300)
p.add_argument("--seeds", default="0")
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--wd", type=float, default=5e-4)
p.add_argument("--warmup-epochs", type=float, default=1.0)
p.add_argument("--epochs", type=int, default=30)
p.add_argument("--image-size", type=int, default=112)
p.add_argument("--label-smoothing", type=float, default=0.1)
p.add_argument("--workers", type=int, default=16)
p.add_argument("--zero-init-residual", action="store_true",
               help="each block's last BN weight starts at 0 (torchvision's option)")
a = p.parse_args()

tf = T.Compose([T.RandomResizedCrop(a.image_size), T.RandomHorizontalFlip(), T.PILToTensor()])
ds = torchvision.datasets.ImageFolder(f"{a.root}/train", tf)
bs = 128
steps_per_epoch = len(ds) // bs
warmup = round(a.warmup_epochs * steps_per_epoch)
total = a.epochs * steps_per_epoch
mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255


def lr_at(step):  # step counts from 0; optim::LRSchedule's factor (the first step's rate is 0)
    if step < warmup:
        return a.lr * step / warmup
    t = (step - warmup) / max(1, total - warmup)
    return a.lr * 0.5 * (1 + math.cos(math.pi * t))


shown = [0, 1, 2, 3, 4, 5, 7, 10, 15, 20, 30, 50, 72, 100, 145, 200, 300]
runs = {}
for seed in [int(s) for s in a.seeds.split(",")]:
    torch.manual_seed(seed)
    dl = torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=True, num_workers=a.workers,
                                     pin_memory=True, drop_last=True, persistent_workers=False)
    m = torchvision.models.resnet50(num_classes=len(ds.classes),
                                  zero_init_residual=a.zero_init_residual).cuda()
    m = m.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), lr=a.lr, momentum=0.9, weight_decay=a.wd)
    scaler = torch.amp.GradScaler("cuda")
    crit = nn.CrossEntropyLoss(label_smoothing=a.label_smoothing)
    losses = []
    while len(losses) < a.steps:
        for x, y in dl:
            for g in opt.param_groups:
                g["lr"] = lr_at(len(losses))
            x = ((x.cuda(non_blocking=True).float() - mean) / std).contiguous(
                memory_format=torch.channels_last)
            with torch.autocast("cuda", torch.float16):
                loss = crit(m(x), y.cuda(non_blocking=True))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            if len(losses) >= a.steps:
                break
    runs[seed] = losses
    early = losses[:300]
    k = max(range(len(early)), key=lambda j: early[j])
    print(f"torch seed {seed} (lr {a.lr}, warm-up {a.warmup_epochs} epochs"
          f"{', zero-init residual' if a.zero_init_residual else ''}): early peak loss {early[k]:.2f} at step {k + 1} "
          f"(lr {lr_at(k):.4f}); loss at step {len(losses)} {losses[-1]:.4f}", flush=True)

names = sorted(runs)
print("step " + " ".join(f"{'torch-' + str(n):>14}" for n in names))
for i in shown:
    if all(i < len(runs[n]) for n in names):
        print(f"{i + 1:4d} " + " ".join(f"{runs[n][i]:14.7f}" for n in names))
