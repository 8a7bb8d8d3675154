"""Weights move both ways between torchvision and kiln through safetensors files.

    python3 tools/check_torch_interop.py [--kiln-convert build/kiln-convert] [--arch resnet50]

Needs torch, torchvision and safetensors (the GPU machine has them; without them it prints SKIPPED
and exits 77, which ctest reports as skipped: tests torch_interop_resnet50, torch_interop_vit_b_16).
--arch is any torchvision ResNet or vit_b_16. Steps:
  1. build torchvision's model from a seed, give every BatchNorm non-trivial statistics and
     counters, save its state_dict with safetensors.torch.save_file;
  2. kiln-convert loads it into kiln's model (strict), writes it back with save_weights and runs
     the model in eval mode on the CPU on a random input;
  3. the written file must load into a fresh torchvision model with strict=True, every tensor equal
     (values, dtype, shape) to the original, and kiln's logits must match torchvision's;
  4. a file with one key removed must make kiln-convert fail, naming the key.
Prints one PASS/FAIL line per check; exits 1 if any check fails.
"""
import argparse
import os
import subprocess
import sys
import tempfile

try:
    import torch
    import torchvision
    from safetensors.torch import load_file, save_file
except ImportError as e:  # CI and machines without PyTorch: ctest reports the test skipped
    print(f"SKIPPED: {e}")
    sys.exit(77)

failures = 0


def report(ok, what):
    global failures
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    failures += 0 if ok else 1


def torchvision_model(arch, seed, num_classes):
    torch.manual_seed(seed)
    model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
    with torch.no_grad():
        if arch.startswith("vit"):
            # torchvision starts the head at zero and the class token at zero: every logit would
            # be 0 and compare equal whatever kiln computed. Draw them.
            model.heads.head.weight.normal_(0, 0.05)
            model.heads.head.bias.uniform_(-0.1, 0.1)
            model.class_token.normal_(0, 0.5)
            for m in model.modules():
                if isinstance(m, torch.nn.LayerNorm):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.2, 0.2)
        # Default BN state (weight 1, bias 0, mean 0, var 1, count 0) would hide swapped buffers.
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
                m.num_batches_tracked.fill_(int(torch.randint(1, 10000, ())))
    return model.eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kiln-convert", default="build/kiln-convert")
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--rtol", type=float, default=1e-3,
                    help="logit tolerance, relative to the largest |logit|")
    ap.add_argument("--rel-l2", type=float, default=1e-5,
                    help="bound on ||kiln - torch|| / ||torch|| over the logits (f32)")
    args = ap.parse_args()

    model = torchvision_model(args.arch, args.seed, args.num_classes)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    x = torch.randn(args.batch, 3, args.size, args.size)

    with tempfile.TemporaryDirectory(prefix="kiln_interop_") as tmp:
        a, b = os.path.join(tmp, "torch.safetensors"), os.path.join(tmp, "kiln.safetensors")
        xin, yout = os.path.join(tmp, "x.safetensors"), os.path.join(tmp, "y.safetensors")
        save_file(sd, a)
        save_file({"x": x}, xin)
        cmd = [args.kiln_convert, "--arch", args.arch, "--num-classes", str(args.num_classes),
               "--in", a, "--out", b, "--eval-input", xin, "--eval-output", yout]
        run = subprocess.run(cmd, capture_output=True, text=True)
        sys.stdout.write(run.stdout)
        report(run.returncode == 0,
               f"kiln-convert exit status {run.returncode} {run.stderr.strip()}")
        if run.returncode != 0:
            return 1
        back = load_file(b)
        logits_kiln = {"cpu": load_file(yout)["logits"]}
        if torch.cuda.is_available():  # the same weights and input through kiln's CUDA backend
            run = subprocess.run(cmd + ["--eval-device", "cuda"], capture_output=True, text=True)
            report(run.returncode == 0,
                   f"kiln-convert --eval-device cuda exit status {run.returncode} "
                   f"{run.stderr.strip()}")
            if run.returncode == 0:
                logits_kiln["cuda"] = load_file(yout)["logits"]

        # A strict load refuses a file with a key missing and names it.
        dropped = ("encoder.layers.encoder_layer_3.ln_2.weight" if args.arch.startswith("vit")
                   else "layer2.0.downsample.1.running_var")
        save_file({k: v for k, v in sd.items() if k != dropped}, a)
        run = subprocess.run([args.kiln_convert, "--arch", args.arch, "--num-classes",
                              str(args.num_classes), "--in", a, "--out",
                              os.path.join(tmp, "refused.safetensors")],
                             capture_output=True, text=True)
        report(run.returncode != 0 and dropped in run.stderr,
               f"kiln-convert refuses a file without '{dropped}': exit status {run.returncode},"
               f" {run.stderr.strip()[:300]}")

    report(set(back) == set(sd),
           f"key set: {len(back)} in kiln's file, {len(sd)} in torchvision's state_dict"
           f" (missing {sorted(set(sd) - set(back))[:5]}, extra {sorted(set(back) - set(sd))[:5]})")
    bad = [k for k in sd if k in back and not (back[k].dtype == sd[k].dtype and
                                               back[k].shape == sd[k].shape and
                                               torch.equal(back[k], sd[k]))]
    report(not bad, f"every tensor equal in value, dtype and shape ({len(bad)} differ: {bad[:5]})")

    fresh = getattr(torchvision.models, args.arch)(weights=None, num_classes=args.num_classes)
    try:
        fresh.load_state_dict(back, strict=True)
        report(True, "torchvision load_state_dict(strict=True) of kiln's file")
    except Exception as e:  # noqa: BLE001 - report any failure as FAIL
        report(False, f"torchvision load_state_dict(strict=True) of kiln's file: {e}")
    fresh.eval()

    with torch.no_grad():
        ref = model(x)
        again = fresh(x)
    report(torch.equal(ref, again), "reloaded torchvision model gives identical logits")
    scale = ref.abs().max().item()
    for where, logits in logits_kiln.items():
        same = logits.shape == ref.shape
        diff = (logits - ref).abs().max().item() if same else float("inf")
        rel = ((logits.double() - ref.double()).norm() / ref.double().norm()).item() if same \
            else float("inf")
        report(diff <= args.rtol * max(scale, 1.0) and rel <= args.rel_l2,
               f"kiln eval logits on {where} {tuple(logits.shape)} vs torchvision: max |diff| "
               f"{diff:.3g}, max |logit| {scale:.3g}, relative L2 {rel:.3g} (bounds: "
               f"{args.rtol:g} x max(1, max |logit|), {args.rel_l2:g})")

    print("PASS all checks" if failures == 0 else f"FAIL {failures} check(s)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
