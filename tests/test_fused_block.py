"""A fused block as one autograd Function (vit_fast/layers/fused_block.py) against the per-part path it replaces.

The per-part path (the parts' functionals, each block a chain of autograd Functions) is compared with float64 by
tests/test_fused_model.py and the kernel tests; the one-Function block must give bitwise its outputs and every
gradient, with the same random draws (dropout, drop-path) for the same seed. The first call of each input
signature runs the per-part path (its functionals check the inputs), later calls the one Function.
"""
import copy

import pytest
import torch

import vit_fast
from vit_fast.layers import fused_block
from vit_fast.route import Route, apply_route

from .test_fused_model import TINY, loss_of, make_pair

CONFIGS = {
    "fp32": dict(TINY),
    "layerscale_droppath_dropout": dict(TINY, init_values=0.1, drop_path_rate=0.5, proj_drop_rate=0.2,
                                        attn_drop_rate=0.25, global_pool="avg"),
    "no_qkv_bias_tanh": dict(TINY, qkv_bias=False, act="gelu_tanh", global_pool="avg"),
    "quick_gelu_depth3": dict(TINY, act="quick_gelu", depth=3),
}


class BlockCalls:
    """Counts the blocks that ran as one Function, and lets a test force the per-part path."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = fused_block.run_block

        def counted(*args):
            self.count += 1
            return real(*args)

        monkeypatch.setattr(fused_block, "run_block", counted)
        monkeypatch.setattr(fused_block, "enabled", True)
        monkeypatch.setattr(fused_block, "_checked", set())  # no signature checked by an earlier test in this worker
        self.per_part = False  # every block per part, signatures still marked as checked
        ready = fused_block.ready
        monkeypatch.setattr(fused_block, "ready", lambda signature: not self.per_part and ready(signature))

    @staticmethod
    def forget_checked():
        fused_block._checked.clear()


def step(model, x, seed, autocast=False):
    """Logits and every parameter's gradient of one training step, from ``seed``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    loss_of(out).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_bitwise(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert grads_a[name].dtype == grads_b[name].dtype, name
        assert torch.equal(grads_a[name], grads_b[name]), name


def per_part_then_one_function(model, x, calls, autocast=False, seed=3):
    calls.forget_checked()
    calls.count = 0
    calls.per_part = True
    per_part = step(model, x, seed, autocast)
    calls.per_part = False
    assert calls.count == 0
    one_function = step(model, x, seed, autocast)
    assert calls.count >= 1
    return per_part, one_function


def without_drop1(model):
    """timm's proj_drop_rate also sets the MLP's first dropout (drop1), which the one Function does not run: off,
    so the joins' dropout (proj_drop, drop2) is tested."""
    for block in model.blocks:
        block.mlp.drop1.p = 0.0
    return model


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_one_function_block_is_bitwise_the_per_part_path(monkeypatch, config):
    calls = BlockCalls(monkeypatch)
    model = without_drop1(make_pair(**config)[0])
    model.train()
    x = torch.randn(2, 3, 32, 32)
    per_part, one_function = per_part_then_one_function(model, x, calls)
    # class-token pooling: the last block (token 0 only, ``keep_rows``) runs as one Function too
    assert calls.count == config["depth"]
    assert_bitwise(per_part, one_function)


