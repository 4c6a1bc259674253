"""Where the trainer runs: the device (--device auto|cpu|cuda) and this process's place in a torchrun job (NCCL
between GPUs, one per process by LOCAL_RANK; gloo on CPU)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def resolve_device(name: str) -> str:
    """--device auto|cpu|cuda -> cpu or cuda (auto: cuda when torch sees a GPU). ConfigError for cuda without one."""
    from runtime.errors import ConfigError

    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device: got {name!r}, expected auto, cpu or cuda")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False); "
                          "use --device cpu, or install a CUDA build of torch")
    return name


@dataclass
class Dist:
    """This process's place in a torchrun job (world 1 when run plainly): NCCL on GPUs, gloo on CPU."""
    rank: int = 0
    world: int = 1
    device: str = "cpu"

    @classmethod
    def from_env(cls, device: str = "cpu") -> "Dist":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if device == "cuda":  # one GPU per process, by its local rank
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
        if world <= 1:
            return cls(device=device)
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        return cls(dist.get_rank(), world, device)

    def mean(self, value: float) -> float:
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=self.device)  # NCCL reduces GPU tensors only
        dist.all_reduce(t)
        return float(t.item()) / self.world

    def agree(self, flag: bool) -> bool:
        """Rank 0's flag in every process (a stop decision must be the same everywhere)."""
        if self.world == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], device=self.device)
        dist.broadcast(t, 0)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
