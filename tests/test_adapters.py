"""PEFT adapters on the fused path (vit_fast/adapters.py): LoRA on qkv / proj / fc1 / fc2 of an optimized timm
model gives the same logits and the same LoRA gradients as PEFT on the timm model itself, on both backends
('triton' runs the kernels in the interpreter on CPU); what the kernels cannot read (LoRA dropout in training,
DoRA, a replaced module) runs through the module itself, never silently skipped."""
import copy

import peft
import pytest
import torch
import torch.nn as nn
import transformers

import vit_fast
import vit_fast.kernels.attention
import vit_fast.layers.mlp
from vit_fast.adapters import fusable_linear

from .numerics import assert_close, bound
from .test_optimize import hf_vit, images, timm_vit

RTOL = bound(torch.float32, "dot")
# PEFT asks the stock transformers model (the reference) for its deprecated is_gradient_checkpointing
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
BACKENDS = ["torch", "triton"]
ALL_LINEARS = ["qkv", "proj", "fc1", "fc2"]


def lora_pair(backend: str, targets=ALL_LINEARS, source=None, **lora_kw):
    """(PEFT on the source model, PEFT on vit_fast.optimize(source)), the same random LoRA weights in both."""
    source = timm_vit() if source is None else source
    fast = vit_fast.optimize(copy.deepcopy(source), backend=backend)
    config = dict(target_modules=targets, r=4, lora_alpha=8, init_lora_weights=False, **lora_kw)
    torch.manual_seed(3)
    ref = peft.get_peft_model(source, peft.LoraConfig(**config))
    fast = peft.get_peft_model(fast, peft.LoraConfig(**config))
    fast.load_state_dict(ref.state_dict())
    return ref, fast


def run_and_grads(model: nn.Module, x: torch.Tensor, seed: int = 7):
    torch.manual_seed(seed)
    logits = model(x)
    (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), grads


def assert_same_training_step(ref: nn.Module, fast: nn.Module, x: torch.Tensor) -> None:
    ref_logits, ref_grads = run_and_grads(ref, x)
    logits, grads = run_and_grads(fast, x)
    assert_close(logits, ref_logits, RTOL, name="logits")
    assert grads.keys() == ref_grads.keys() and grads, "the same parameters train"
    for name, g in grads.items():
        assert g is not None, f"{name}: no gradient"
        assert_close(g, ref_grads[name], RTOL, name=name)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts of the fused entry points the layers call (attention_linear, linear_act), also inside a block run
    as one Function (vit_fast/layers/fused_block.py)."""
    calls = {"attention_linear": 0, "linear_act": 0}
    real_attention, real_linear_act = vit_fast.kernels.attention.attention_linear, vit_fast.layers.mlp.linear_act

    def attention_linear(*args, **kwargs):
        calls["attention_linear"] += 1
        return real_attention(*args, **kwargs)

    def linear_act(*args, **kwargs):
        calls["linear_act"] += 1
        return real_linear_act(*args, **kwargs)

    real_block = vit_fast.layers.fused_block.run_block

    def run_block(*args):  # a block as one Function runs both parts on the weights it read
        calls["attention_linear"] += 1
        calls["linear_act"] += 1
        return real_block(*args)

    monkeypatch.setattr(vit_fast.kernels.attention, "attention_linear", attention_linear)
    monkeypatch.setattr(vit_fast.layers.mlp, "linear_act", linear_act)
    monkeypatch.setattr(vit_fast.layers.fused_block, "run_block", run_block)
    return calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_on_every_linear_matches_peft_on_timm(backend, kernel_calls):
    ref, fast = lora_pair(backend)
    ref.train(), fast.train()
    assert all(not p.requires_grad for n, p in fast.named_parameters() if "lora_" not in n), "PEFT froze the base"
    assert_same_training_step(ref, fast, images())
    if backend == "triton":  # the LoRA layers were read by the kernels, not routed around them
        assert kernel_calls == {"attention_linear": 2, "linear_act": 2}


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_bias_and_partial_targets(backend):
    ref, fast = lora_pair(backend, targets=["qkv", "fc2"], lora_bias=True)
    ref.train(), fast.train()
    assert_same_training_step(ref, fast, images())


def test_lora_dropout_runs_the_module_in_training_and_fuses_in_eval(kernel_calls):
    ref, fast = lora_pair("triton", lora_dropout=0.25)
    ref.train(), fast.train()
    qkv = fast.base_model.model.blocks[0].attn.qkv
    assert not fusable_linear(qkv)
    assert_same_training_step(ref, fast, images())  # same seed: PEFT draws the same masks in the same order
    assert kernel_calls == {"attention_linear": 0, "linear_act": 0}
    ref.eval(), fast.eval()
    assert fusable_linear(qkv)
    with torch.no_grad():
        assert_close(fast(images()), ref(images()), RTOL, name="eval logits")
    assert kernel_calls == {"attention_linear": 2, "linear_act": 2}


def test_dora_runs_the_module():
    ref, fast = lora_pair("triton", targets=["qkv", "fc1"], use_dora=True)
    assert not fusable_linear(fast.base_model.model.blocks[0].mlp.fc1)
    ref.train(), fast.train()
    assert_same_training_step(ref, fast, images())


def test_merged_and_disabled_adapters():
    ref, fast = lora_pair("triton")
    x = images()
    with torch.no_grad():
        with_lora = ref(x)
        with fast.disable_adapter():
            assert_close(fast(x), vit_fast.optimize(copy.deepcopy(timm_vit()), backend="torch")(x), RTOL,
                         name="adapters disabled")
        fast.merge_adapter()
        assert_close(fast(x), with_lora, RTOL, name="merged")
        fast.unmerge_adapter()
        assert_close(fast(x), with_lora, RTOL, name="unmerged")


class Doubled(nn.Linear):
    """A replaced projection whose forward is not nn.Linear's: the fused path must call it."""

    def forward(self, x):
        return 2 * super().forward(x)


