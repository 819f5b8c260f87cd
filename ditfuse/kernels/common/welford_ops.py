"""``at::native::WelfordOps`` (aten/src/ATen/native/SharedReduceOps.h) in Triton, bit for bit.

This is the Welford flavour of the generic ATen reductions (``RowwiseMomentsCUDAKernel`` of
GroupNorm, the LayerNorm fallback, ``var_mean``), not LayerNorm's ``cuWelfordOnlineSum``
(ditfuse/kernels/common/welford.py): its update divides by the new count instead of multiplying
by a reciprocal, and its combine weighs by ``b.nf / nf`` with early returns for empty states.
torch 2.11, ``WelfordOps<float, float, int64_t, pair<float, float>>``, nvcc defaults
(``-fmad=true``, ``-prec-div=true``, no ftz):

``reduce(acc, x)``::

    delta = x - mean;  nf' = float(n + 1)
    mean' = mean + delta / nf'              -> add(mean, div.rn(delta, nf'))
    m2'   = m2 + delta * (x - mean')        -> fma(delta, x - mean', m2)

``combine(a, b)`` (``a`` = the caller's own state, ``b`` = the one it received)::

    if a.nf == 0: return b;  if b.nf == 0: return a
    delta = b.mean - a.mean;  nf = a.nf + b.nf;  w = b.nf / nf            (div.rn)
    mean = a.mean + delta * w               -> fma(delta, w, a.mean)
    m2   = a.m2 + b.m2 + delta*delta*a.nf*w -> fma((delta*delta)*a.nf, w, a.m2 + b.m2)

The constexpr ``*_MODE`` / ``*_FMA`` arguments select alternative contractions for the GPU order
probe (bench/probes/probe_group_norm_order.py); the defaults are what we believe nvcc emits.

Under ``TRITON_INTERPRET=1`` ``tl.fma`` rounds twice, so :func:`fma_exact` computes the fma
exactly there: the fp32 product is exact in fp64, the fp64 sum is rounded to odd (TwoSum plus a
one-ulp nudge) and then rounded to fp32, which is the correctly rounded fp32 result (53 >= 24 + 2).
tests/support/groupnorm_sim.py uses the same construction, so CPU tests compare bits.
"""

import triton
import triton.language as tl

from .rounding import INTERPRET


@triton.jit
def fma_exact(a, b, c):
    """``fma.rn.f32(a, b, c)`` (same-shaped fp32 tensors), exact under the interpreter too."""
    if INTERPRET:
        p = a.to(tl.float64) * b.to(tl.float64)
        c64 = c.to(tl.float64)
        s = p + c64
        bv = s - p
        e = (p - (s - bv)) + (c64 - bv)
        bits = s.to(tl.int64, bitcast=True)
        finite = (s - s) == 0  # False for inf and NaN
        nudge = (e != 0) & ((bits & 1) == 0) & finite
        step = tl.where((s > 0) == (e > 0), 1, -1).to(tl.int64)
        s = tl.where(nudge, (bits + step).to(tl.float64, bitcast=True), s)
        return s.to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def neg(x):
    """``-x`` as a sign flip (Triton lowers float negation to ``0 - x``, which loses -0)."""
    return (x.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.float32, bitcast=True)


@triton.jit
def wops_reduce(mean, m2, v, nf_new, valid, MEAN_MODE: tl.constexpr = 0, M2_FMA: tl.constexpr = True):
    """``WelfordOps::reduce``: add element ``v`` to the state (mean, m2); ``nf_new`` is the new
    count (exact in fp32, same shape as ``v``). Where ``valid`` is False the state is kept.

    MEAN_MODE 0: ``mean + div_rn(delta, nf')`` (torch's source); 1: ``fma(delta, rcp_rn(nf'), mean)``;
    2: ``mean + delta * rcp_rn(nf')``. M2_FMA False: ``m2 + delta * (v - mean')`` rounded twice."""
    delta = v - mean
    if MEAN_MODE == 0:
        new_mean = mean + tl.math.div_rn(delta, nf_new)
    elif MEAN_MODE == 1:
        new_mean = fma_exact(delta, tl.math.div_rn(tl.full(delta.shape, 1.0, tl.float32), nf_new), mean)
    else:
        new_mean = mean + delta * tl.math.div_rn(tl.full(delta.shape, 1.0, tl.float32), nf_new)
    nd = v - new_mean
    if M2_FMA:
        new_m2 = fma_exact(delta, nd, m2)
    else:
        new_m2 = m2 + delta * nd
    return tl.where(valid, new_mean, mean), tl.where(valid, new_m2, m2)


@triton.jit
def wops_combine(mean_a, m2_a, nf_a, mean_b, m2_b, nf_b,
                 MEAN_FMA: tl.constexpr = True, M2_MODE: tl.constexpr = 0):
    """``WelfordOps::combine(a, b)``; returns (mean, m2, nf).

    MEAN_FMA False: ``a.mean + r32(delta * w)``. M2_MODE 0: ``fma(d*d*a.nf, w, a.m2 + b.m2)``;
    1: all separate ops; 2: ``fma(d*d, a.nf*w, a.m2 + b.m2)`` (another association)."""
    delta = mean_b - mean_a
    nf = nf_a + nf_b
    w = tl.math.div_rn(nf_b, tl.where(nf > 0, nf, 1.0))
    if MEAN_FMA:
        mean = fma_exact(delta, w, mean_a)
    else:
        mean = mean_a + delta * w
    if M2_MODE == 0:
        m2 = fma_exact(delta * delta * nf_a, w, m2_a + m2_b)
    elif M2_MODE == 1:
        m2 = m2_a + m2_b + delta * delta * nf_a * w
    else:
        m2 = fma_exact(delta * delta, nf_a * w, m2_a + m2_b)
    a_empty = nf_a == 0
    b_empty = nf_b == 0
    mean = tl.where(a_empty, mean_b, tl.where(b_empty, mean_a, mean))
    m2 = tl.where(a_empty, m2_b, tl.where(b_empty, m2_a, m2))
    nf = tl.where(a_empty, nf_b, tl.where(b_empty, nf_a, nf))
    return mean, m2, nf