@pytest.mark.parametrize("keep_rows", [1, 3, 5])
@pytest.mark.parametrize("next_norm", [True, False])
def test_a_block_keeping_its_first_rows_is_bitwise_the_per_part_path(monkeypatch, keep_rows, next_norm):
    """``forward_pair(..., keep_rows=M)`` as one Function: attention's first M queries (every token still a key
    and value), the rest on those rows, d(residual) zeros past them and d(hidden) from every token; M of the 5
    tokens: one row per image (a strided rows view), several (a copy), all (no slice); with attention and join
    dropout, LayerScale and drop-path; after it the next LayerNorm or the stream alone."""
    calls = BlockCalls(monkeypatch)
    model = without_drop1(make_pair(**dict(TINY, init_values=0.1, drop_path_rate=0.5, proj_drop_rate=0.2,
                                           attn_drop_rate=0.25, global_pool="avg"))[0]).train()
    block, norm = model.blocks[0], (model.blocks[1].norm1 if next_norm else None)
    x = torch.randn(2, 5, model.embed_dim)

    def run(seed):
        hidden_in = torch.randn_like(x).requires_grad_()
        residual_in = x.clone().requires_grad_()
        torch.manual_seed(seed)
        normed, stream = block.forward_pair(hidden_in, residual_in, norm, keep_rows=keep_rows)
        assert stream.shape == (2, keep_rows, model.embed_dim)
        loss = stream.pow(2).sum() + (normed.sin().sum() if next_norm else 0)
        block.zero_grad(set_to_none=True)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
        grads.update(hidden=hidden_in.grad, residual=residual_in.grad)
        return (stream.detach() if normed is None else torch.cat([normed.detach(), stream.detach()])), grads

    calls.forget_checked()
    calls.per_part = True
    torch.manual_seed(0)
    per_part = run(5)
    calls.per_part = False
    torch.manual_seed(0)
    one_function = run(5)
    assert calls.count == 1
    assert_bitwise(per_part, one_function)
    assert not one_function[1]["residual"][:, keep_rows:].any()


@pytest.mark.parametrize("route", ["fused", "short"])
def test_one_function_block_under_autocast(monkeypatch, route):
    """bf16 autocast: the GEMMs' weight copies and their fp32 gradients as autograd casts them; the short
    attention kernels on the 'short' route; attention and join dropout, drop-path."""
    calls = BlockCalls(monkeypatch)
    model = without_drop1(make_pair(**dict(TINY, depth=3, global_pool="avg", init_values=0.1, drop_path_rate=0.3,
                                           attn_drop_rate=0.25, proj_drop_rate=0.2))[0])
    apply_route(model, Route(attention=route))
    x = torch.randn(2, 3, 32, 32)
    per_part, one_function = per_part_then_one_function(model, x, calls, autocast=True)
    assert calls.count == 3
    assert_bitwise(per_part, one_function)
    assert all(g.dtype == torch.float32 for g in one_function[1].values())


def test_frozen_parameters_get_no_gradient_and_the_rest_match(monkeypatch):
    calls = BlockCalls(monkeypatch)
    model, _ = make_pair(**dict(TINY, global_pool="avg"))
    frozen = {n for n, _ in model.named_parameters() if ".attn." in n or n.endswith("fc1.weight")}
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    per_part, one_function = per_part_then_one_function(model, torch.randn(2, 3, 32, 32), calls)
    assert not frozen & one_function[1].keys()
    assert_bitwise(per_part, one_function)


def test_no_grad_and_eval_forward_match(monkeypatch):
    calls = BlockCalls(monkeypatch)
    model, _ = make_pair(**dict(TINY, global_pool="avg", drop_path_rate=0.5, proj_drop_rate=0.3))
    model.eval()
    x = torch.randn(2, 3, 32, 32)
    calls.forget_checked()
    with torch.no_grad():
        first = model(x)
        assert calls.count == 0
        second = model(x)
    assert calls.count == 2 and torch.equal(first, second)


def test_grad_checkpointing_recomputes_the_same_block(monkeypatch):
    """Activation checkpointing (non-reentrant: saved-tensor hooks) drops the block's saved tensors and
    recomputes them with the same dropout masks: the same gradients as without it."""
    calls = BlockCalls(monkeypatch)
    model = without_drop1(make_pair(**CONFIGS["layerscale_droppath_dropout"])[0])
    x = torch.randn(2, 3, 32, 32)
    _, plain = per_part_then_one_function(model, x, calls)
    model.set_grad_checkpointing(True)
    calls.count = 0
    checkpointed = step(model, x, 3)
    assert calls.count == 4  # forward and the recomputation, both blocks
    assert_bitwise(plain, checkpointed)


