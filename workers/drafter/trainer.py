"""A deterministic, preemptible EAGLE drafter trainer over the TrainingBuffer.

One optimizer step = `micro_per_step` micro-steps of `items_per_micro` buffer items each, taken
in the buffer's epoch order (one-step offset). A cursor (epoch, order, position) advances when an
optimizer step is applied, so every item of an epoch order is trained exactly once; a step
stopped between micro-steps keeps its accumulated gradients and micro-step index (saved with the
state), and resumes with its next micro-step, so an interrupted run computes exactly what an
uninterrupted one does.
Only fc + the decoder layer are trained (AdamW, linear warm-up, gradient clipping); the target's
embeddings and lm_head are used by reference, frozen, and never saved.

Hidden states, cached or recomputed (`TrainingBuffer(keep_hidden=...)`): a cached feature costs
2*H bytes/token in bf16; recomputing costs one target prefill (chunked, KV-cached, with stop
checks between chunks) on the idle device. benchmarks/bench_hidden_recompute.py, CPU, 1 thread,
items of 256 tokens, 4 per step, measured side by side:

    H    layers  cached B/token  ids-only B/token  step cached  step recomputed  slowdown
    256  8       520             8                 0.69 s       1.39 s           2.0x
    512  8       1032            8                 1.72 s       4.44 s           2.6x

Choice: keep hidden states for the project's small policies (a 64 MiB buffer holds ~128k
tokens at H=256, and training runs at twice the speed), recompute for large ones (H=4096 is
8 KiB/token: 64 GiB for the ~8M tokens of one RL step), where a GPU prefill is also a smaller
fraction of the step than on CPU. The choice is per buffer; both paths train identically
(tests/drafter/test_trainer.py).
"""

from __future__ import annotations

import enum
import json
import os
import re
import shutil
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from tltd.contract.checkpoint import check_drafter_tensors
from tltd.contract.drafter_messages import StepResult, TrainerConfig
from tltd_workers.drafter.buffer import TrainingBuffer, TrainItem
from tltd_workers.drafter.forward import drafter_features, target_hidden
from tltd_workers.drafter.objective import EagleExample, align, eagle_loss
from tltd_workers.drafter.packing import pack
from tltd_workers.engine.eagle import EagleDrafter


@dataclass
class Cursor:
    epoch: int = 0  # epochs started so far
    order: list[int] = field(default_factory=list)  # item ids of the current epoch
    pos: int = 0  # items of `order` consumed by applied optimizer steps


class Stop(enum.StrEnum):
    PREEMPTED = "preempted"  # a stop was requested between micro-steps; nothing was applied
    NO_DATA = "no_data"


@dataclass(frozen=True)
class TrainerState:
    """Host copies of everything a resume needs (written by `save_state`)."""

    params: dict[str, Tensor]  # trainable parameters only
    optim: dict[str, Tensor]  # AdamW moments and step counts, by parameter name
    rng: Tensor
    meta: dict  # step, cursor, config, drafter config


@dataclass
class _Pending:
    """An optimizer step in progress: its items, and how many of them are in the gradients."""

    items: list[TrainItem]
    skipped: list[int]
    end: int  # cursor position once this step is applied
    total: int  # masked positions of the whole step (the loss is a mean over them)
    done: int = 0
    seconds: float = 0.0
    sums: dict[str, float] = field(
        default_factory=lambda: {"loss": 0.0, "reg": 0.0, "ce": 0.0, "top1": 0.0, "positions": 0.0}
    )


class _Interrupted(Exception):
    pass


def _check(stop) -> None:
    if stop():
        raise _Interrupted


def _positions(item: TrainItem) -> int:
    """Masked (response) drafter positions of an item after alignment: all are trained (a
    sample longer than a row is split into windows, workers/drafter/packing.py)."""
    return max(0, int(item.token_ids.numel()) - 1 - max(item.response_start - 1, 0))


