"""A word-level LSTM language model trained the way pytorch/examples' word_language_model is:
its own ``batchify``/``get_batch`` loop over a token stream (no DataLoader), a plain-float
learning rate annealed after each epoch's evaluation, and a hidden state carried from batch to
batch. Made resumable with crashproof in the lines marked ``# crashproof`` (fewer than 20).

    python examples/train_words.py --dir runs/words --epochs 3
    python examples/train_words.py --dir runs/words --epochs 3 --crash-at 50   # dies
    python examples/train_words.py --dir runs/words --epochs 3                 # resumes exactly

The traps such a loop sets, and what this one does: the position in the stream is a
``ResumableSampler`` the loop reports each batch to (``record_received``); the learning rate and
the hidden state are ``crashproof.Value``s, shared with the checkpoints instead of copied into
them; the epoch's evaluation and anneal happen before the epoch's last save, which is taken
explicitly once they are done.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import crashproof as cp

BPTT = 8


class RNNModel(nn.Module):
    def __init__(self, ntoken: int, ninp: int, nhid: int) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid)
        self.drop = nn.Dropout(0.2)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid = nhid

    def forward(
        self, data: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        output, hidden = self.rnn(self.drop(self.encoder(data)), hidden)
        return self.decoder(self.drop(output)), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1, bsz, self.nhid), torch.zeros(1, bsz, self.nhid)


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous()


def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = min(BPTT, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)


def repackage(hidden: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return hidden[0].detach(), hidden[1].detach()


def evaluate(model: RNNModel, source: torch.Tensor, ntokens: int) -> float:
    model.eval()
    total, hidden = 0.0, model.init_hidden(source.size(1))
    with torch.no_grad():
        for i in range(0, source.size(0) - 1, BPTT):
            data, targets = get_batch(source, i)
            output, hidden = model(data, hidden)
            total += (
                len(data) * nn.functional.cross_entropy(output.view(-1, ntokens), targets).item()
            )
    model.train()
    return total / (len(source) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--crash-at", type=int, default=None, help="die after this batch")
    args = parser.parse_args()
    torch.manual_seed(1111)
    ntokens, bsz = 50, 4
    corpus = torch.randint(0, ntokens, (4000,), generator=torch.Generator().manual_seed(0))
    train_data, val_data = batchify(corpus[:3200], bsz), batchify(corpus[3200:], bsz)
    model = RNNModel(ntokens, 16, 32)
    criterion = nn.CrossEntropyLoss()
    nbatch = len(range(0, train_data.size(0) - 1, BPTT))
    position = cp.ResumableSampler(nbatch, shuffle=False, rank=0, world_size=1)  # crashproof
    lr = cp.Value(20.0)  # crashproof: was `lr = 20.0`
    hidden = cp.Value(model.init_hidden(bsz))  # crashproof: was `hidden = model.init_hidden(bsz)`
    best_val = cp.Value(float("inf"))  # crashproof
    state = cp.TrainState(model=model, data=position,  # crashproof
                          extra={"lr": lr, "hidden": hidden, "best_val": best_val})  # fmt: skip
    ckpt = cp.CheckpointManager(
        os.path.join(args.dir, "checkpoints"), every=cp.EverySteps(20)
    )  # crashproof
    step = ckpt.restore(state)  # crashproof
    for epoch in range(position.epoch, args.epochs):  # crashproof: was range(1, epochs + 1)
        for batch in range(position.position, nbatch):  # crashproof: was enumerate(range(...))
            data, targets = get_batch(train_data, batch * BPTT)
            hidden.value = repackage(hidden.value)
            model.zero_grad()
            output, hidden.value = model(data, hidden.value)
            criterion(output.view(-1, ntokens), targets).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr.value)
            position.record_received(1)  # crashproof
            step += 1
            if step == args.crash_at:
                os._exit(3)
            if batch + 1 < nbatch:  # crashproof: the epoch's last save follows its evaluation
                ckpt.maybe_save(step, state)  # crashproof
        val_loss = evaluate(model, val_data, ntokens)
        if val_loss < best_val.value:
            best_val.value = val_loss
        else:
            lr.value /= 4.0
        print(f"end of epoch {epoch}: validation loss {val_loss:.4f}, lr {lr.value}")
        position.finish_epoch()  # crashproof
        ckpt.save(step, state)  # crashproof: the epoch done, evaluated and annealed
    ckpt.close()  # crashproof
    torch.save(model.state_dict(), os.path.join(args.dir, "final.pt"))
    print(f"finished at step {step}, lr {lr.value}, best validation loss {best_val.value:.4f}")


if __name__ == "__main__":
    main()
