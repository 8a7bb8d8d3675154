"""PyTorch's side of `kiln-bench --ops`: the same ResNet-50 layers at the same batch, timed the
same way (5 warm-ups; median of N samples of one call ("single") and of B calls back to back,
divided by B ("b2b"); rates from b2b). Prints the same columns and JSON fields; run in the same
device call as kiln-bench and compare the two tables row by row. Byte counts are kiln's (max
pooling: u8 indices), so GB/s compare as inverse times.

    python3 tools/bench/bench_torch_ops.py [-b 256] [--dtype f16|f32] [--repeat 20] [--back-to-back 10]
                                     [--json out.json]
"""
import argparse
import json
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:
    sys.exit(f"bench_torch_ops: needs torch ({e}); it runs beside kiln where "
             "PyTorch is installed (the device machine; docs/lab/step-profiles.md)")

PEAK_TFLOPS, PEAK_GBPS = 765.0, 4200.0


def median_ms(fn, repeat, calls):
    ts = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / calls)
    ts.sort()
    return ts[len(ts) // 2]


BACK_TO_BACK = 10


def time_ms(fn, repeat):
    """(single, b2b) median ms per call."""
    for _ in range(5):
        fn()
    return median_ms(fn, repeat, 1), median_ms(fn, repeat, BACK_TO_BACK)


def resnet50_convs():
    v = [(3, 64, 7, 2, 224)]
    for cin, mid, out, hw, s in [(64, 64, 256, 56, 1), (256, 128, 512, 56, 2),
                                 (512, 256, 1024, 28, 2), (1024, 512, 2048, 14, 2)]:
        ohw = hw // s
        v += [(cin, mid, 1, 1, hw), (mid, mid, 3, s, hw), (mid, out, 1, 1, ohw),
              (cin, out, 1, s, hw), (out, mid, 1, 1, ohw)]
        if s != 1:
            v.append((mid, mid, 3, 1, ohw))
    return v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-b", type=int, default=256)
    ap.add_argument("--dtype", default="f16", choices=["f16", "f32"])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--back-to-back", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    global BACK_TO_BACK
    BACK_TO_BACK = args.back_to_back
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dt = torch.float16 if args.dtype == "f16" else torch.float32
    es = 2 if args.dtype == "f16" else 4
    dev, cl, N, R = "cuda", torch.channels_last, args.b, args.repeat
    rows = []
    with torch.no_grad():
        for cin, cout, k, s, hw in resnet50_convs():
            pad = k // 2
            out = (hw + 2 * pad - k) // s + 1
            x = torch.randn(N, cin, hw, hw, device=dev, dtype=dt).to(memory_format=cl)
            w = torch.randn(cout, cin, k, k, device=dev, dtype=dt).to(memory_format=cl)
            dy = torch.randn(N, cout, out, out, device=dev, dtype=dt).to(memory_format=cl)
            flops = 2.0 * N * cout * out * out * cin * k * k
            shape = f"{cin}x{hw}x{hw} {k}x{k}/{s} -> {cout}"
            conv = lambda: F.conv2d(x, w, None, s, pad)
            bwd = lambda mask: torch.ops.aten.convolution_backward(
                dy, x, w, None, [s, s], [pad, pad], [1, 1], False, [0, 0], 1, mask)
            rows.append(("conv fwd", shape, time_ms(conv, R), flops, 0))
            rows.append(("conv dgrad", shape, time_ms(lambda: bwd([True, False, False]), R), flops, 0))
            rows.append(("conv wgrad", shape, time_ms(lambda: bwd([False, True, False]), R), flops, 0))
        for ch, hw in [(64, 112), (64, 56), (256, 56), (128, 28), (512, 28), (256, 14), (1024, 14),
                       (512, 7), (2048, 7)]:
            x = torch.randn(N, ch, hw, hw, device=dev, dtype=dt).to(memory_format=cl)
            wgt = torch.ones(ch, device=dev)
            bias, rm, rv = torch.zeros(ch, device=dev), torch.zeros(ch, device=dev), torch.ones(ch, device=dev)
            n = x.numel() * es
            shape = f"{ch}x{hw}x{hw}"
            fwd = lambda: torch.ops.aten.cudnn_batch_norm(x, wgt, bias, rm, rv, True, 0.1, 1e-5)
            y, sm, si, res = fwd()
            bwd = lambda: torch.ops.aten.cudnn_batch_norm_backward(x, y, wgt, rm, rv, sm, si, 1e-5, res)
            rows.append(("bn fwd", shape, time_ms(fwd, R), 0, 2 * n))
            rows.append(("bn bwd", shape, time_ms(bwd, R), 0, 3 * n))
        x = torch.randn(N, 64, 112, 112, device=dev, dtype=dt).to(memory_format=cl)
        y, idx = F.max_pool2d(x, 3, 2, 1, return_indices=True)
        n = (x.numel() + y.numel()) * es + y.numel()  # + kiln's u8 indices
        rows.append(("maxpool fwd", "64x112x112 3x3/2", time_ms(lambda: F.max_pool2d(x, 3, 2, 1), R), 0, n))
        rows.append(("maxpool bwd", "64x112x112 3x3/2", time_ms(
            lambda: torch.ops.aten.max_pool2d_with_indices_backward(y, x, [3, 3], [2, 2], [1, 1], [1, 1], False, idx), R),
            0, n))
        x = torch.randn(N, 2048, 7, 7, device=dev, dtype=dt).to(memory_format=cl)
        y = F.adaptive_avg_pool2d(x, 1)
        n = (x.numel() + y.numel()) * es
        rows.append(("avgpool fwd", "2048x7x7", time_ms(lambda: F.adaptive_avg_pool2d(x, 1), R), 0, n))
        rows.append(("avgpool bwd", "2048x7x7", time_ms(
            lambda: torch.ops.aten._adaptive_avg_pool2d_backward(y, x), R), 0, n))
        x = torch.randn(N, 2048, device=dev, dtype=dt)
        w = torch.randn(1000, 2048, device=dev, dtype=dt)
        b = torch.randn(1000, device=dev, dtype=dt)
        dy = torch.randn(N, 1000, device=dev, dtype=dt)
        fl = 2.0 * N * 2048 * 1000
        rows.append(("linear fwd", "2048 -> 1000", time_ms(lambda: F.linear(x, w, b), R), fl, 0))
        rows.append(("linear bwd", "2048 -> 1000", time_ms(
            lambda: (dy @ w, dy.t() @ x, dy.sum(0)), R), 2 * fl, 0))
    logits = torch.randn(N, 1000, device=dev, dtype=dt, requires_grad=True)
    target = torch.randint(0, 1000, (N,), device=dev)

    def ce():
        loss = F.cross_entropy(logits, target)
        loss.backward()
    rows.append(("softmax-CE fwd+bwd", "1000 classes", time_ms(ce, R), 0, 2 * logits.numel() * es))

    print(f"{'op':20s} {'shape':28s} {'single ms':>10s} {'b2b ms':>10s} {'TFLOP/s':>10s} {'% peak':>8s}")
    out = []
    for op, shape, (ms, ms_b2b), flops, bytes_ in rows:
        def rate_of(t):
            return flops / (t * 1e-3) / 1e12 if flops else bytes_ / (t * 1e-3) / 1e9
        peak = PEAK_TFLOPS if flops else PEAK_GBPS
        rate, rate1 = rate_of(ms_b2b), rate_of(ms)
        unit = "" if flops else " GB/s"
        key = "tflops" if flops else "gbps"
        print(f"{op:20s} {shape:28s} {ms:10.4f} {ms_b2b:10.4f} {rate:10.1f}{unit} {100 * rate / peak:6.1f}%")
        out.append({"op": op, "shape": shape, "ms": ms, key: rate1, "pct_peak": 100 * rate1 / peak,
                    "ms_b2b": ms_b2b, key + "_b2b": rate, "pct_peak_b2b": 100 * rate / peak,
                    "b2b_calls": BACK_TO_BACK})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