class Trainer:
    """Trains `drafter` (fc + layer) on `buffer`; the target's weights are frozen."""

    def __init__(
        self, drafter: EagleDrafter, buffer: TrainingBuffer, config: TrainerConfig | None = None
    ) -> None:
        self.cfg = config or TrainerConfig()
        if self.cfg.row_len < 1:
            raise ValueError(f"row_len must be >= 1, got {self.cfg.row_len}")
        self.drafter = drafter.train()
        self.buffer = buffer
        for p in drafter.target.parameters():
            p.requires_grad_(False)
        # The target is held by reference (not a submodule): these are fc + layer only.
        self.params = dict(drafter.named_parameters())
        for p in self.params.values():
            p.requires_grad_(True)
        c = self.cfg
        self.opt = torch.optim.AdamW(
            list(self.params.values()),
            lr=c.lr,
            betas=c.betas,
            weight_decay=c.weight_decay,
            foreach=False,
        )
        self.step = 0
        self.cursor = Cursor()
        self._pending: _Pending | None = None
        self.last_loss = float("nan")

    @property
    def device(self) -> torch.device:
        return next(iter(self.params.values())).device

    def lr_at(self, step: int) -> float:
        return self.cfg.lr * min(1.0, (step + 1) / max(1, self.cfg.warmup_steps))

    # -- data cursor ----------------------------------------------------------------------------

    def _new_epoch(self) -> bool:
        items = self.buffer.items()
        if not items:
            return False
        current = max(it.step for it in items)
        seed = self.cfg.seed * 1_000_003 + self.cursor.epoch
        self.cursor = Cursor(
            self.cursor.epoch + 1, self.buffer.epoch_order(current, seed, self.cfg.prev_share), 0
        )
        return True

    def _take(self, n: int) -> tuple[list[TrainItem], list[int], int] | None:
        """The next n items from the cursor (never across an epoch end), without consuming."""
        if self.cursor.pos >= len(self.cursor.order) and not self._new_epoch():
            return None
        order, pos = self.cursor.order, self.cursor.pos
        items: list[TrainItem] = []
        skipped: list[int] = []
        while len(items) < n and pos < len(order):
            item = self.buffer.get(order[pos])
            if item is None:
                skipped.append(order[pos])
            else:
                items.append(item)
            pos += 1
        return items, skipped, pos

    # -- training -------------------------------------------------------------------------------

    def _examples(self, items: list[TrainItem], stop) -> list[EagleExample]:
        dev = self.device
        dtype = next(iter(self.params.values())).dtype
        out = []
        for it in items:
            if not _positions(it):
                continue  # nothing to train: not worth a prefill
            h = it.hidden
            if h is None:
                try:  # chunked: a stop never waits for a whole prefill
                    h = target_hidden(
                        self.drafter.target, [it.token_ids], self.cfg.prefill_chunk, stop
                    )[0]
                except InterruptedError:
                    raise _Interrupted from None
            out.append(align(it.token_ids.to(dev), h.to(dev, dtype), it.response_start))
        return out

    def _micro(self, items: list[TrainItem], total: int, stop) -> dict[str, float]:
        """Forward + backward of one micro-step; raises _Interrupted (grads untouched) on stop.

        The vocabulary projections (drafter and target logits) dominate the cost, so the loss is
        computed `loss_chunk` positions at a time against a detached copy of the drafter's
        features, checking `stop` between chunks; the parameters only receive gradients in the
        final backward through the drafter, after the last check.
        """
        examples = self._examples(items, stop)
        _check(stop)
        if not examples:
            return {"loss": 0.0, "reg": 0.0, "ce": 0.0, "top1": 0.0, "positions": 0.0}
        batch = pack(examples, self.cfg.row_len)
        mask = batch.loss_mask
        pred = drafter_features(
            self.drafter, batch.hidden_in, batch.next_ids, batch.positions, batch.attn_mask
        )[mask]
        target = batch.hidden_target[mask]
        feats = pred.detach().requires_grad_(True)
        n = feats.shape[0]
        sums = {"loss": 0.0, "reg": 0.0, "ce": 0.0, "top1": 0.0}
        for a in range(0, n, self.cfg.loss_chunk):
            _check(stop)
            sl = slice(a, a + self.cfg.loss_chunk)
            with torch.no_grad():
                target_logits = self.drafter.logits(target[sl])
            ones = torch.ones(feats[sl].shape[0], dtype=torch.bool, device=feats.device)
            loss, parts = eagle_loss(
                feats[sl], target[sl], self.drafter.logits(feats[sl]), target_logits, ones
            )
            # eagle_loss is a mean over the chunk; weight it to a mean over the whole step.
            (loss * (parts["positions"] / total)).backward()
            parts["loss"] = float(loss.detach())
            for k in sums:
                sums[k] += parts[k] * parts["positions"] / max(n, 1)
        _check(stop)
        if feats.grad is not None:
            pred.backward(feats.grad)
        return {**sums, "positions": float(n)}

    def train_step(self, should_stop=lambda: False) -> StepResult | Stop:
        """Apply one optimizer step, or return a Stop.

        `should_stop()` is checked before every micro-step and inside it (between item
        prefills and loss chunks), so a stop is honoured within a fraction of a micro-step; the
        interrupted micro-step is redone on resume. A step stopped part-way keeps its
        accumulated gradients and its position (`state()` saves both): the next call continues
        with the next micro-step, so preemptions more frequent than a whole step still make
        progress and change nothing in the result.
        """
        c = self.cfg
        if self._pending is None:
            started = self._start_step(should_stop)
            if isinstance(started, Stop):
                return started
            self._pending = started
        p = self._pending
        while p.done < len(p.items):
            if should_stop():
                return Stop.PREEMPTED
            t0 = time.perf_counter()
            try:
                parts = self._micro(
                    p.items[p.done : p.done + c.items_per_micro], p.total, should_stop
                )
            except _Interrupted:
                return Stop.PREEMPTED
            w = parts["positions"] / p.total
            for k in ("loss", "reg", "ce", "top1"):
                p.sums[k] += parts[k] * w
            p.sums["positions"] += parts["positions"]
            p.done += c.items_per_micro
            p.seconds += time.perf_counter() - t0
        grad_norm = torch.nn.utils.clip_grad_norm_(list(self.params.values()), c.max_grad_norm)
        lr = self.lr_at(self.step)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self.cursor.pos = p.end
        self._pending = None
        s = p.sums
        self.last_loss = s["loss"]
        return StepResult(
            self.step,
            s["loss"],
            s["reg"],
            s["ce"],
            s["top1"],
            int(s["positions"]),
            float(grad_norm),
            lr,
            tuple(it.item_id for it in p.items),
            tuple(p.skipped),
            p.seconds,
        )

    def _start_step(self, should_stop) -> _Pending | Stop:
        """The items of the next optimizer step (gradients zeroed), or why there are none."""
        c = self.cfg
        while True:
            if should_stop():
                return Stop.PREEMPTED
            taken = self._take(c.items_per_micro * c.micro_per_step)
            if taken is None:
                return Stop.NO_DATA
            items, skipped, end = taken
            if items:
                break
            self.cursor.pos = end  # only evicted ids left in this epoch: move past them
        self.opt.zero_grad(set_to_none=True)
        total = sum(_positions(it) for it in items) or 1
        return _Pending(items, skipped, end, total)

    # -- state ----------------------------------------------------------------------------------

    def state(self) -> TrainerState:
        """Host copies of trainable params, optimizer state, cursor, step and RNG."""
        params = {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}
        optim: dict[str, Tensor] = {}
        for n, p in self.params.items():
            for k, v in self.opt.state.get(p, {}).items():
                optim[f"{n}::{k}"] = torch.as_tensor(v).detach().to("cpu", copy=True)
        pending = None
        if self._pending is not None:
            pd = self._pending
            pending = {
                "item_ids": [it.item_id for it in pd.items],
                "skipped": pd.skipped,
                "end": pd.end,
                "total": pd.total,
                "done": pd.done,
                "sums": pd.sums,
                "seconds": pd.seconds,
            }
            for n, p in self.params.items():
                if p.grad is not None:
                    optim[f"{n}::grad"] = p.grad.detach().to("cpu", copy=True)
        meta = {
            "step": self.step,
            "cursor": asdict(self.cursor),
            "trainer": asdict(self.cfg),
            "last_loss": self.last_loss,
            "pending": pending,
            "architecture": "eagle1",
            "target": asdict(self.drafter.config),
        }
        return TrainerState(params, optim, torch.get_rng_state(), meta)

    def restore(self, state: TrainerState) -> None:
        """Put the trainer back exactly where `state` was taken."""
        check_drafter_tensors(state.params, "state")
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(state.params[n])
        for p in self.params.values():
            self.opt.state.pop(p, None)
        grads: dict[str, Tensor] = {}
        for key, v in state.optim.items():
            n, k = key.split("::")
            p = self.params[n]
            if k == "grad":
                grads[n] = v
            else:
                self.opt.state.setdefault(p, {})[k] = v.clone() if k == "step" else v.to(p.device)
        torch.set_rng_state(state.rng)
        self.step = int(state.meta["step"])
        cur = state.meta["cursor"]
        self.cursor = Cursor(int(cur["epoch"]), [int(i) for i in cur["order"]], int(cur["pos"]))
        self.last_loss = float(state.meta.get("last_loss", float("nan")))
        self._pending = None
        for p in self.params.values():
            p.grad = None
        pd = state.meta.get("pending")
        items = [self.buffer.get(i) for i in pd["item_ids"]] if pd else []
        # A partial step resumes only with all of its items (a restarted worker whose buffer
        # lost some redoes the step from its start: the cursor has not moved past it).
        if pd and all(it is not None for it in items):
            self._pending = _Pending(
                items,
                list(pd["skipped"]),
                int(pd["end"]),
                int(pd["total"]),
                int(pd["done"]),
                float(pd["seconds"]),
                dict(pd["sums"]),
            )
            for n, g in grads.items():
                self.params[n].grad = g.to(self.params[n].device)

    def release_device(self) -> None:
        """Move trainable and optimizer tensors off an accelerator (CPU: nothing to free)."""
        if self.device.type == "cpu":
            return
        self._move("cpu")
        torch.cuda.empty_cache()

    def reclaim_device(self, device: str) -> None:
        if self.device != torch.device(device):
            self._move(device)

    def _move(self, device: str) -> None:
        self.drafter.target.to(device)
        self.drafter.to(device)
        for st in self.opt.state.values():
            for k, v in st.items():
                if k != "step":
                    st[k] = v.to(device)


