"""torch.compile's training step counted, not guessed (issue 25, CONTRIBUTING.md 3d).

Inductor generates its real sm_90 Triton code on a machine without a GPU if the CUDA queries are answered.
The step (forward + cross-entropy under CPU autocast) is traced by dynamo; ``compile_fx`` runs AOT autograd on
it (joint forward/backward graph, partitioned, backward lowered at once), and each partitioned graph is moved
to a fake ``cuda:0`` whose properties are an H100's and lowered with inductor's own ``compile_fx_inner``.
Nothing is loaded or run: ``GraphLowering.compile_to_module`` is replaced by a codegen that records the
scheduler's nodes. Each fused Triton kernel is one launch moving the bytes of its read and written buffers
(``get_read_write_buffer_accesses``; as in `vit-fast traffic`, a buffer counts once per launch); each library
call (``ExternKernelSchedulerNode``: mm/addmm/bmm, SDPA) is one launch counted with the traffic's DRAM model
(each input and output tensor once) and its FLOPs. Views and no-op nodes launch nothing.

Inductor internals differ between torch versions: everything version-specific sits in ``_Inductor`` below,
and where it does not hold, :func:`count_compiled_step` raises :class:`InductorCountUnavailable` naming what
was missing.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import torch
import torch.nn.functional as F

# CONTRIBUTING.md 3d: the device inductor is told it compiles for.
H100_PROPERTIES = dict(name="NVIDIA H100 80GB HBM3 (fake, for code generation)", major=9, minor=0,
                       multi_processor_count=132, total_memory=80 * 2**30, regs_per_multiprocessor=65536,
                       max_threads_per_multi_processor=2048, warp_size=32, shared_memory_per_block_optin=232448,
                       shared_memory_per_block=49152, shared_memory_per_multiprocessor=233472, L2_cache_size=50 * 2**20,
                       gcnArchName="", uuid="fake", clock_rate=1830000, memory_clock_rate=2619000,
                       memory_bus_width=5120, max_threads_per_block=1024, is_integrated=False, is_multi_gpu_board=False,
                       pci_bus_id=0, pci_device_id=0, pci_domain_id=0)


class InductorCountUnavailable(RuntimeError):
    """The installed torch's inductor does not lower the step the way this module expects."""


@dataclass
class KernelRecord:
    name: str  # the fused kernel's or library call's name
    kind: str  # "triton" (a fused kernel inductor generates) or "extern" (a library call)
    graph: str  # "forward" / "backward"
    bytes_read: float
    bytes_written: float
    flops: float = 0.0
    op: str = ""  # library op (aten overload packet), "" for fused kernels
    template: bool = False  # a Triton GEMM template (max-autotune)


