"""Tiny kernels with known costs: compile outcomes for tests/test_report.py, bytes for tests/test_traffic.py."""
import triton
import triton.language as tl

_NOT_CONSTEXPR = 0.5  # a plain global: the interpreter accepts it, the compiler rejects it


@triton.jit
def _tile_matmul_kernel(A, B, C, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """C[BM, BN] = A[BM, K] @ B[K, BN], row-major, one program. 128x128 tiles on 4 warps spill on sm_80."""
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        a = tl.load(A + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(B + (k + rk)[:, None] * BN + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(C + rm[:, None] * BN + rn[None, :], acc.to(C.dtype.element_ty))


@triton.jit
def _global_scale_kernel(X, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N)
    tl.store(X + offs, x * _NOT_CONSTEXPR, mask=offs < N)


@triton.jit
def _rows_times_vector_kernel(Y, X, W, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Y[m, n] = X[m, n] * W[n]; every program re-reads all of W (requested bytes > distinct bytes)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    w = tl.load(W + cols, mask=cols < N, other=0.0)
    x = tl.load(X + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(Y + rows[:, None] * N + cols[None, :], x * w[None, :], mask=mask)