# -- checkpoints (safetensors + json, written off the training thread) ---------------------------

LATEST = "LATEST"


def save_state(state: TrainerState, root: str | Path) -> Path:
    """Write a checkpoint dir under root and point root/LATEST at it (atomic rename).

    Layout (also loadable by `EagleDrafter.from_pretrained`): config.json, model.safetensors
    (trainable parameters only: fc.*, layer.*), optimizer.safetensors, trainer.json.
    """
    root = Path(root)
    name = f"step-{state.meta['step']:08d}-{uuid.uuid4().hex[:6]}"
    tmp = root / f".{name}.tmp"
    tmp.mkdir(parents=True)
    try:
        save_file(state.params, str(tmp / "model.safetensors"))
        save_file({**state.optim, "rng::torch": state.rng}, str(tmp / "optimizer.safetensors"))
        cfg = {"architecture": state.meta["architecture"], "target": state.meta["target"]}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "trainer.json").write_text(json.dumps(state.meta))
    except (OSError, SafetensorError) as exc:
        # A full disk: free what was written (the previous checkpoint and LATEST are untouched)
        # and say which checkpoint failed.
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(exc, f"drafter checkpoint not written under {root}") from exc
    os.replace(tmp, root / name)
    pointer = root / f".{LATEST}.{uuid.uuid4().hex[:6]}"
    pointer.write_text(name)
    os.replace(pointer, root / LATEST)
    for old in sorted(p for p in root.glob("step-*") if p.name != name)[:-1]:
        _rmtree(old)  # keep the previous checkpoint too, in case the newest is being read
    return root / name