class _Inductor:
    """The one compatibility point: every inductor internal this module touches, checked at construction."""

    def __init__(self):
        try:
            from torch._dynamo import device_interface
            from torch._functorch import config as functorch_config
            from torch._inductor import compile_fx, config, scheduler
            from torch._inductor.graph import GraphLowering

            self.compile_fx = compile_fx
            self.config = config
            self.functorch_config = functorch_config
            self.GraphLowering = GraphLowering
            self.ExternKernelSchedulerNode = scheduler.ExternKernelSchedulerNode
            self.NopKernelSchedulerNode = scheduler.NopKernelSchedulerNode
            self.CudaInterface = device_interface.CudaInterface
            for obj, attr in ((compile_fx, "compile_fx"), (compile_fx, "compile_fx_inner"),
                              (compile_fx, "get_cuda_device_context"), (GraphLowering, "codegen"),
                              (GraphLowering, "compile_to_module"),
                              (functorch_config, "force_non_lazy_backward_lowering"),
                              (scheduler.BaseSchedulerNode, "get_read_write_buffer_accesses")):
                if not hasattr(obj, attr):
                    raise AttributeError(f"{getattr(obj, '__name__', obj)}.{attr}")
        except (ImportError, AttributeError) as e:
            raise InductorCountUnavailable(
                f"torch {torch.__version__}: inductor lacks {e}; the torch.compile count needs torch 2.14's internals "
                "(CONTRIBUTING.md 3d)") from e

    @contextlib.contextmanager
    def fake_h100(self):
        """Answer every CUDA query inductor asks as an H100 would; restore on exit."""
        from triton.backends.compiler import GPUTarget

        props = SimpleNamespace(**H100_PROPERTIES)
        answers = dict(is_available=lambda: True, get_device_properties=lambda *a, **k: props,
                       get_device_capability=lambda *a, **k: (9, 0), device_count=lambda: 1, current_device=lambda: 0,
                       is_bf16_supported=lambda *a, **k: True)
        patches = [mock.patch.object(torch.cuda, name, fn) for name, fn in answers.items()]
        # dynamo saves and restores the CUDA RNG state around lowering: a fake device has none
        patches += [mock.patch.object(torch.cuda, "get_rng_state", lambda *a, **k: torch.zeros(16, dtype=torch.uint8)),
                    mock.patch.object(torch.cuda, "set_rng_state", lambda *a, **k: None)]
        patches += [mock.patch.object(self.CudaInterface, name, staticmethod(fn)) for name, fn in answers.items()
                    if hasattr(self.CudaInterface, name)]
        patches += [mock.patch.object(self.CudaInterface.Worker, name, staticmethod(answers[name]))
                    for name in ("get_device_properties", "current_device") if hasattr(self.CudaInterface, "Worker")]
        import sys

        import torch.utils._triton as ut

        # has_triton is imported by name into several inductor modules: patch it wherever it is bound
        for mod in [m for name, m in list(sys.modules.items()) if name.startswith("torch") and m is not None]:
            if getattr(mod, "has_triton", None) is ut.has_triton:
                patches.append(mock.patch.object(mod, "has_triton", lambda: True))
        patches.append(mock.patch.object(self.compile_fx, "get_cuda_device_context",
                                         lambda gm: contextlib.nullcontext()))
        from triton.compiler.compiler import make_backend

        backend = make_backend(GPUTarget("cuda", 90, 32))  # the sm_90 backend, without asking a driver
        if hasattr(ut, "triton_backend"):
            patches.append(mock.patch.object(ut, "triton_backend", lambda: backend))
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            yield

    @contextlib.contextmanager
    def settings(self, mode: str):
        """No caches, no compile workers, the backward lowered at once; max-autotune where asked."""
        autotune = mode == "max-autotune"
        with self.config.patch(force_disable_caches=True, compile_threads=1, max_autotune=autotune,
                               max_autotune_gemm=autotune), \
                mock.patch.object(self.functorch_config, "force_non_lazy_backward_lowering", True):
            yield


def _to_cuda(gm: torch.fx.GraphModule) -> None:
    """Rewrite every cpu device argument of a partitioned graph to cuda:0."""
    cuda = torch.device("cuda", 0)

    def move(v):
        if isinstance(v, torch.device) and v.type == "cpu":
            return cuda
        if isinstance(v, (list, tuple)):
            return type(v)(move(x) for x in v)
        return v

    for node in gm.graph.nodes:
        node.args = move(node.args)
        node.kwargs = {k: move(v) for k, v in node.kwargs.items()}
    gm.recompile()


def _fake_cuda_inputs(inputs):
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    out = []
    with mode:
        for t in inputs:
            if isinstance(t, torch.Tensor):
                out.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda:0",
                                               requires_grad=False))
            else:
                out.append(t)
    return out, mode


def _buffer_bytes(buffers: set, graph) -> float:
    total = 0.0
    for name in buffers:
        try:
            buf = graph.get_buffer(name) if hasattr(graph, "get_buffer") else None
            if buf is None:
                continue
            layout = buf.get_layout()
            numel = math.prod(int(s) for s in layout.size) if layout.size else 1
            if numel == 0:
                continue
            span = 1 + sum((int(s) - 1) * abs(int(st)) for s, st in zip(layout.size, layout.stride))
            total += min(span, numel) * layout.dtype.itemsize
        except Exception:  # noqa: BLE001 - a symbolic or unknown buffer: counted by the caller's fallback
            continue
    return total


