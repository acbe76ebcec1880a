"""OnebitAdam inside Hugging Face's Trainer, on N ranks with torchrun (gloo on CPU, nccl on GPUs).

    torchrun --nproc-per-node 2 examples/hf_trainer/train.py --steps 40 --freeze-step 10

A tiny BERT (built from a config, no download) learns masked tokens of a synthetic corpus.
Trainer wraps the model in DDP itself; ``attach_trainer`` gives that DDP the onebit hook, so the
gradients are averaged once in warmup (by DDP, overlapped with backward) and not at all in the
compression phase, where OnebitAdam averages the 1-bit compressed momentum instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

from onebit import OnebitAdam
from onebit.integrations import attach_trainer


def synthetic_corpus(size: int, vocab: int, length: int, seed: int = 0) -> list[dict]:
    """Sequences with structure to learn: token t+1 follows token t (mod vocab), 15% masked."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(size):
        start = int(torch.randint(4, vocab, (1,), generator=gen))
        ids = 4 + (start + torch.arange(length)) % (vocab - 4)
        labels = torch.full_like(ids, -100)
        masked = torch.rand(length, generator=gen) < 0.15
        labels[masked] = ids[masked]
        ids = ids.clone()
        ids[masked] = 3  # [MASK]
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--freeze-step", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    parser.add_argument("--result", default=None, help="write each rank's final state summary to RESULT.rank<r>.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", 0)) == 0 else logging.WARNING)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)  # the same initial weights on every rank
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32)
    model = BertForMaskedLM(config)
    optimizer = OnebitAdam(model.parameters(), lr=args.lr, freeze_step=args.freeze_step)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=8, max_steps=args.steps, logging_steps=10,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        seed=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=synthetic_corpus(512, 64, 16),
                      optimizers=(optimizer, scheduler))
    attach_trainer(trainer)
    trainer.train()
    stats = optimizer.comm_stats()
    if args.result:
        rank = dist.get_rank() if dist.is_initialized() else 0
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        with open(f"{args.result}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "param_sum": float(flat.double().sum()),
                       "param_abs_sum": float(flat.double().abs().sum()), "numel": flat.numel(),
                       "sizes": [p.numel() for p in model.parameters()], "stats": stats,
                       "train_loss": trainer.state.log_history[-1].get("train_loss")}, f)
    if dist.is_initialized():
        dist.barrier()  # every rank done with its collectives before any rank tears the group down
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: teardown.py
    from teardown import exit_skipping_teardown

    exit_skipping_teardown()  # a SIGABRT at exit failed CI once
