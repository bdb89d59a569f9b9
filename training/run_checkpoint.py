"""The resumable checkpoint every training script here keeps (train_eagle, train_dflash,
train_mtp, train_draft): the trained module's weights under the script's own key, the optimizer,
the LR schedule, the step, and what else the script needs to resume exactly (its log rows, the
elapsed time). Rerunning a script with the same --work-dir resumes from it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def resume(ckpt: Path, key: str, module: torch.nn.Module, opt, sched) -> dict | None:
    """Load `ckpt` into module / opt / sched when it exists (saying so on stderr) and return the
    whole state (step and the script's extras); None for a fresh run."""
    if not ckpt.is_file():
        return None
    state = torch.load(ckpt, weights_only=False)
    module.load_state_dict(state[key])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    print(f"resumed from step {state['step']}", file=sys.stderr)
    return state


def save(ckpt: Path, key: str, module: torch.nn.Module, opt, sched, step: int, **extra) -> None:
    torch.save({key: module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step,
                **extra}, ckpt)