@pytest.mark.parametrize("name", ["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"])
def test_replaced_module_is_called_not_skipped(name):
    model = vit_fast.optimize(timm_vit(), backend="triton")
    parent, attr = name.split(".")
    for blk in model.blocks:
        old = getattr(getattr(blk, parent), attr)
        new = Doubled(old.in_features, old.out_features)
        new.load_state_dict(old.state_dict())
        setattr(getattr(blk, parent), attr, new)
    x = images()
    with torch.no_grad():
        reference = copy.deepcopy(model).set_backend("torch")(x)
        assert_close(model(x), reference, RTOL, name=f"logits with {name} replaced")


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_on_hf_names_matches_peft_on_transformers(backend, kernel_calls):
    """The optimized transformers model keeps transformers' modules: PEFT's usual targets (q_proj, v_proj,
    o_proj, fc1) wrap them, and the fused forward reads them (q, k, v concatenated per step)."""
    ref, fast = lora_pair(backend, targets=["q_proj", "v_proj", "o_proj", "fc1"], source=hf_vit())
    assert type(fast.base_model.model).__name__ == "ViTForImageClassification"
    ref.train(), fast.train()
    x = images()
    ref_logits, fast_logits = ref(pixel_values=x).logits, fast(pixel_values=x).logits
    assert_close(fast_logits, ref_logits, RTOL, name="logits")
    if backend == "triton":
        assert kernel_calls == {"attention_linear": 2, "linear_act": 2}
    weight = torch.linspace(-1, 1, ref_logits.numel()).view_as(ref_logits)
    (ref_logits * weight).sum().backward()
    (fast_logits * weight).sum().backward()
    ref_params = dict(ref.named_parameters())
    trained = [(n, p) for n, p in fast.named_parameters() if p.requires_grad]
    assert len(trained) == 16 and all("lora_" in n for n, _ in trained)
    for name, p in trained:
        assert_close(p.grad, ref_params[name].grad, RTOL, name=name)


