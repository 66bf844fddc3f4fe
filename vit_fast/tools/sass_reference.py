"""Reference kernels of known speed for the SASS instruction-cost analysis (vit_fast/tools/sass.py, issue 19).

``matmul_kernel`` is the Triton tutorial GEMM (grouped tile order, masked K loop, fp32 accumulator), written
here from the tutorial's description; its configs (128x256x64 w8 and 128x128x64 w4 on sm_90, 128x256x32 w8 and
128x128x32 w4 on sm_80) are measured on GPUs at 69-86% of peak on an A100 and 53% on an H100 at 3072^3
(triton-lang/triton #743, #3672). ``matmul_gelu_a_kernel`` is the same GEMM applying exact-erf GELU to its A tile
inside the K loop: the pattern the analysis must flag (CONTRIBUTING.md 3b2). Both are compiled only (never run here).
"""
import triton
import triton.language as tl


@triton.jit
def matmul_kernel(A, B, C, M, N, K, stride_am, stride_bk, stride_cm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  GELU_A: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = A + rm[:, None] * stride_am + rk[None, :]
    b_ptrs = B + rk[:, None] * stride_bk + rn[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=rk[None, :] < K - k * BLOCK_K, other=0.0)
        b = tl.load(b_ptrs, mask=rk[:, None] < K - k * BLOCK_K, other=0.0)
        if GELU_A:
            af = a.to(tl.float32)
            a = (0.5 * af * (1.0 + tl.erf(af * 0.7071067811865476))).to(a.dtype)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    rcm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rcn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rcm[:, None] < M) & (rcn[None, :] < N)
    tl.store(C + rcm[:, None] * stride_cm + rcn[None, :], acc.to(C.dtype.element_ty), mask=mask)


# The tutorial's configs per arch: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages).
TUTORIAL_CONFIGS = {
    90: ((128, 256, 64, 8, 3), (128, 128, 64, 4, 4)),
    80: ((128, 256, 32, 8, 3), (128, 128, 32, 4, 4)),
}


def matmul_spec(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, gelu_a: bool = False,
                dtype: str = "bf16"):
    """An AotSpec (vit_fast.kernels._aot) of the reference GEMM, with the real launch's 16-alignment."""
    from vit_fast.kernels._aot import AotSpec

    ptr = "*" + dtype
    signature = dict(A=ptr, B=ptr, C=ptr, M="i32", N="i32", K="i32", stride_am="i32", stride_bk="i32", stride_cm="i32",
                     BLOCK_M="constexpr", BLOCK_N="constexpr", BLOCK_K="constexpr", GROUP_M="constexpr",
                     GELU_A="constexpr")
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, GELU_A=gelu_a)
    name = "reference_gemm_gelu_a" if gelu_a else "reference_gemm"
    return AotSpec(name, matmul_kernel, signature, constexprs, num_warps, num_stages, True,
                   "Triton tutorial GEMM" + (" with exact GELU on the A tile in the K loop" if gelu_a else ""),
                   divisible_by_16=("A", "B", "C", "M", "N", "K", "stride_am", "stride_bk", "stride_cm"))
