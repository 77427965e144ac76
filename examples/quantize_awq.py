"""Quantize the attention inputs of a transformer block with the AWQ search, against plain round-to-nearest.

Runs on the CPU (numpy; ``--xp cupy`` runs the search on the GPU). The layer is synthetic but shaped like the
real case AWQ is for: the input has a few outlier channels (large mean |x|), which round-to-nearest spends its
4-bit grid on badly. The script

1. searches per-channel scales and clipping ranges for q/k/v together (``awq_cupy.awq.quantize_awq``),
2. folds ``1/s`` into the RMSNorm that feeds them (``fold_scales_into_norm``),
3. compares the output error of AWQ and RTN on held-out activations (not the calibration rows),
4. writes an AutoAWQ ``gemm`` checkpoint and reads it back, checking the stored layers dequantize to the weights
   it scored.

    python examples/quantize_awq.py                 # K = 1024, a few seconds on two cores
    python examples/quantize_awq.py --hidden 4096   # Mistral-sized (q 4096, k/v 1024 outputs)
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import awq_cupy
from awq_cupy import awq
from awq_cupy._array import to_numpy


def make_block(rng, K: int, outliers: float):
    """RMSNorm weight, q/k/v weights [N, K] and an input distribution with outlier channels."""
    kv = max(K // 4, 64)
    ws = [rng.standard_normal((N, K)).astype(np.float32) / float(np.sqrt(K)) for N in (K, kv, kv)]
    channel_scale = np.ones(K, np.float32)
    hot = rng.choice(K, size=max(K // 64, 1), replace=False)
    channel_scale[hot] = outliers
    norm_w = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)

    def activations(T):
        return (rng.standard_normal((T, K)).astype(np.float32) * channel_scale)

    return norm_w, ws, activations


def output_error(ws, ws_hat, x) -> float:
    """Relative output error of the three layers on ``x``: ||x W_hat^T - x W^T|| / ||x W^T||."""
    num = sum(float(np.sum((x @ (wh - w).T) ** 2)) for w, wh in zip(ws, ws_hat))
    den = sum(float(np.sum((x @ w.T) ** 2)) for w in ws)
    return float(np.sqrt(num / den))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024, help="K, the hidden size (default: 1024)")
    p.add_argument("--group-size", type=int, default=128, help="quantization group size (default: 128)")
    p.add_argument("--tokens", type=int, default=2048, help="calibration rows (default: 2048)")
    p.add_argument("--outliers", type=float, default=20.0, help="scale of the outlier channels (default: 20)")
    p.add_argument("--xp", choices=["numpy", "cupy"], default="numpy", help="where the search runs")
    p.add_argument("--out", default=None, help="checkpoint folder to write (default: a temporary one)")
    args = p.parse_args(argv)

    rng = np.random.default_rng(0)
    K, G = args.hidden, args.group_size
    norm_w, ws, activations = make_block(rng, K, args.outliers)
    calib, held_out = activations(args.tokens), activations(1024)

    if args.xp == "cupy":
        import cupy as xp
    else:
        xp = np
    res = awq.quantize_awq([xp.asarray(w) for w in ws], xp.asarray(calib), group_size=G,
                           clip=[False, False, True])
    rtn = [awq_cupy.quantize(w, G) for w in ws]
    # AWQ quantized W diag(s): the layer it stands for is that weight divided by s again (the norm takes 1/s)
    s = to_numpy(res.scales)
    # dequantize gives W^T [K, N]; the AWQ layers hold diag(s) W^T, so their rows are divided by s again
    awq_w = [(awq_cupy.dequantize(_host(q), np.float32) / s[:, None]).T for q in res.layers]
    rtn_w = [awq_cupy.dequantize(q, np.float32).T for q in rtn]
    err_awq = output_error(ws, awq_w, held_out)
    err_rtn = output_error(ws, rtn_w, held_out)

    norm_w_folded, _ = awq.fold_scales_into_norm(norm_w, None, s)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="awq_example_")) / "block-awq"
    names = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    awq_cupy.save_checkpoint(out, {n: _host(q) for n, q in zip(names, res.layers)},
                             {"model.layers.0.input_layernorm.weight": norm_w_folded.astype(np.float16)},
                             group_size=G, config={"model_type": "llama", "hidden_size": K}, overwrite=True)
    with awq_cupy.load_checkpoint(out) as ckpt:
        for n, q in zip(names, res.layers):
            stored = ckpt.layers[n].dequantize(np.float32)
            if not np.array_equal(stored, awq_cupy.dequantize(_host(q), np.float32)):
                raise SystemExit(f"{n}: the checkpoint does not hold the weights that were scored")

    print(f"K = {K}, group {G}, {args.tokens} calibration rows, outlier channels x{args.outliers:g}")
    print(f"{'method':<8} {'relative output error (held-out)':>34}")
    print(f"{'RTN':<8} {err_rtn:>34.5f}")
    print(f"{'AWQ':<8} {err_awq:>34.5f}   (alpha {res.alpha:.2f}; {err_rtn / err_awq:.2f}x lower)")
    print(f"checkpoint: {out} (AutoAWQ gemm; read back and checked)")
    return 0 if err_awq <= err_rtn else 1


def _host(q):
    """QuantizedTensors with numpy arrays (the search may have run on the GPU)."""
    return q._replace(Q=to_numpy(q.Q), Z=to_numpy(q.Z), S=to_numpy(q.S))


if __name__ == "__main__":
    raise SystemExit(main())