def test_hf_freezing_by_name_and_hooks_on_its_modules():
    """Freezing transformers' modules by name and hooks on them behave as on the source model."""
    source = hf_vit()
    model = vit_fast.optimize(copy.deepcopy(source), backend="triton").train()
    for p in model.vit.embeddings.parameters():
        p.requires_grad_(False)
    model(pixel_values=images()).logits.sum().backward()
    assert all(p.grad is None for p in model.vit.embeddings.parameters())
    assert model.vit.layers[0].attention.k_proj.weight.grad is not None
    seen = []
    model.vit.layers[1].mlp.fc1.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        assert_close(model(pixel_values=images()).logits, source.train()(pixel_values=images()).logits, RTOL,
                     name="logits with a hook")
    assert seen == [torch.Size([2, 5, 128])]


def test_hf_layer_replaced_after_optimize_is_the_one_that_runs():
    """A whole transformers layer replaced (or a model copied as nn.DataParallel's replicas are) links again,
    keeping the switches set on the previous link."""
    source = hf_vit()
    model = vit_fast.optimize(copy.deepcopy(source), backend="triton").eval()
    model.gradient_checkpointing_enable()
    for m in (source, model):
        m.vit.layers[0] = copy.deepcopy(m.vit.layers[1])
    with torch.no_grad():
        assert_close(model(pixel_values=images()).logits, source.eval()(pixel_values=images()).logits, RTOL,
                     name="logits after replacing a layer")
    assert model.vit_fast_model.blocks[0]._hf is model.vit.layers[0] and model.is_gradient_checkpointing
    assert model.vit_fast_model.backend == "triton"


@torch.no_grad()
def _logits(*models: nn.Module) -> list:
    return [m(pixel_values=images()).logits for m in models]