def write_error(exc: Exception, what: str) -> OSError:
    """An OSError saying `what`, with the errno of a failed write (safetensors reports a full
    disk as SafetensorError "... (os error 28)", not as an OSError)."""
    code = getattr(exc, "errno", None)
    if code is None and (m := re.search(r"os error (\d+)", str(exc))):
        code = int(m.group(1))
    return OSError(code, f"{what}: {exc}")


def _rmtree(path: Path) -> None:
    for f in path.iterdir():
        f.unlink()
    path.rmdir()


def latest_checkpoint(root: str | Path) -> Path | None:
    pointer = Path(root) / LATEST
    return Path(root) / pointer.read_text().strip() if pointer.exists() else None


def load_state(path: str | Path) -> TrainerState:
    path = Path(path)
    optim = load_file(str(path / "optimizer.safetensors"))
    rng = optim.pop("rng::torch")
    meta = json.loads((path / "trainer.json").read_text())
    params = load_file(str(path / "model.safetensors"))
    check_drafter_tensors(params, path)
    return TrainerState(params, optim, rng, meta)


class CheckpointWriter:
    """Writes TrainerStates on one background thread so the training loop never waits on disk."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter-ckpt")
        self._last: Future[Path] | None = None
        self._lock = threading.Lock()

    def submit(self, state: TrainerState) -> Future[Path]:
        with self._lock:
            self._last = self._pool.submit(save_state, state, self.root)
            return self._last

    def wait(self) -> Path | None:
        last = self._last
        return last.result() if last is not None else None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
