"""What `edgespec bench` adds up per configuration and temperature, and the paired speedup rule."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Dict, List


@dataclass
class Tally:
    """One configuration at one temperature: totals over all rounds, and tok/s of each round."""
    round_tokens: List[int] = field(default_factory=list)  # (rounds,)
    round_wall: List[float] = field(default_factory=list)  # (rounds,) seconds
    cycles: int = 0
    tau_sum: float = 0.0
    requests: int = 0
    prefix_tokens: int = 0  # prompt tokens whose K/V the prefix cache kept
    prompt_tokens: int = 0
    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    other: float = 0.0
    outputs: List[List[int]] = field(default_factory=list)  # token ids of every (round, prompt)
    forwards: int = 0  # target forwards, prefills included
    depth_weight: List[float] = field(default_factory=list)  # (depth,) cycles of the generations that drafted it
    depth_accept: List[float] = field(default_factory=list)  # (depth,) sum of acceptance x cycles
    draft_paths: Dict[str, int] = field(default_factory=dict)  # proposals per drafting path (DecodeStats.draft_paths)

    def add(self, r: int, res) -> None:
        s = res.stats
        if len(self.round_tokens) <= r:
            self.round_tokens.append(0)
            self.round_wall.append(0.0)
        self.round_tokens[r] += s.tokens
        self.round_wall[r] += s.wall_s
        self.cycles += s.cycles
        self.tau_sum += s.tau * s.cycles
        self.requests += 1
        self.prefix_tokens += s.prefix_tokens
        self.prompt_tokens += s.prefix_tokens + s.prefill_tokens
        self.prefill += s.prefill_s
        self.draft += s.draft_s
        self.verify += s.verify_s
        self.other += s.other_s
        self.outputs.append(list(res.token_ids))
        self.forwards += s.target_forwards
        for path, n in getattr(s, "draft_paths", {}).items():
            self.draft_paths[path] = self.draft_paths.get(path, 0) + n
        for d, a in enumerate(s.acceptance_by_depth):
            if len(self.depth_weight) <= d:
                self.depth_weight.append(0.0)
                self.depth_accept.append(0.0)
            self.depth_weight[d] += s.cycles
            self.depth_accept[d] += a * s.cycles

    def acceptance_by_depth(self) -> List[float]:
        """P(accepted length >= d | drafted depth >= d) per depth d = 1, 2, ...: each generation's own rates,
        averaged with its cycles as weights."""
        return [a / w for a, w in zip(self.depth_accept, self.depth_weight) if w > 0]

    def round_tps(self) -> List[float]:
        return [t / w for t, w in zip(self.round_tokens, self.round_wall)]


def paired_speedup(tps: List[float], base_tps: List[float]) -> Dict[str, object]:
    """Median, min and max of the per-round ratios tps[r] / base_tps[r].

    >>> paired_speedup([80, 84, 30], [40, 38, 20])["speedup"]
    2.0"""
    ratios = [a / b for a, b in zip(tps, base_tps)]
    return {"speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "speedup_per_round": ratios}