@pytest.mark.parametrize("dropout", [False, True])
def test_grad_checkpointing_from_a_signature_never_run(monkeypatch, dropout):
    """The first step of a signature under checkpointing (timm's train.py --grad-checkpointing, or a new batch
    shape): the first block of the signature runs per part, so its recomputation must too (it found the signature
    checked and ran the one Function: another number of saved tensors, CheckpointError); the later blocks of the
    signature run the one Function, forward and recomputation alike. Same gradients as without checkpointing; the
    next steps run the one Function everywhere."""
    calls = BlockCalls(monkeypatch)
    config = CONFIGS["layerscale_droppath_dropout"] if dropout else dict(TINY, global_pool="avg")
    model = without_drop1(make_pair(**dict(config, depth=3))[0])
    x = torch.randn(2, 3, 32, 32)
    calls.forget_checked()
    plain = step(model, x, 3)
    calls.forget_checked()
    calls.count = 0
    model.set_grad_checkpointing(True)
    first = step(model, x, 3)
    assert calls.count == 2  # block 1 (block 0 checked its signature; block 2, before the final norm, is another)
    assert_bitwise(plain, first)
    calls.count = 0
    second = step(model, x, 3)
    assert calls.count == 6  # forward and recomputation, three blocks
    assert_bitwise(first, second)


def test_grad_checkpointing_with_another_forward_before_the_backward(monkeypatch):
    """A forward of the same signature between a checkpointed forward and its backward (a no-grad teacher copy, a
    second checkpointed view): it must not mark the signature while a recomputation of it is owed."""
    calls = BlockCalls(monkeypatch)
    model = without_drop1(make_pair(**dict(TINY, global_pool="avg", depth=2))[0])
    teacher = copy.deepcopy(model)
    x = torch.randn(2, 3, 32, 32)
    calls.forget_checked()
    plain = step(model, x, 3)
    calls.forget_checked()
    model.set_grad_checkpointing(True)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    out = model(x)
    with torch.no_grad():
        teacher(x)
    view = model(x)  # a second checkpointed forward, recomputed in its own backward after the first's
    loss_of(out).backward()
    model(x)
    loss_of(view).backward()
    model.zero_grad(set_to_none=True)
    assert_bitwise(plain, step(model, x, 3))


def test_grad_checkpointing_recomputes_each_block_on_its_forwards_path_whatever_ran_between(monkeypatch):
    """A retained graph backed twice with a forward of the same signature between (the second recomputation found
    the signature checked and ran the one Function: CheckpointError), and a frozen checkpointed teacher beside a
    checkpointed student (each teacher forward owed a recomputation no backward paid, so neither model ever ran
    the one Function). The path of a checkpointed block is decided before its checkpoint and held."""
    calls = BlockCalls(monkeypatch)
    model = without_drop1(make_pair(**dict(TINY, global_pool="avg", depth=2))[0])
    reference = copy.deepcopy(model)
    model.set_grad_checkpointing(True)
    x = torch.randn(2, 3, 32, 32)
    calls.forget_checked()
    loss = loss_of(model(x))
    loss.backward(retain_graph=True)
    with torch.no_grad():
        model(x)
    loss.backward()
    loss_of(reference(x)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, 2 * q.grad, rtol=1e-5, atol=1e-7, msg=name)

    student, teacher = model, copy.deepcopy(model).requires_grad_(False)
    calls.forget_checked()
    calls.count = 0
    for _ in range(3):
        student.zero_grad(set_to_none=True)
        loss_of(student(x) - teacher(x)).backward()
    assert calls.count > 0