def _scaled(out):
    """A hook's edit of a module's output: a tensor or a tuple's first one times 1.5 (a model output unchanged)."""
    if isinstance(out, torch.Tensor):
        return out * 1.5
    return (out[0] * 1.5, *out[1:]) if type(out) is tuple else None


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_hooks_on_any_module_fire_and_edit_as_on_the_source(backend):
    """A hook on a module the linked parts do not call (a layer's attention, MLP, activation or dropout; the
    embeddings or the backbone) fired never and an output it edited was ignored (logits 0.03-0.3 off): a layer
    with a hook in it runs as transformers' own, one outside the layers runs transformers' forward."""
    source = hf_vit()
    for where in ("vit.layers.0.attention", "vit.layers.0.mlp", "vit.layers.1.mlp.activation_fn",
                  "vit.layers.1.dropout", "vit.embeddings", "vit", "vit.layernorm"):
        ref, model = copy.deepcopy(source), vit_fast.optimize(copy.deepcopy(source), backend=backend)
        calls = []
        for m in (ref, model):
            m.get_submodule(where).register_forward_hook(
                lambda mod, args, out: calls.append(1) or _scaled(out))
        with torch.no_grad():
            expected = ref(pixel_values=images()).logits
            fired = len(calls)
            assert_close(model(pixel_values=images()).logits, expected, RTOL, name=f"logits, hook on {where}")
        assert len(calls) == 2 * fired, where


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_a_forward_set_on_a_module_instance_runs_as_on_the_source(backend):
    """A forward set on a module instance (what accelerate's hooks do for device_map and offloading; a user's
    patch) on a leaf the linked parts read (q_proj, fc1, a LayerNorm), a layer part, or a module outside the
    layers: each is called as on the source (reading the weights instead is 0.02-0.4 off)."""
    source = hf_vit()
    for where in ("vit.layers.0.attention.q_proj", "vit.layers.1.mlp.fc1", "vit.layers.0.layernorm_after",
                  "vit.layers.1.mlp", "vit.embeddings.patch_embeddings", "vit.layernorm"):
        ref, model = copy.deepcopy(source), vit_fast.optimize(copy.deepcopy(source), backend=backend)
        for m in (ref, model):
            module = m.get_submodule(where)
            module.forward = (lambda original: lambda *args, **kwargs: _scaled(original(*args, **kwargs)))(
                module.forward)
        with torch.no_grad():
            assert_close(*_logits(model, ref), RTOL, name=f"logits, a forward set on {where}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_parts_replaced_or_wrapped_run_as_on_the_source(backend):
    """An activation replaced after (or before) optimize, a wrapped attention or MLP, a wrapped or removed layer:
    the linked model read fc1 / fc2 and the config's GELU (logits 0.05-0.07 off), failed on the wrapper with its own
    attribute names, or refused the layer count."""
    class Half(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            out = self.inner(*args, **kwargs)
            return (out[0] * 0.5, *out[1:]) if isinstance(out, tuple) else out * 0.5

    source = hf_vit(num_hidden_layers=3)
    before = copy.deepcopy(source)
    before.vit.layers[2].mlp.activation_fn = nn.ReLU()
    assert_close(*_logits(vit_fast.optimize(copy.deepcopy(before), backend=backend), before), RTOL,
                 name="activation replaced before")
    edits = {
        "activation": lambda m: setattr(m.vit.layers[0].mlp, "activation_fn", nn.ReLU()),
        "attention wrapped": lambda m: setattr(m.vit.layers[1], "attention", Half(m.vit.layers[1].attention)),
        "MLP wrapped": lambda m: setattr(m.vit.layers[1], "mlp", Half(m.vit.layers[1].mlp)),
        "layer wrapped": lambda m: m.vit.layers.__setitem__(2, Half(m.vit.layers[2])),
        "layer removed": lambda m: m.vit.layers.__delitem__(0),
    }
    for what, edit in edits.items():
        ref, model = copy.deepcopy(source), vit_fast.optimize(copy.deepcopy(source), backend=backend)
        assert_close(*_logits(model, ref), RTOL, name="before the edit")
        edit(ref), edit(model)
        assert_close(*_logits(model, ref), RTOL, name=what)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_global_module_hooks_fire_as_on_the_source(backend):
    """A global module hook (torch.nn.modules.module.register_module_forward_hook) fires on every module transformers
    calls: the optimized model runs transformers' forward while one is set, and its fast path again after."""
    source = hf_vit()
    model = vit_fast.optimize(copy.deepcopy(source), backend=backend)
    calls = []

    def scale_linears(module, args, out):
        calls.append(type(module).__name__)
        return out * 1.01 if isinstance(module, nn.Linear) else None
    handle = torch.nn.modules.module.register_module_forward_hook(scale_linears)
    try:
        with torch.no_grad():
            expected = source(pixel_values=images()).logits
            fired = len(calls)
            assert_close(model(pixel_values=images()).logits, expected, RTOL, name="logits, a global hook")
        assert len(calls) == 2 * fired and fired > 10, calls
    finally:
        handle.remove()
    with torch.no_grad():
        assert_close(*_logits(model, source), RTOL, name="logits, the global hook removed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_a_forward_replaced_on_a_torch_class_runs_as_on_the_source(backend, monkeypatch):
    """A library replacing nn.GELU's, nn.Dropout's, nn.Linear's or nn.LayerNorm's forward on the class: transformers'
    modules run it where transformers calls them (its GELU is its own class, which calls F.gelu); the linked parts'
    activation and dropout stand-ins would run it elsewhere, so the model runs transformers' forward meanwhile."""
    source = hf_vit()
    model = vit_fast.optimize(copy.deepcopy(source), backend=backend)
    for cls in (nn.GELU, nn.Dropout, nn.Linear, nn.LayerNorm):
        with monkeypatch.context() as patch:
            original = cls.forward
            patch.setattr(cls, "forward", lambda self, x, original=original: original(self, x) * 1.1)
            with torch.no_grad():
                assert_close(*_logits(model, source), RTOL, name=f"logits, {cls.__name__}.forward replaced")
            assert model.runs_as_transformers()
        assert not model.runs_as_transformers()


@pytest.mark.parametrize("backend", BACKENDS)
def test_accelerate_offloading_before_or_after_optimize_gives_the_sources_numbers(backend):
    """accelerate's cpu_offload (weights on the meta device, brought in by hooks set as instance forwards) around an
    optimized timm model, an optimized transformers model, and a transformers model offloaded before optimize (its
    modules and hooks are kept; it was refused with device advice): the source's logits."""
    from accelerate import cpu_offload

    cpu = torch.device("cpu")
    timm_source, hf_source = timm_vit(), hf_vit()
    with torch.no_grad():
        expected = timm_source(images()), hf_source(pixel_values=images()).logits
    optimized = [vit_fast.optimize(copy.deepcopy(timm_source), backend=backend),
                 vit_fast.optimize(copy.deepcopy(hf_source), backend=backend)]
    for model in optimized:
        cpu_offload(model, execution_device=cpu)
    offloaded_first = copy.deepcopy(hf_source)
    cpu_offload(offloaded_first, execution_device=cpu)
    if backend == "torch":  # optimize's device check stays for 'triton', which needs the weights' device
        optimized.append(vit_fast.optimize(offloaded_first, backend=backend))
    with torch.no_grad():
        assert_close(optimized[0](images()), expected[0], RTOL, name="timm, optimized then offloaded")
        for model in optimized[1:]:
            assert_close(model(pixel_values=images()).logits, expected[1], RTOL, name="transformers, offloaded")


def test_hf_compiles_fullgraph_and_names_the_eager_call_a_layer_edit_needs():
    """An optimized transformers model under torch.compile(fullgraph=True) matches the source; after a layer is
    removed the linked model must be rebuilt, which dynamo cannot trace: the error's first lines say to call the
    model once outside torch.compile, after which the compiled model follows. Without fullgraph the compiled
    model rebuilds the link outside its graph and follows the edit at once."""
    source = hf_vit(num_hidden_layers=3)
    model = vit_fast.optimize(copy.deepcopy(source), backend="torch")
    compiled, compiled_with_breaks = torch.compile(model, fullgraph=True), torch.compile(model)
    with torch.no_grad():
        assert_close(compiled(pixel_values=images()).logits, source(pixel_values=images()).logits, RTOL,
                     name="compiled")
        for m in (source, model):
            del m.vit.layers[0]
        with pytest.raises(RuntimeError, match="call the model once outside torch.compile") as raised:
            compiled(pixel_values=images())
        assert "outside torch.compile" in "\n".join(str(raised.value).splitlines()[:3])
        model(pixel_values=images())
        assert_close(compiled(pixel_values=images()).logits, source(pixel_values=images()).logits, RTOL,
                     name="compiled after the edit and one eager call")
        for m in (source, model):
            del m.vit.layers[0]
        assert_close(compiled_with_breaks(pixel_values=images()).logits, source(pixel_values=images()).logits,
                     RTOL, name="compiled without fullgraph, after an edit")


def test_hf_dropout_rates_and_modes_set_on_the_source_modules_apply():
    """Dropout set on the source's own modules after optimize: a rate (p = 1, deterministic) on the embeddings,
    a layer's dropout or its attention, and a backbone put in eval under a training classifier (a linear probe);
    the linked model kept the config's rates and the top-level mode (logits 0.07-0.42 off)."""
    settings = {
        "embeddings": lambda m: setattr(m.vit.embeddings.dropout, "p", 1.0),
        "layer dropout": lambda m: setattr(m.vit.layers[1].dropout, "p", 1.0),
        "attention": lambda m: setattr(m.vit.layers[0].attention, "attention_dropout", 1.0),
        "backbone in eval": lambda m: m.vit.eval(),
    }
    for what, setting in settings.items():
        rates = dict(attention_probs_dropout_prob=0.5, hidden_dropout_prob=0.5) if what == "backbone in eval" else {}
        source = hf_vit(**rates)
        ref, model = copy.deepcopy(source).train(), vit_fast.optimize(copy.deepcopy(source), backend="triton").train()
        setting(ref), setting(model)
        assert_close(*_logits(model, ref), RTOL, name=what)


def test_dinov2_layer_scale_replaced_after_optimize_is_applied():
    """A DINOv2 layer scale put in place of the linked one ran the old lambda1 (pooler_output 1.4 off)."""
    torch.manual_seed(0)
    config = transformers.Dinov2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                                       patch_size=16, layerscale_value=0.3)
    source = transformers.Dinov2Model(config).eval()
    model = vit_fast.optimize(copy.deepcopy(source), backend="triton")
    replacement = type(source.encoder.layer[0].layer_scale1)(transformers.Dinov2Config(hidden_size=64,
                                                                                       layerscale_value=0.5))
    for m in (source, model):
        m.encoder.layer[0].layer_scale1 = copy.deepcopy(replacement)
    with torch.no_grad():
        assert_close(model(pixel_values=images()).pooler_output, source(pixel_values=images()).pooler_output, RTOL,
                     name="pooler_output")


def test_clip_layer_wrapped_by_hand_gets_the_mask_argument_its_layer_takes():
    """A wrapper with forward(*args, **kwargs) around a CLIP layer: the layer runs as transformers' own, called as
    transformers' encoder calls it (attention_mask None; the wrapper's own signature counted no mask: TypeError)."""
    class Passing(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    torch.manual_seed(0)
    source = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32,
        patch_size=16)).eval()
    model = vit_fast.optimize(copy.deepcopy(source), backend="triton")
    for m in (source, model):
        m.encoder.layers[0] = Passing(m.encoder.layers[0])
    with torch.no_grad():
        assert_close(model(pixel_values=images()).pooler_output, source(pixel_values=images()).pooler_output, RTOL,
                     name="pooler_output")


def test_hf_fast_path_survives_transformers_capture_hooks_and_follows_edits_it_cannot_read():
    """transformers' own output-capturing hooks (installed by a first output_hidden_states call and kept) are not
    a user's: the layers keep the fast path (every layer ran as transformers' for good). A fallback forward returns
    the hidden states (None: transformers looks its recorders up by the class's name); a hook on CLIP's
    post_layernorm sees the pooled (B, D) input as on the source ((B, N, D) before); an attention scale set by hand
    runs that layer as transformers' (ignored before: logits 2e-2 off)."""
    source = hf_vit(cls=transformers.ViTModel)
    source(pixel_values=images(), output_hidden_states=True)  # installs transformers' capture hooks
    model = vit_fast.optimize(copy.deepcopy(source), backend="triton")
    assert all(block.reads_source() for block in model.vit_fast_model.blocks)
    handle = model.embeddings.register_forward_hook(lambda m, args, out: None)
    out = model(pixel_values=images(), output_hidden_states=True)
    assert model.runs_as_transformers() and len(out.hidden_states) == 3
    handle.remove()
    assert not model.runs_as_transformers() and all(b.reads_source() for b in model.vit_fast_model.blocks)

    torch.manual_seed(0)
    clip = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32,
        patch_size=16)).eval()
    fast = vit_fast.optimize(copy.deepcopy(clip), backend="triton")
    shapes = []
    for m in (clip, fast):
        m.post_layernorm.register_forward_hook(lambda mod, args, out: shapes.append(tuple(out.shape)))
    with torch.no_grad():
        assert_close(fast(pixel_values=images()).pooler_output, clip(pixel_values=images()).pooler_output, RTOL)
    assert shapes[0] == shapes[1] == (2, 64)

    source = hf_vit()
    ref, model = copy.deepcopy(source), vit_fast.optimize(copy.deepcopy(source), backend="triton")
    for m in (ref, model):
        m.vit.layers[1].attention.scaling *= 2
    assert_close(*_logits(model, ref), RTOL, name="attention scaling doubled")