def _record_nodes(inductor: _Inductor, graph, label: str, out: list[KernelRecord]) -> None:
    from torch.utils.flop_counter import flop_registry

    for node in graph.scheduler.nodes:
        if isinstance(node, inductor.NopKernelSchedulerNode):
            continue
        if isinstance(node, inductor.ExternKernelSchedulerNode):
            kernel = node.node
            op = (getattr(kernel, "op_overload", None) or getattr(kernel, "python_kernel_name", None)
                  or type(kernel).__name__)
            opname = op.overloadpacket.__name__ if isinstance(op, torch._ops.OpOverload) else str(op).split(".")[-1]
            if opname in ("view", "_reinterpret_tensor", "reinterpret_tensor", "as_strided") or (
                    type(kernel).__name__ in ("ReinterpretView", "NoneAsConstantBuffer")):
                continue
            if type(kernel).__name__ == "MultiOutput":  # an output of the preceding library call: no launch
                if out and out[-1].kind == "extern":
                    out[-1].bytes_written += _buffer_bytes({d.name for d in node.read_writes.writes}, graph)
                continue
            reads = {d.name for d in node.read_writes.reads}
            writes = {d.name for d in node.read_writes.writes}
            flops = 0.0
            if isinstance(op, torch._ops.OpOverload) and op.overloadpacket in flop_registry:
                try:
                    flops = float(_extern_flops(op, kernel, flop_registry))
                except Exception:  # noqa: BLE001
                    flops = 0.0
            elif "attention" in opname:
                flops = _sdpa_flops(opname, kernel)
            out.append(KernelRecord(opname, "extern", label, _buffer_bytes(reads, graph), _buffer_bytes(writes, graph),
                                    flops, opname))
            continue
        if _takes_flags(node):  # {buffer: bytes}, inductor's own per-kernel count
            read_b = float(sum(node.get_read_write_buffer_accesses(include_reads=True, include_writes=False).values()))
            write_b = float(sum(node.get_read_write_buffer_accesses(include_reads=False, include_writes=True).values()))
        else:
            read_b = _buffer_bytes({d.name for d in node.read_writes.reads}, graph)
            write_b = _buffer_bytes({d.name for d in node.read_writes.writes}, graph)
        template = bool(getattr(node, "is_template", lambda: False)())
        flops = float(node.estimate_flops() or 0) if template and hasattr(node, "estimate_flops") else 0.0
        out.append(KernelRecord(node.get_name(), "triton", label, read_b, write_b, flops, "", template))


def _takes_flags(node) -> bool:
    import inspect

    try:
        params = inspect.signature(node.get_read_write_buffer_accesses).parameters
    except (TypeError, ValueError):
        return False
    return "include_reads" in params


def _extern_flops(op, kernel, registry) -> float:
    """FLOPs of a library call from torch.utils.flop_counter's formula, on the inputs' shapes."""
    shapes = [torch.empty(0).new_empty_strided([int(s) for s in i.get_size()], [int(s) for s in i.get_stride()],
                                               device="meta", dtype=i.get_dtype()) for i in kernel.inputs]
    args = list(shapes) + [a for a in getattr(kernel, "constant_args", ())]
    out_layout = kernel.get_layout()
    out = torch.empty([int(s) for s in out_layout.size], device="meta", dtype=out_layout.dtype)
    return registry[op.overloadpacket](*args, out_val=out, **getattr(kernel, "kwargs", {}))


def _sdpa_flops(name: str, kernel) -> float:
    """Forward 4*B*H*N*N*d; backward 10*B*H*N*N*d (as vit_fast.tools.traffic counts SDPA)."""
    ins = [i for i in getattr(kernel, "inputs", ()) if hasattr(i, "get_size")]
    if len(ins) < 2:
        return 0.0
    q = [int(s) for s in (ins[1] if "backward" in name else ins[0]).get_size()]
    k = [int(s) for s in (ins[2] if "backward" in name else ins[1]).get_size()]
    if len(q) != 4:
        return 0.0
    return (10.0 if "backward" in name else 4.0) * q[0] * q[1] * q[2] * k[2] * q[3]