def test_bad_input_in_a_new_signature_gets_the_parts_errors(monkeypatch):
    """Another signature is checked again by the parts' functionals: a residual of the wrong width or dtype is
    refused with their messages, never launched."""
    calls = BlockCalls(monkeypatch)
    model, _ = make_pair(**dict(TINY, global_pool="avg"))
    block, next_norm = model.blocks[0], model.blocks[1].norm1
    hidden = torch.randn(2, 17, 64, requires_grad=True)
    residual = torch.randn(2, 17, 64, requires_grad=True)
    calls.forget_checked()
    for _ in range(2):
        block.forward_pair(hidden, residual, next_norm)
    assert calls.count == 1
    with pytest.raises(ValueError, match=r"add_layer_norm: expected residual of shape \(2, 17, 64\)"):
        block.forward_pair(hidden, residual[..., :48], next_norm)
    with pytest.raises(ValueError, match="add_layer_norm: expected residual with dtype in"):
        block.forward_pair(hidden, residual.to(torch.int32), next_norm)
    assert calls.count == 1


def test_parts_that_are_not_stock_run_per_part(monkeypatch):
    """The MLP's first dropout (drop1) in training, a hook in the block: the per-part path runs."""
    calls = BlockCalls(monkeypatch)
    model, _ = make_pair(**dict(TINY, global_pool="avg", proj_drop_rate=0.1))
    x = torch.randn(2, 3, 32, 32)
    calls.forget_checked()
    for _ in range(2):
        step(model, x, 0)
    assert calls.count == 0  # drop1 (the MLP's first dropout, proj_drop_rate) is active in training
    model.eval()
    with torch.no_grad():
        model(x)
        model(x)
    assert calls.count == 2
    fired = []
    handle = model.blocks[0].mlp.fc1.register_forward_hook(lambda *args: fired.append(1))
    calls.count = 0
    with torch.no_grad():
        model(x)
    handle.remove()
    assert fired == [1] and calls.count == 1  # the hooked block module by module, the other one as one Function


def test_torch_compile_traces_the_parts_not_the_block_function(monkeypatch):
    """Under torch.compile the custom ops of the per-part path are traced (FakeTensor mode)."""
    calls = BlockCalls(monkeypatch)
    model, _ = make_pair(**dict(TINY, global_pool="avg", depth=1))
    x = torch.randn(2, 3, 32, 32)
    eager = copy.deepcopy(model)
    for _ in range(2):
        eager(x)
    calls.count = 0
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    out = compiled(x)
    assert calls.count == 0
    assert torch.equal(out, eager(x))
    vit_fast  # noqa: B018 (the package's custom ops registered)


def test_the_switch_turns_it_off(monkeypatch):
    calls = BlockCalls(monkeypatch)
    monkeypatch.setattr(fused_block, "enabled", False)
    model, _ = make_pair(**dict(TINY, global_pool="avg"))
    x = torch.randn(2, 3, 32, 32)
    for _ in range(2):
        step(model, x, 0)
    assert calls.count == 0


def replica_of(model):
    """``model`` as nn.parallel.replicate leaves a replica: every parameter a plain attribute (a non-leaf copy),
    the parameter dicts empty."""
    replica = copy.deepcopy(model)
    for module in replica.modules():
        params, module._parameters = dict(module._parameters), {}
        for name, p in params.items():
            setattr(module, name, None if p is None else p * 1)
    return replica


def test_a_data_parallel_replica_runs_as_one_function(monkeypatch):
    calls = BlockCalls(monkeypatch)
    model, _ = make_pair(**dict(TINY, global_pool="avg", init_values=0.1))
    x = torch.randn(2, 3, 32, 32)
    outs = []
    for per_part in (True, False):
        calls.forget_checked()
        calls.count, calls.per_part = 0, per_part
        replica = replica_of(model)
        for _ in range(2):  # the first call of a signature runs per part
            out = replica(x)
        outs.append(out)
        assert calls.count == (0 if per_part else 2)
    assert torch.equal(*outs)


