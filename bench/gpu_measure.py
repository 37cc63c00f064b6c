"""Single-GPU measurements for the cost model (run by bench/gpu_check.sh when a GPU is lent).

    python bench/gpu_measure.py --out OUT.json [--calibration-out CAL.yaml] [--quick]

With --calibration-out it also writes a plait calibration file (format v1) for this GPU: the
bf16 GEMM grid (`gemm_measured`), the copy engine's device-to-device bandwidth, and the GEMM
slowdowns beside copy-engine and SM copies (`gemm_slowdown_dma`, `gemm_slowdown_sm_comm`).
Written without a GPU at hand: not yet run on one.

1. GEMM decomposition loss: bf16 GEMMs whole and split 8/64-way along M and along K.
2. Contention: a GEMM beside (a) copy-engine host-to-device copies from pinned memory (the
   stand-in for a GPU-GPU link), (b) copy-engine device-to-device copies, (c) an SM copy kernel;
   slowdown of each side against running alone.
Timed with CUDA events after warm-up; medians of repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _ms(fn, repeats: int = 10, warmup: int = 3) -> float:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def decomposition(shapes: list[tuple[int, int, int]]) -> list[dict]:  # type: ignore[type-arg]
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        whole = _ms(lambda a=a, w=w, c=c: torch.mm(a, w, out=c))
        row = {"m": m, "n": n, "k": k, "whole_ms": whole}
        for parts in (8, 64):
            am, cm = a.view(parts, m // parts, k), c.view(parts, m // parts, n)
            row[f"split_m{parts}_ms"] = _ms(lambda am=am, cm=cm, w=w, p=parts: [
                torch.mm(am[i], w, out=cm[i]) for i in range(p)])
            ak = [a[:, i * (k // parts):(i + 1) * (k // parts)].contiguous() for i in range(parts)]
            wk = [w[i * (k // parts):(i + 1) * (k // parts)] for i in range(parts)]
            row[f"split_k{parts}_ms"] = _ms(lambda ak=ak, wk=wk, c=c, p=parts: [
                torch.mm(ak[0], wk[0], out=c)] + [c.addmm_(ak[i], wk[i]) for i in range(1, p)])
        rows.append(row)
    return rows


def contention(m: int, n: int, k: int, copy_mb: int) -> dict:  # type: ignore[type-arg]
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    nbytes = copy_mb << 20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    movers = {
        "h2d_copy_engine": lambda: dst.copy_(host, non_blocking=True),
        "d2d_copy_engine": lambda: dst.copy_(src),
        "sm_copy_kernel": lambda: torch.mul(src, 1, out=dst),
    }
    gemm = _ms(lambda: torch.mm(a, w, out=c))
    out = {"gemm": {"m": m, "n": n, "k": k, "alone_ms": gemm}, "copy_mb": copy_mb}
    for name, move in movers.items():
        alone = _ms(move)

        def both(move=move) -> None:  # type: ignore[no-untyped-def]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                move()
            torch.mm(a, w, out=c)
            torch.cuda.current_stream().wait_stream(side)

        together = _ms(both)
        out[name] = {"alone_ms": alone, "with_gemm_ms": together,
                     "gb_per_s_alone": nbytes / alone / 1e6,
                     "overlap_effectiveness": (alone + gemm - together) / min(alone, gemm)}
    return out


GRID = (1024, 4096, 16384)


def gemm_grid() -> list[list[object]]:
    rows: list[list[object]] = []
    for m in GRID:
        for n in GRID:
            for k in GRID:
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
                c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                ms = _ms(lambda a=a, w=w, c=c: torch.mm(a, w, out=c), repeats=5, warmup=2)
                rows.append(["bf16", m, n, k, ms / 1e3])
    return rows


def calibration(result: dict, grid: list[list[object]]) -> dict:  # type: ignore[type-arg]
    cont = result["contention"]
    g = cont["gemm"]["alone_ms"]

    def slowdown(name: str) -> float:  # the GEMM's share of the together time, as a rate
        rate = g / max(cont[name]["with_gemm_ms"], g)
        return round(min(0.95, max(0.0, 1.0 - rate)), 4)

    return {
        "plait_calibration": 1,
        "meta": {"device": result["device"], "date": result["date"],
                 "command": "python bench/gpu_measure.py --out OUT.json --calibration-out "
                            "CAL.yaml", "versions": {"torch": result["torch"]}},
        "params": {"gemm_measured": grid, "gemm_slowdown_dma": slowdown("d2d_copy_engine"),
                   "gemm_slowdown_sm_comm": slowdown("sm_copy_kernel")},
        "gpu": {"dma": {"bytes_per_s": cont["d2d_copy_engine"]["gb_per_s_alone"] * 1e9}},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--calibration-out")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    shapes = [(8192, 1280, 8192), (8192, 7168, 8192), (16384, 16384, 16384), (2048, 6144, 4096)]
    if args.quick:
        shapes = shapes[:2]
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"),
              "command": "python bench/gpu_measure.py --out OUT.json",
              "decomposition": decomposition(shapes),
              "contention": contention(8192, 8192, 8192, 512)}
    if args.calibration_out:
        import yaml

        cal = calibration(result, gemm_grid())
        with open(args.calibration_out, "w") as f:
            yaml.safe_dump(cal, f, sort_keys=False, default_flow_style=None)
    result["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