def count_compiled_step(model: torch.nn.Module, batch: int, dtype: torch.dtype = torch.bfloat16, img_size: int = 224,
                        in_chans: int = 3, num_classes: int = 1000, mode: str = "default") -> list[KernelRecord]:
    """Every kernel inductor generates for one training step of `model` (forward + cross-entropy + backward)."""
    if mode not in ("default", "max-autotune"):
        raise ValueError(f"mode must be 'default' or 'max-autotune', got {mode!r}")
    inductor = _Inductor()
    captured: dict = {}

    def capture(gm, example_inputs):
        captured["gm"], captured["inputs"] = gm, example_inputs
        # the step is never run eagerly: the captured graph returns zeros shaped like its (fake) outputs, so
        # counting at batch 256 costs what counting at batch 2 does
        outs = [n.meta.get("example_value") for n in gm.graph.output_node().all_input_nodes]

        def not_run(*args):
            return tuple(torch.zeros(o.shape, dtype=o.dtype) for o in outs)

        return not_run

    def step(x, y):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = model(x)
        return F.cross_entropy(out.float(), y)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, in_chans, img_size, img_size, generator=gen)
    y = torch.randint(0, num_classes, (batch,), generator=gen)
    torch._dynamo.reset()
    try:
        torch.compile(step, backend=capture, fullgraph=True)(x, y)
    finally:
        torch._dynamo.reset()
    if "gm" not in captured:
        raise InductorCountUnavailable("dynamo captured no graph of the step")
    records: list[KernelRecord] = []
    labels = iter(("forward", "backward"))
    real_inner = inductor.compile_fx.compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        label = next(labels, "other")
        _to_cuda(gm)
        fake_inputs, _ = _fake_cuda_inputs(example_inputs)
        recorded: list[KernelRecord] = []

        def compile_to_module(self):
            self.codegen()
            _record_nodes(inductor, self, label, recorded)
            raise _Lowered()

        with inductor.fake_h100(), mock.patch.object(inductor.GraphLowering, "compile_to_module", compile_to_module):
            try:
                real_inner(gm, fake_inputs, **kwargs)
            except _Lowered:
                pass
            except Exception as e:  # a lowering failure inside inductor: surface it plainly
                if not recorded:
                    raise InductorCountUnavailable(f"inductor could not lower the {label} graph: "
                                                   f"{type(e).__name__}: {e}"[:500]) from e
        records.extend(recorded)
        return _NotRun(label)

    with inductor.settings(mode):
        inductor.compile_fx.compile_fx(captured["gm"], captured["inputs"], inner_compile=inner)
    if not any(r.graph == "backward" for r in records):
        raise InductorCountUnavailable("the backward graph was not lowered (functorch's "
                                       "force_non_lazy_backward_lowering had no effect)")
    return records


class _Lowered(Exception):
    """Raised after codegen so the lowered graph is never compiled to a module or run."""


class _NotRun:
    """Stands in for a compiled graph: the count never runs it."""

    def __init__(self, label: str):
        self.label = label

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"the {self.label} graph was lowered for counting only; it cannot run")


# ----------------------------------------------------------------------------------------------------
# As `vit-fast traffic` ops

_EXTERN_FAMILY = {"mm": "GEMM", "addmm": "GEMM", "bmm": "attention", "baddbmm": "attention",
                  "convolution": "embed", "convolution_backward": "embed"}


def to_ops(records: list[KernelRecord]):
    """KernelRecords as vit_fast.tools.traffic.Op (one launch each). Fused Triton kernels are inductor's
    elementwise/normalisation fusions ("fused" family "elementwise"); library calls keep their op name."""
    from vit_fast.tools.traffic import Op

    ops = []
    for r in records:
        if r.kind == "extern":
            family = "attention" if "attention" in r.name else _EXTERN_FAMILY.get(r.name, "other")
            name = r.name.replace("_for_cpu", "")  # traced on CPU; on CUDA the same op runs FlashAttention
            ops.append(Op(name, family, 1, r.bytes_read, r.bytes_written, r.flops, r.bytes_read + r.bytes_written))
        else:
            ops.append(Op("inductor_template" if r.template else "inductor_fused",
                          "GEMM" if r.template else "elementwise",
                          1, r.bytes_read, r.bytes_written, r.flops, r.bytes_read + r.bytes_written, triton=True))
    return ops