def test_mixed_training_flags_and_an_unconverted_stream_run_per_part(monkeypatch):
    """A block in training with its attention in eval (attention dropout off there), or an fp32 hidden under
    autocast (the qkv GEMM's input cast by autocast): the per-part path runs, as it reads those."""
    calls = BlockCalls(monkeypatch)
    model, _ = make_pair(**dict(TINY, global_pool="avg", attn_drop_rate=0.25))
    block, next_norm = model.blocks[0], model.blocks[1].norm1
    hidden = torch.randn(2, 17, 64, requires_grad=True)
    residual = torch.randn(2, 17, 64, requires_grad=True)
    model.train()
    block.attn.eval()
    for _ in range(2):
        block.forward_pair(hidden, residual, next_norm)
    model.train()
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16):
        for _ in range(2):
            _, stream = block.forward_pair(hidden, residual, next_norm)
    stream.float().sum().backward()
    assert calls.count == 0 and hidden.grad.dtype == torch.float32


def test_no_grad_runs_no_backward_work_and_frozen_parts_none(monkeypatch):
    """Under no_grad the MLP keeps no activation derivative; with attention frozen and the inputs needing no
    gradient, the attention backward does not run (as autograd would skip its node)."""
    calls = BlockCalls(monkeypatch)
    model, _ = make_pair(**dict(TINY, global_pool="avg"))
    block, next_norm = model.blocks[0], model.blocks[1].norm1
    stored, backwards = [], []
    op_caller = fused_block.op_caller

    def seen_through(call):
        def seen(op, *args):  # the MLP forward's store_dact flag; every attention backward
            if op.name == "linear_act_fwd":
                stored.append(args[-1])
            if op.name.startswith("attention") and op.name.endswith("_bwd"):
                backwards.append(1)
            return call(op, *args)
        return seen
    monkeypatch.setattr(fused_block, "op_caller", lambda: seen_through(op_caller()))
    hidden, residual = torch.randn(2, 17, 64), torch.randn(2, 17, 64)
    with torch.no_grad():
        for _ in range(2):
            block.forward_pair(hidden, residual, next_norm)
    assert calls.count == 1 and stored == [False]
    for p in block.attn.parameters():
        p.requires_grad_(False)
    for _ in range(2):
        normed, stream = block.forward_pair(hidden, residual, next_norm)
    (normed.sum() + stream.sum()).backward()
    assert calls.count == 3 and stored[-1] is True and backwards == []
    assert block.norm2.weight.grad is not None and block.attn.proj.weight.grad is None


def test_only_the_proj_weight_trainable_gets_the_per_part_gradient(monkeypatch):
    """Inputs, qkv and everything else frozen but the attention's output projection (a proj-only fine-tune): the
    one Function saves what that GEMM's weight gradient reads, and it is bitwise the per-part path's."""
    calls = BlockCalls(monkeypatch)
    model, _ = make_pair(**dict(TINY, global_pool="avg"))
    block, next_norm = model.blocks[0], model.blocks[1].norm1
    for name, p in block.named_parameters():
        p.requires_grad_(name == "attn.proj.weight")
    hidden, residual = torch.randn(2, 17, 64), torch.randn(2, 17, 64)
    grads = []
    for per_part in (True, False, False):  # the first call checks the signature, the next ones are one Function
        calls.per_part = per_part
        block.attn.proj.weight.grad = None
        normed, stream = block.forward_pair(hidden, residual, next_norm)
        (normed.sum() + stream.sum()).backward()
        grads.append(block.attn.proj.weight.grad.clone())
    assert calls.count == 2 and all(torch.equal(grads[0], g) for g in grads[1:])


def test_compiled_autograd_and_dispatch_modes_see_the_parts_ops_in_backward(monkeypatch):
    from torch._dynamo import compiled_autograd
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "vit_fast" in str(func):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    calls = BlockCalls(monkeypatch)
    model, _ = make_pair(**dict(TINY, global_pool="avg"))
    x = torch.randn(2, 3, 32, 32)
    per_part, eager = per_part_then_one_function(model, x, calls, seed=0)
    out = model(x)
    with Ops() as ops:
        loss_of(out).backward()
    calls.per_part = True
    out = model(x)
    with Ops() as ops_of_parts:
        loss_of(out).backward()
    ops_per_part = ops_of_parts.seen
    calls.per_part = False
    assert sorted(ops.seen) == sorted(ops_per_part) and ops.seen
    model.zero_grad(set_to_none=True)
    out = model(x)
    with compiled_autograd._enable(torch.compile(backend="eager")):
        loss_of(out).backward()
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, eager[1][name], rtol=1e-5, atol=1e-7), name
    assert_bitwise(per_part, eager)


