"""The optimisation loop both stages share: AdamW, warm-up + cosine schedule, a wall-clock budget."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

PROBE_STEPS = (10, 30)  # steps timed to resolve how many fit in the budget (after compile / autotune)
REPLAN_EVERY = 100  # then the plan is re-fitted to the measured rate every this many steps (it only shrinks)


@dataclass(frozen=True)
class Schedule:
    """Linear warm-up to `peak_lr` over `warmup` steps, then cosine to `final_fraction * peak_lr` at `total`."""

    peak_lr: float
    warmup: int
    total: int
    final_fraction: float = 0.1

    def lr(self, step: int) -> float:
        if step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr * (self.final_fraction + (1.0 - self.final_fraction) * cosine)


@dataclass(frozen=True)
class LoopOptions:
    steps: int
    lr: float
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    deadline: float = math.inf  # time.monotonic() value by which the loop must have stopped
    log_every: int = 10
    eval_every: int = 0  # 0: never during training


@dataclass(frozen=True)
class Metric:
    """A held-out figure, computed every `eval_every` steps and after the last one."""

    name: str
    compute: Callable[[], float]
    maximize: bool


@dataclass(frozen=True)
class LoopResult:
    """`losses[i]`: mean training loss of steps [i*log_every, (i+1)*log_every); `evals`: (step, metric).

    The module is left at `best_step`, the evaluation with the best metric (`best_value`).
    """

    steps: int
    planned_steps: int
    seconds: float
    losses: tuple[float, ...]
    evals: tuple[tuple[int, float], ...]
    best_step: int
    best_value: float


def resolve_device(name: str) -> torch.device:
    """"auto" picks CUDA when present. On CPU, denormals are flushed to zero: GDN decays underflow
    into them, and CPU arithmetic on denormals made training steps ~40x slower (measured)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cpu":
        torch.set_flush_denormal(True)
    return device


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)  # CPU and every CUDA device


def autocast(device: torch.device):
    """bf16 autocast on CUDA; plain fp32 on CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def run_loop(module: torch.nn.Module, step_loss: Callable[[int], torch.Tensor], options: LoopOptions,
             device: torch.device, metric: Metric, desc: str) -> LoopResult:
    """Minimise `step_loss(step)` (a scalar with grad) over the trainable parameters of `module`.

    Runs `options.steps` steps or until the deadline: from step PROBE_STEPS[1] on, the plan shrinks to
    the steps that fit at the measured rate, so the cosine schedule still completes; the deadline itself
    is a hard stop. Ends with `module` at its best evaluation (data-limited runs can overfit).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": options.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=options.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda",
    )
    schedule = Schedule(options.lr, min(options.warmup, max(1, options.steps // 10)), options.steps)
    start = time.monotonic()
    probe_start = start
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    best_state: dict[str, torch.Tensor] = {}
    best_step, best_value = -1, -math.inf if metric.maximize else math.inf

    def evaluate(step: int) -> None:
        nonlocal best_step, best_value
        value = metric.compute()
        evals.append((step, value))
        tqdm.write(f"{desc}: step {step}: {metric.name} {value:.4f}")
        if value > best_value if metric.maximize else value < best_value:  # NaN never improves
            best_step, best_value = step, value
            best_state.update({k: v.detach().clone() for k, v in module.state_dict().items()})

    running = torch.zeros((), device=device)
    bar = tqdm(total=schedule.total, desc=desc, dynamic_ncols=True, mininterval=2.0)
    step = 0
    while step < schedule.total and time.monotonic() < options.deadline:
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr(step)
        loss = step_loss(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, options.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running += loss.detach()
        step += 1
        bar.update(1)
        if step % options.log_every == 0:
            losses.append(running.item() / options.log_every)
            running.zero_()
            bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{schedule.lr(step - 1):.2e}")
        replan = step in PROBE_STEPS or (step > PROBE_STEPS[1] and step % REPLAN_EVERY == 0)
        if replan and options.deadline < math.inf:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step == PROBE_STEPS[0]:
                probe_start = time.monotonic()
            else:  # evaluations so far count in the rate, so the plan keeps room for the later ones
                seconds_per_step = (time.monotonic() - probe_start) / (step - PROBE_STEPS[0])
                fit = step + int((options.deadline - time.monotonic()) / seconds_per_step)
                if fit < schedule.total:
                    if step == PROBE_STEPS[1]:
                        tqdm.write(f"{desc}: {seconds_per_step * 1e3:.0f} ms/step, "
                                   f"budget fits {fit} of {schedule.total} steps")
                    schedule = Schedule(schedule.peak_lr, schedule.warmup, fit)
                    bar.total = fit
        if options.eval_every and step % options.eval_every == 0 and step < schedule.total:
            evaluate(step)
    bar.close()
    seconds = time.monotonic() - start
    evaluate(step)
    if best_state:
        module.load_state_dict(best_state)
    else:  # every evaluation was NaN: keep the last state, report it as is
        best_step, best_value = evals[-1]
    return LoopResult(steps=step, planned_steps=schedule.total, seconds=seconds, losses=tuple(losses),
                      evals=tuple(evals), best_step=best_step, best_value=best_value)
