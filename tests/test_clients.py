"""The training programs people already run, unchanged but for ``model = vit_fast.optimize(model)``:
a real transformers.Trainer (train, evaluate, save_model, stock from_pretrained reload) and timm's
train.py pieces (data config, layer-decay optimizer groups, EMA, head re-init, checkpoint load / resume);
timm's model protocol on vit_fast.VisionTransformer; no global RNG side effects. Tiny models on CPU."""
import copy
import random

import numpy as np
import pytest
import timm
import torch
import transformers

import vit_fast
from vit_fast.interop.hf import HFViT
from vit_fast.presets import PRESETS, pretrained_cfg

from .numerics import assert_close, bound

RTOL = bound(torch.float32, "dot")
TINY_TIMM = dict(img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=2, num_classes=5)


def hf_source(**kw):
    torch.manual_seed(0)
    config = transformers.ViTConfig(**{**dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                              intermediate_size=128, image_size=32, patch_size=8, num_labels=3,
                                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), **kw})
    return transformers.ViTForImageClassification(config)


class Images(torch.utils.data.Dataset):
    def __init__(self, n=8, classes=3):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 3, 32, 32, generator=g, device="cpu")
        self.y = torch.randint(0, classes, (n,), generator=g, device="cpu")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def run_trainer(model, out_dir, **args):
    data = Images()
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=2,
        optim="sgd", learning_rate=0.1, report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
        dataloader_num_workers=0, seed=0, disable_tqdm=True, **args)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    trainer.train()
    return trainer, trainer.evaluate()


@pytest.mark.parametrize("backend, extra", [
    ("torch", {}), ("torch", {"activation_checkpointing": True}),
    ("torch", {"torch_compile": True, "torch_compile_backend": "aot_eager"}),
    ("triton", {}),  # the kernels (in the interpreter on CPU)
], ids=["plain", "grad_checkpointing", "torch_compile", "triton"])
def test_hf_trainer_train_evaluate_save_and_stock_reload(tmp_path, backend, extra):
    source = hf_source()
    model = vit_fast.optimize(copy.deepcopy(source), backend=backend)
    trainer, metrics = run_trainer(model, tmp_path / "fast", **extra)
    plain, plain_metrics = run_trainer(source, tmp_path / "plain", **extra)
    # the Trainer decides the same for both (it passes num_items_in_batch to both forwards)
    assert trainer.model_accepts_loss_kwargs == plain.model_accepts_loss_kwargs
    assert metrics["eval_loss"] == pytest.approx(plain_metrics["eval_loss"], rel=1e-4)
    trainer.save_model(str(tmp_path / "saved"))
    stock = transformers.ViTForImageClassification.from_pretrained(str(tmp_path / "saved")).eval()
    x = Images().x[:4]
    fast_model = trainer.model._orig_mod if hasattr(trainer.model, "_orig_mod") else trainer.model
    assert fast_model.vit_fast_model.grad_checkpointing == bool(extra.get("activation_checkpointing"))
    with torch.no_grad():
        logits = fast_model.eval()(x).logits
        assert_close(stock(x).logits, logits, RTOL, name="stock reload vs trained vit_fast")
        assert_close(logits, source.eval()(x).logits, 1e-4, name="trained vit_fast vs trained source")
        reloaded = HFViT.from_pretrained(str(tmp_path / "saved"), backend="torch").eval()
        assert_close(reloaded(x).logits, logits, RTOL, name="vit_fast reload")


def test_hf_protocol_attributes():
    source = hf_source()
    model = vit_fast.optimize(copy.deepcopy(source), backend="torch")
    assert model.num_parameters() == source.num_parameters() and not model.can_generate()
    assert model.get_input_embeddings() is model.vit.embeddings.patch_embeddings
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing and model.vit_fast_model.grad_checkpointing
    model.gradient_checkpointing_disable()
    assert not model.vit_fast_model.grad_checkpointing
    x, labels = Images().x[:4], Images().y[:4]
    want = source(x, labels=labels, num_items_in_batch=torch.tensor(2)).loss
    assert_close(model(x, labels=labels, num_items_in_batch=torch.tensor(2)).loss, want, RTOL, name="summed loss")
    with pytest.raises(ValueError, match="position_ids"):
        model(x, position_ids=torch.zeros(4, dtype=torch.long))
    sd = model.to_transformers().state_dict()  # the Trainer reloads a transformers-keyed state dict
    clone = vit_fast.optimize(copy.deepcopy(source), backend="torch")
    clone.load_state_dict({k: torch.zeros_like(v) for k, v in clone.state_dict().items()})
    clone.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(clone.state_dict().values(), model.state_dict().values()))


# ------------------------------------------------------------------------------------------------ timm
def timm_source(**kw):
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", **{**TINY_TIMM, **kw})