def test_a_linked_transformers_dinov2_runs_as_one_function(monkeypatch):
    """transformers' DINOv2 through vit_fast.optimize: its parts (LayerScale included) are read from the source
    modules; the blocks run as one Function each, bitwise the per-part path."""
    transformers = pytest.importorskip("transformers")
    calls = BlockCalls(monkeypatch)
    torch.manual_seed(0)
    source = transformers.Dinov2Model(transformers.Dinov2Config(hidden_size=64, num_hidden_layers=2,
                                                                num_attention_heads=4, image_size=32, patch_size=8,
                                                                layerscale_value=0.5))
    model = vit_fast.optimize(source, backend="triton").train()
    x = torch.randn(2, 3, 32, 32)
    results = []
    for per_part in (True, False):
        calls.forget_checked()
        calls.count, calls.per_part = 0, per_part
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            out = model(pixel_values=x).pooler_output
            out.square().mean().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        assert calls.count == (0 if per_part else 2 * 2 - 1)  # every block but the first call's
    assert_bitwise(*results)


def test_direct_launches_compute_what_the_jit_launches_computed(monkeypatch):
    """A launch's first call goes through Triton's JIT, later ones straight to the compiled kernel on a GPU
    (``_tuning.KernelLaunch``; under the interpreter always the JIT): the third step, with every launch direct,
    gives bitwise the first step's logits and gradients, under autocast, with dropout and drop-path drawn."""
    from vit_fast.kernels import _tuning

    armed = []
    real = _tuning.KernelLaunch._direct
    monkeypatch.setattr(_tuning.KernelLaunch, "_direct",
                        lambda self, compiled, args: armed.append(real(self, compiled, args)) or armed[-1])
    # shapes no other test plans (head_dim 40, width 80): every launch plan starts here
    model = make_pair(**dict(TINY, embed_dim=80, num_heads=2, depth=3, drop_path_rate=0.3, attn_drop_rate=0.1,
                             global_pool="avg"))[0].train()
    x = torch.randn(3, 3, 32, 32)
    first = step(model, x, 5, autocast=True)
    for _ in range(2):
        last = step(model, x, 5, autocast=True)
    assert_bitwise(first, last)
    went_direct = [d for d in armed if d]  # None: not armed at that call; False: the JIT for good
    assert went_direct if torch.cuda.is_available() else not went_direct and armed


def test_keep_rows_the_per_part_path_refuses_is_refused_after_an_int_ran(monkeypatch):
    """keep_rows True, 1.0 or a numpy int equals (and hashes as) 1 in the signature: after keep_rows=1 ran (per part,
    then as one Function) they must still be refused as ``attention_linear`` refuses them, not run (or fail
    elsewhere) as one Function."""
    np = pytest.importorskip("numpy")
    calls = BlockCalls(monkeypatch)
    model = make_pair(**dict(TINY, global_pool="avg"))[0].eval()
    block, norm = model.blocks[0], model.blocks[1].norm1
    hidden, residual = torch.randn(2, 5, model.embed_dim), torch.randn(2, 5, model.embed_dim)
    calls.forget_checked()
    with torch.no_grad():
        per_part = block.forward_pair(hidden, residual, norm, keep_rows=1)
        one_function = block.forward_pair(hidden, residual, norm, keep_rows=1)
        assert calls.count == 1 and all(map(torch.equal, per_part, one_function))
        for keep_rows in (True, np.int64(1), 1.0):
            with pytest.raises(ValueError, match="query_rows"):
                block.forward_pair(hidden, residual, norm, keep_rows=keep_rows)
    assert calls.count == 1
