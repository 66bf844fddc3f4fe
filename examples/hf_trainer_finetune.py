"""Fine-tune a transformers ViTForImageClassification with the stock Hugging Face Trainer on vit_fast.

The only vit_fast line is marked. Everything else is the usual Trainer script: the Trainer trains, evaluates
and saves as for the source model, and what it saves (config.json + weights under transformers' names) loads
back with stock ``ViTForImageClassification.from_pretrained``.

    python examples/hf_trainer_finetune.py --model google/vit-base-patch16-224 --out /tmp/vit-ft
    python examples/hf_trainer_finetune.py --tiny --out /tmp/vit-ft     # random tiny model, CPU, seconds

Needs: pip install transformers accelerate. Without a GPU the model runs the PyTorch reference path.
"""
import argparse

import torch
import transformers

import vit_fast


class RandomImages(torch.utils.data.Dataset):
    """Stand-in data set (replace with yours: each item a dict with pixel_values and labels)."""

    def __init__(self, n: int, size: int, classes: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, size, size, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="google/vit-base-patch16-224", help="hub id or local directory")
    parser.add_argument("--tiny", action="store_true", help="a random 2-block model at 32 px instead of --model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    if args.tiny:
        config = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=128, image_size=32, patch_size=8, num_labels=3)
        model = transformers.ViTForImageClassification(config)
    else:
        model = transformers.ViTForImageClassification.from_pretrained(args.model)

    model = vit_fast.optimize(model)  # <- the one line: same weights, config, forward arguments and outputs

    size, classes = model.config.image_size, model.config.num_labels
    data = RandomImages(64, size, classes)
    training_args = transformers.TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=8, per_device_eval_batch_size=8,
        learning_rate=1e-4, bf16=torch.cuda.is_available(), report_to=[],
        save_strategy="no", logging_steps=5)
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=data, eval_dataset=data)
    trainer.train()
    print(trainer.evaluate())
    trainer.save_model(args.out)
    stock = transformers.ViTForImageClassification.from_pretrained(args.out)  # stock transformers reads it
    print(f"saved to {args.out}; reloaded as {type(stock).__name__} with stock transformers")


if __name__ == "__main__":
    main()
