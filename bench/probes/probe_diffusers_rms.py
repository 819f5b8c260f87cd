"""How do diffusers' ``RMSNorm`` and Qwen-Image's complex RoPE round on CUDA? (notes/families.md §7,
probes P1-P3.)

Run on the GPU: ``PYTHONPATH=. python3 bench/probes/probe_diffusers_rms.py [--out DIR]``. Not a test
(no assertion): each candidate model of the eager arithmetic is compared bitwise with torch over
many rows and one row per candidate is printed with the number of rows (or elements) that differ.
A candidate with 0 everywhere is what the kernel must implement; tests/gpu/test_qk_rmsnorm_diffusers.py
then asserts it through the kernel.

- P2, the mean: ``x.float().pow(2).mean(-1)`` over rows of 64, 96, 128 (heads), 256 and 3840
  (Z-Image's width) in ATen's generic reduce-kernel order (Reduce.cuh: lane-strided elements per
  thread for rows <= 128, 4-element vectors with four accumulators above; a shfl-down tree over
  adjacent lanes, offsets 1..16) against the layer-norm order, the reversed tree, sequential sums,
  ``torch.sum``; the projection ``sum * float(rows)/float(numel)`` vs ``sum / D``.
- P3, layout: the same on [B, H, S, 64] transposed views (SD3's q/k) and on realistic
  [B, S, H, 128] tensors (num_outputs = B*S*H).
- rsqrt: ``torch.rsqrt`` vs ``rsqrt.approx.f32`` (inline PTX, no ftz) vs ``1/sqrt``.
- The whole diffusers ``RMSNorm`` module (bf16 weight, no weight, fp32 model) vs the chain built
  from the winning pieces.
- P1, complex RoPE: ``apply_rotary_emb_qwen(x, freqs, use_real=False)`` vs five contractions of
  ``c10::complex<float>::operator*=`` (real = a*c - b*d, imag = a*d + b*c).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = int(os.environ.get("PROBE_ROWS", "32768"))


# -- sum-of-squares orders (pure torch; every add is one IEEE fp32 rounding) ----------------------


def _last_pow2(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def _tree_adjacent(s: torch.Tensor) -> torch.Tensor:
    """shfl_down at offsets 1, 2, 4, ...: lane i += lane i + offset -> pairs of adjacent lanes."""
    while s.shape[-1] > 1:
        s = s[..., 0::2] + s[..., 1::2]
    return s[..., 0]


def _tree_halves(s: torch.Tensor) -> torch.Tensor:
    """shfl_down at offsets 16, 8, ...: lane i += lane i + L/2."""
    while s.shape[-1] > 1:
        h = s.shape[-1] // 2
        s = s[..., :h] + s[..., h:]
    return s[..., 0]


def _pad(sq: torch.Tensor, width: int) -> torch.Tensor:
    D = sq.shape[-1]
    if width == D:
        return sq
    return torch.cat([sq, sq.new_zeros(*sq.shape[:-1], width - D)], dim=-1)


def sum_reduce(sq: torch.Tensor, tree=_tree_adjacent, vectorize: bool | None = None) -> torch.Tensor:
    """ATen Reduce.cuh for a contiguous last-dim reduction of fp32 ``sq`` [N, D]."""
    D = sq.shape[-1]
    vec = (D > 128) if vectorize is None else vectorize
    if not vec:
        # thread_reduce_impl, vt0 = 4: lane l's accumulator i takes elements l + W*(i + 4j),
        # j = 0, 1, ... in order (a row of <= 128 has at most one per accumulator); absent ones
        # are the identity 0.
        W = min(_last_pow2(D), 32)
        J = -(-D // (4 * W))
        x = _pad(sq, J * 4 * W).reshape(*sq.shape[:-1], J, 4, W)
        a = x[..., 0, :, :]
        for j in range(1, J):
            a = a + x[..., j, :, :]
        acc = ((a[..., 0, :] + a[..., 1, :]) + a[..., 2, :]) + a[..., 3, :]
        return tree(acc)
    W = 32
    n_vec = -(-D // 4)
    K = -(-n_vec // W)
    x = _pad(sq, K * W * 4).reshape(*sq.shape[:-1], K, W, 4)  # [N, k, lane, element]
    a = x[..., 0, :, :]
    for k in range(1, K):
        a = a + x[..., k, :, :]
    acc = ((a[..., 0] + a[..., 1]) + a[..., 2]) + a[..., 3]
    return tree(acc)


def sum_layernorm_order(sq: torch.Tensor) -> torch.Tensor:
    """common/rms.py's order (4-element vectors per thread, 128 threads, shfl 16..1, warps)."""
    D = sq.shape[-1]
    T = 128
    n_vec = -(-D // 4)
    K = -(-n_vec // T)
    x = _pad(sq, K * T * 4).reshape(*sq.shape[:-1], K, T, 4)
    acc = x[..., 0, :, 0]
    for k in range(K):
        for e in range(4):
            if k == 0 and e == 0:
                continue
            acc = acc + x[..., k, :, e]
    lanes = acc.reshape(*acc.shape[:-1], 4, 32)
    s = _tree_halves(lanes)  # [N, 4 warps]
    return (s[..., 0] + s[..., 2]) + (s[..., 1] + s[..., 3])


def sum_sequential(sq: torch.Tensor) -> torch.Tensor:
    acc = sq[..., 0]
    for i in range(1, sq.shape[-1]):
        acc = acc + sq[..., i]
    return acc


def mean_factor(num_outputs: int, numel: int) -> torch.Tensor:
    """MeanOps' ``float(num_outputs) / numel`` (int64 converted to float, float division)."""
    return torch.tensor(float(num_outputs), dtype=torch.float32) / torch.tensor(float(numel), dtype=torch.float32)


def _rows_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    it = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return int((a.contiguous().view(it) != b.contiguous().view(it)).any(-1).sum())


def _inputs(shape, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    scale = torch.exp(torch.randn(*shape[:-1], 1, device=DEVICE, generator=g) * 2)
    return (torch.randn(*shape, device=DEVICE, generator=g) * scale).to(dtype)


def probe_mean(results: dict) -> None:
    print("\n== P2/P3: x.float().pow(2).mean(-1): rows differing per candidate ==")
    cases = [((ROWS, 128), torch.bfloat16), ((ROWS, 128), torch.float32), ((ROWS, 64), torch.bfloat16),
             ((ROWS, 96), torch.bfloat16), ((ROWS, 256), torch.bfloat16), ((ROWS // 4, 3840), torch.bfloat16),
             ((ROWS // 4, 3840), torch.float32), ((ROWS, 16), torch.bfloat16),
             ((1, 4109, 24, 128), torch.bfloat16), ((2, 4096, 24, 128), torch.bfloat16),
             ((1, 4109, 3840), torch.bfloat16), ((2, 4109, 3840), torch.bfloat16)]
    out = {}
    for shape, dtype in cases:
        x = _inputs(shape, dtype, seed=sum(shape))
        x32 = x.float()
        expected = x32.pow(2).mean(-1)
        sq = x32 * x32
        D = shape[-1]
        n_out = x32.numel() // D
        f = mean_factor(n_out, x32.numel()).to(DEVICE)
        cands = {
            "reduce*factor": sum_reduce(sq) * f,
            "reduce/D": sum_reduce(sq) / D,
            "reduce_halves*factor": sum_reduce(sq, tree=_tree_halves) * f,
            "reduce_vec_flip*factor": sum_reduce(sq, vectorize=not (D > 128)) * f,
            "layernorm*factor": sum_layernorm_order(sq) * f,
            "torch.sum*factor": sq.sum(-1) * f,
            "torch.sum/D": sq.sum(-1) / D,
        }
        if D <= 256:
            cands["sequential*factor"] = sum_sequential(sq) * f
        tag = f"{'x'.join(map(str, shape))} {str(dtype).replace('torch.', '')}"
        row = {k: _rows_differ(v.reshape(-1, 1), expected.reshape(-1, 1)) for k, v in cands.items()}
        out[tag] = row
        print(f"{tag:28s} " + "  ".join(f"{k}={v}" for k, v in row.items()))
    # SD3: [B, S, H, 64] projections seen as [B, H, S, 64] (transposed view) before the norm.
    for dtype in (torch.bfloat16, torch.float32):
        base = _inputs((2, 4109, 24, 64), dtype, seed=7)
        x = base.transpose(1, 2)
        x32 = x.to(torch.float32)
        expected = x32.pow(2).mean(-1)
        sq = (x32 * x32).reshape(-1, 64)
        f = mean_factor(x32.numel() // 64, x32.numel()).to(DEVICE)
        got = (sum_reduce(sq) * f).reshape(expected.shape)
        tag = f"transposed [2,24,4109,64] {str(dtype).replace('torch.', '')}"
        out[tag] = {"reduce*factor": _rows_differ(got.reshape(-1, 1), expected.reshape(-1, 1)),
                    "x32_strides": list(x32.stride())}
        print(f"{tag:28s} reduce*factor={out[tag]['reduce*factor']} (x.float() strides {x32.stride()})")
    results["mean"] = out


def probe_rsqrt(results: dict) -> None:
    print("\n== rsqrt: elements differing from torch.rsqrt ==")
    g = torch.Generator(device=DEVICE).manual_seed(3)
    n = 1 << 24
    v = torch.exp(torch.rand(n, device=DEVICE, generator=g) * 80 - 50).float()
    v = torch.cat([v, torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-45, 1e-40, 1e-38, 3e38],
                                   device=DEVICE)])
    expected = torch.rsqrt(v)
    row = {"1/sqrt": int((torch.reciprocal(torch.sqrt(v)).view(torch.int32) != expected.view(torch.int32)).sum())}
    if DEVICE == "cuda":
        import triton
        import triton.language as tl

        from ditfuse.kernels.common.welford import rsqrt_approx

        @triton.jit
        def _k(x_ptr, o_ptr, o2_ptr, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = i < n
            x = tl.load(x_ptr + i, mask=m)
            tl.store(o_ptr + i, rsqrt_approx(x), mask=m)
            tl.store(o2_ptr + i, tl.math.rsqrt(x), mask=m)

        o, o2 = torch.empty_like(v), torch.empty_like(v)
        _k[(triton.cdiv(v.numel(), 1024),)](v, o, o2, v.numel(), BLOCK=1024)
        row["rsqrt.approx.f32 (ditfuse)"] = int((o.view(torch.int32) != expected.view(torch.int32)).sum())
        row["tl.math.rsqrt"] = int((o2.view(torch.int32) != expected.view(torch.int32)).sum())
    print("  ".join(f"{k}={c}" for k, c in row.items()))
    results["rsqrt"] = row


def _rms_chain(x, weight, eps, sumfn, rsqrt):
    x32 = x.float()
    sq = x32 * x32
    D = x.shape[-1]
    f = mean_factor(x32.numel() // D, x32.numel()).to(x.device)
    ms = (sumfn(sq.reshape(-1, D)) * f).reshape(*x.shape[:-1], 1)
    h = x * rsqrt(ms + eps)
    if weight is None:
        return h.to(x.dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        h = h.to(weight.dtype)
    return h * weight


def probe_module(results: dict) -> None:
    from diffusers.models.normalization import RMSNorm

    print("\n== whole diffusers RMSNorm module: rows differing ==")
    out = {}
    for D, dtype, wmode in [(128, torch.bfloat16, "bf16"), (128, torch.bfloat16, "none"),
                            (128, torch.float32, "fp32"), (64, torch.bfloat16, "bf16"),
                            (3840, torch.bfloat16, "bf16"), (128, torch.float16, "fp16")]:
        norm = RMSNorm(D, eps=1e-6, elementwise_affine=wmode != "none").to(DEVICE)
        if wmode != "none":
            with torch.no_grad():
                norm.weight.copy_(1 + 0.3 * torch.randn(D, device=DEVICE))
            norm = norm.to(dtype)
        x = _inputs((2, 1031, 24 if D <= 128 else 1, D), dtype, seed=D + 1)
        with torch.no_grad():
            expected = norm(x)
            w = norm.weight if wmode != "none" else None
            row = {
                "reduce+rsqrt": _rows_differ(_rms_chain(x, w, 1e-6, sum_reduce, torch.rsqrt).reshape(-1, D),
                                             expected.reshape(-1, D)),
                "layernorm+rsqrt": _rms_chain(x, w, 1e-6, sum_layernorm_order, torch.rsqrt).ne(expected).any(-1).sum().item(),
            }
        tag = f"D={D} {str(dtype).replace('torch.', '')} weight={wmode}"
        out[tag] = row
        print(f"{tag:32s} " + "  ".join(f"{k}={v}" for k, v in row.items()))
    results["module"] = out


def _fma(a, b, c):
    from ditfuse.kernels.reference import fma32

    return fma32(a, b, c)


def rope_cmul(x: torch.Tensor, freqs: torch.Tensor, mode: int) -> torch.Tensor:
    x32 = x.float()
    a, b = x32[..., 0::2], x32[..., 1::2]
    f = freqs.unsqueeze(1) if freqs.dim() == 2 else freqs.unsqueeze(2)
    c, d = f.real.float(), f.imag.float()
    if mode == 0:
        re, im = a * c - b * d, a * d + b * c
    elif mode == 1:
        re, im = _fma(a, c, -(b * d)), _fma(a, d, b * c)
    elif mode == 2:
        re, im = _fma(-b, d, a * c), _fma(b, c, a * d)
    elif mode == 3:
        re, im = _fma(a, c, -(b * d)), _fma(b, c, a * d)
    else:
        re, im = _fma(-b, d, a * c), _fma(a, d, b * c)
    return torch.stack([re, im], dim=-1).flatten(3).to(x.dtype)


def probe_rope(results: dict) -> None:
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope, apply_rotary_emb_qwen

    print("\n== P1: complex RoPE (apply_rotary_emb_qwen, use_real=False): elements differing per contraction ==")
    rope = QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True)
    img_freqs, txt_freqs = rope([(1, 64, 64)], device=torch.device(DEVICE), max_txt_seq_len=512)
    g = torch.Generator(device=DEVICE).manual_seed(11)
    rand_freqs = torch.polar(torch.ones(4096, 64, device=DEVICE),
                             torch.rand(4096, 64, device=DEVICE, generator=g) * 100)
    out = {}
    for fname, freqs in (("qwen image freqs", img_freqs), ("random polar", rand_freqs)):
        for dtype in (torch.bfloat16, torch.float32):
            x = _inputs((2, freqs.shape[0], 24, 128), dtype, seed=5)
            expected = apply_rotary_emb_qwen(x, freqs, use_real=False)
            row = {}
            for mode in range(5):
                got = rope_cmul(x, freqs, mode)
                it = torch.int32 if dtype == torch.float32 else torch.int16
                row[f"mode{mode}"] = int((got.view(it) != expected.view(it)).sum())
            tag = f"{fname} {str(dtype).replace('torch.', '')}"
            out[tag] = row
            print(f"{tag:28s} " + "  ".join(f"{k}={v}" for k, v in row.items()))
    print("modes: 0 no fma; 1 re=fma(a,c,-bd) im=fma(a,d,bc); 2 re=fma(-b,d,ac) im=fma(b,c,ad); "
          "3 re=fma(a,c,-bd) im=fma(b,c,ad); 4 re=fma(-b,d,ac) im=fma(a,d,bc)")
    results["rope_complex"] = out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="directory for probe_diffusers_rms.json")
    args = ap.parse_args()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}, rows {ROWS}")
    results: dict = {"device": name, "torch": torch.__version__}
    with torch.no_grad():
        probe_mean(results)
        probe_rsqrt(results)
        probe_module(results)
        probe_rope(results)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_diffusers_rms.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
