"""A Hugging Face Trainer script as its docs write one (no ptops in it): a small causal LM built
from a config, a toy dataset, checkpoints every --save-steps, and a restart resumes from the last
one (`get_last_checkpoint`). `torchrun --nproc-per-node 2 hf_trainer.py --output-dir out` runs it.
"""

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint


class ToyText(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", default="hf-out")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--save-steps", type=int, default=2)
    args = p.parse_args()

    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_steps=args.save_steps,
        logging_steps=1,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=ToyText(256, 16, 128))
    # the examples' idiom: the folder may not exist yet (rank 0 makes it)
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main()