@triton.jit
def _halves(x, W: tl.constexpr):
    """[W] -> (x[:W/2], x[W/2:])."""
    return tl.split(tl.permute(tl.reshape(x, [2, W // 2]), (1, 0)))


@triton.jit
def wops_fold_half(mean, m2, nf, W: tl.constexpr, MEAN_FMA: tl.constexpr = True, M2_MODE: tl.constexpr = 0):
    """[W] states -> [W // 2]: element i combines its own state with element i + W/2's, the
    step of a ``__shfl_down_sync`` fold at offset W/2 as seen by the lanes below it."""
    mean_lo, mean_hi = _halves(mean, W)
    m2_lo, m2_hi = _halves(m2, W)
    nf_lo, nf_hi = _halves(nf, W)
    return wops_combine(mean_lo, m2_lo, nf_lo, mean_hi, m2_hi, nf_hi, MEAN_FMA, M2_MODE)


@triton.jit
def wops_fold(mean, m2, nf, W: tl.constexpr, MEAN_FMA: tl.constexpr = True, M2_MODE: tl.constexpr = 0):
    """Fold [W] states (W a power of two <= 32) to [1] the way ``cuda_utils::WarpReduce``'s lane
    0 does (offsets W/2, ..., 1). W = 32: one warp's lanes; W = 16: BlockReduce's second stage
    over 16 warp states (its offset-16 step meets identities and changes nothing)."""
    if W >= 32:
        mean, m2, nf = wops_fold_half(mean, m2, nf, 32, MEAN_FMA, M2_MODE)
    if W >= 16:
        mean, m2, nf = wops_fold_half(mean, m2, nf, 16, MEAN_FMA, M2_MODE)
    if W >= 8:
        mean, m2, nf = wops_fold_half(mean, m2, nf, 8, MEAN_FMA, M2_MODE)
    if W >= 4:
        mean, m2, nf = wops_fold_half(mean, m2, nf, 4, MEAN_FMA, M2_MODE)
    if W >= 2:
        mean, m2, nf = wops_fold_half(mean, m2, nf, 2, MEAN_FMA, M2_MODE)
    return mean, m2, nf


# ------------------------------------------------------------------ division without its branch
#
# ``div.rn.f32`` compiles (ptxas, sm_90) to a fast path and a guarded slow path:
#
#     r0 = MUFU.RCP(b);  t = fma(-b, r0, 1);  r = fma(r0, t, r0)        (depends on b only)
#     q0 = fma(a, r, +0); e = fma(-b, q0, a);  q = fma(r, e, q0)
#     FCHK P, a, b;  @P CALL slowpath                                     (special / extreme operands)
#
# In WelfordOps::reduce the divisor is the step's count, known before the data, but the branch
# after every division keeps ptxas from computing the next step's reciprocal early, so the
# reciprocal's latency sits on the chain's critical path. :func:`rcp_refined` computes ``r`` up
# front and :func:`div_fast` is the fast path itself; :func:`div_fast_unsafe` flags the dividends
# for which it is not used: non-finite, or nonzero with |a| outside [2^-60, 2^60] (with b in
# [1, 2^24] that keeps quotient and remainder far from under/overflow, well inside the range the
# fast path serves). For a zero dividend the fast path returns +0 where div.rn returns the
# dividend's sign; in ``mean + q`` that cannot matter (a Welford mean starts at +0 and never
# becomes -0, and x + (+0) == x + (-0) for every x other than -0). The chain kernel runs a block of
# steps with div_fast and redoes the block with div.rn when any flagged dividend occurred, so the
# states it produces are the div.rn chain's in every case.

@triton.jit
def rcp_approx_ftz(x):
    """``MUFU.RCP`` (``rcp.approx.ftz.f32``); an exact division under the interpreter."""
    if INTERPRET:
        return 1.0 / x
    else:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def rcp_refined(b):
    """The reciprocal div.rn's fast path uses for divisor ``b`` (a normal, positive fp32)."""
    r0 = rcp_approx_ftz(b)
    one = tl.full(b.shape, 1.0, tl.float32)
    return fma_exact(r0, fma_exact(neg(b), r0, one), r0)


@triton.jit
def div_fast(a, b, r):
    """div.rn's fast path for ``a / b`` given ``r = rcp_refined(b)`` (a zero quotient is +0)."""
    q0 = fma_exact(a, r, tl.zeros_like(a))
    e = fma_exact(neg(b), q0, a)
    return fma_exact(r, e, q0)


@triton.jit
def div_fast_unsafe(a):
    """True where :func:`div_fast` is not trusted to equal div.rn (see above)."""
    m = tl.abs(a)
    return (m != 0) & ~((m >= 8.673617379884035e-19) & (m <= 1.152921504606847e18))  # 2^-60, 2^60
