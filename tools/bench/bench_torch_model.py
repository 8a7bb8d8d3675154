"""PyTorch's side of `kiln-bench --model resnet50`: torchvision ResNet-50 training steps on
synthetic data, eager, AMP (fp16 autocast + GradScaler), channels_last, SGD momentum — the
configuration ../shared/bench/torch_resnet50.py calls eager_amp16_cl, timed the same way
(warm-up steps, then CUDA events around a run of steps). Run it in the same device call as
kiln-bench and report the ratio.

    python3 tools/bench/bench_torch_model.py [--batches 64,128,256] [--iters 40] [--warmup 15]
"""
import argparse
import json
import sys

try:
    import torch
    import torch.nn as nn
    import torchvision
except ImportError as e:
    sys.exit(f"bench_torch_model: needs torch, torchvision ({e}); it runs beside kiln where "
             "PyTorch is installed (the device machine; docs/lab/step-profiles.md)")


def bench(batch, iters, warm):
    torch.manual_seed(0)
    dev, cl = "cuda", torch.channels_last
    model = torchvision.models.resnet50().to(dev).to(memory_format=cl)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
    scaler = torch.amp.GradScaler("cuda")
    crit = nn.CrossEntropyLoss()
    x = torch.randn(batch, 3, 224, 224, device=dev).to(memory_format=cl)
    y = torch.randint(0, 1000, (batch,), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = crit(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(iters):
        step()
    e.record()
    torch.cuda.synchronize()
    ms = s.elapsed_time(e) / iters
    return {"batch": batch, "step_ms": round(ms, 2), "images_per_s": round(batch / ms * 1e3, 1),
            "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=15)
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    print(torch.__version__, torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version())
    for b in (int(v) for v in args.batches.split(",")):
        r = bench(b, args.iters, args.warmup)
        print(f"torch eager amp channels_last batch {b:4d}  {r['step_ms']:8.2f} ms/step  "
              f"{r['images_per_s']:8.0f} img/s  peak {r['peak_GiB']:.2f} GiB  {json.dumps(r)}",
              flush=True)


if __name__ == "__main__":
    main()