def test_timm_model_protocol():
    ref = timm_source(reg_tokens=2)
    model = vit_fast.optimize(copy.deepcopy(ref), backend="torch")
    for name in ("num_features", "head_hidden_size", "num_prefix_tokens", "num_reg_tokens", "num_classes",
                 "global_pool", "embed_dim", "in_chans", "has_class_token", "pool_include_prefix", "feature_info",
                 "no_embed_class", "dynamic_img_size", "grad_checkpointing"):
        assert getattr(model, name) == getattr(ref, name), name
    assert model.pretrained_cfg == ref.pretrained_cfg and model.pretrained_cfg is not ref.pretrained_cfg
    assert model.default_cfg is model.pretrained_cfg
    assert model.group_matcher() == ref.group_matcher() and model.group_matcher(True) == ref.group_matcher(True)
    assert model.no_weight_decay() <= ref.no_weight_decay()
    assert model.get_classifier() is model.head
    model.set_grad_checkpointing(True)
    assert model.grad_checkpointing


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_data_config_is_timms(name):
    from timm.data import resolve_data_config

    want = resolve_data_config(pretrained_cfg=timm.models.get_pretrained_cfg(name).to_dict())
    assert resolve_data_config(pretrained_cfg=pretrained_cfg(name)) == want
    with torch.device("meta"):
        model = vit_fast.create_model(name)
    assert resolve_data_config(model=model) == want


def test_timm_train_py_pieces(tmp_path):
    """As timm's train.py uses them: resolve_data_config(model=...), create_optimizer_v2 with layer_decay
    (same groups, lr scales and weight decay as for the source), ModelEmaV3, get_classifier + head
    re-init (--head-init-scale), timm.models.load_checkpoint and resume_checkpoint round trip."""
    from timm.data import resolve_data_config
    from timm.models import load_checkpoint, resume_checkpoint
    from timm.optim import create_optimizer_v2
    from timm.utils import ModelEmaV3

    ref = timm_source()
    model = vit_fast.optimize(copy.deepcopy(ref), backend="torch")
    assert resolve_data_config(model=model) == resolve_data_config(model=ref)

    def groups(m):
        opt = create_optimizer_v2(m, opt="adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.75)
        names = {id(p): n for n, p in m.named_parameters()}
        return opt, sorted((sorted(names[id(p)] for p in g["params"]), g["lr_scale"], g["weight_decay"])
                           for g in opt.param_groups)

    opt, got = groups(model)
    assert got == groups(ref)[1] and len(got) > 2  # one group per layer (and decay / no decay)

    ema = ModelEmaV3(model, decay=0.5)
    x = torch.randn(2, 3, 32, 32)
    before = model.head.weight.detach().clone()
    model(x).logsumexp(-1).mean().backward()
    opt.step()
    ema.update(model)
    assert isinstance(ema.module, vit_fast.VisionTransformer)
    assert_close(ema.module.head.weight, 0.5 * (before + model.head.weight), RTOL, name="EMA head")

    head = model.get_classifier()  # train.py --head-init-scale
    with torch.no_grad():
        head.weight.mul_(0.1)
        head.bias.mul_(0.1)
    model.reset_classifier(7)
    assert model.get_classifier().out_features == 7 and model(x).shape == (2, 7)

    path = tmp_path / "checkpoint.pth.tar"
    opt = groups(model)[0]  # train.py builds the optimizer after the head change
    model(x).logsumexp(-1).mean().backward()
    opt.step()
    # what timm's CheckpointSaver writes (version 2: resume continues at epoch + 1)
    torch.save({"epoch": 3, "version": 2, "state_dict": model.state_dict(), "optimizer": opt.state_dict()}, path)
    fresh = vit_fast.optimize(copy.deepcopy(ref), backend="torch")
    fresh.reset_classifier(7)
    load_checkpoint(fresh, str(path))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    resumed = copy.deepcopy(fresh)
    fresh_opt = groups(resumed)[0]
    assert resume_checkpoint(resumed, str(path), optimizer=fresh_opt) == 4
    assert str(fresh_opt.state_dict()["state"]) == str(opt.state_dict()["state"])
    with torch.no_grad():
        assert_close(resumed(x), model(x), RTOL, name="resumed logits")


# ------------------------------------------------------------------------------------------- RNG
def rng_states():
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def same_states(a, b):
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_optimize_and_create_model_leave_global_rng_alone():
    sources = [timm_source(), hf_source(), hf_source(), vit_fast.create_model("vit_tiny_patch16_224", depth=1)]
    sources[2] = transformers.ViTModel(sources[2].config)
    before = rng_states()
    for source in sources:
        vit_fast.optimize(source, backend="torch")
    vit_fast.create_model("vit_tiny_patch16_224", depth=1, img_size=32, weight_init="skip")
    assert same_states(before, rng_states())
    vit_fast.create_model("vit_tiny_patch16_224", depth=1, img_size=32)  # asked to init weights: draws
    assert not torch.equal(before[0], torch.get_rng_state())
