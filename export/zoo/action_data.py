"""Action domain (RT-2 / OpenVLA style): instruction + observation -> a chunk of 7-D actions as bin tokens.

A simulated 7-DoF end effector follows a waypoint program chosen by the instruction (pick, place, push, reach,
go home) with a saturated proportional controller plus small Gaussian noise, so consecutive actions are smooth
and physically plausible. Each example starts from a random state rolled forward a random number of steps, so
the observations cover every phase of each program.

Observation (OBS_DIMS=8): ee x y z (m), ee yaw (rad), gripper opening (0 closed .. 1 open), goal x y z (m).
Action (7): dx dy dz droll dpitch dyaw (per step) and the commanded gripper opening.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from runtime.text.actions import DEFAULT_HIGH, DEFAULT_LOW
from runtime.text.prompts import ACTION_CHUNK, ACTION_TOKENS, EOS, action_prompt, format_observation
from export.zoo.planner_data import ATTRIBUTES, NOUNS, SURFACES

MAX_STEP = 0.05  # m per step, the controller's saturation (= the action range)
GAIN = 0.5
HOME = (0.35, 0.0, 0.35)
DIRECTIONS = {"left": (0.0, 1.0), "right": (0.0, -1.0), "forward": (1.0, 0.0), "back": (-1.0, 0.0)}


@dataclass(frozen=True)
class ActionExample:
    instruction: str
    observation: tuple  # (OBS_DIMS,) floats, rounded as in the prompt
    actions: tuple  # (ACTION_CHUNK, 7) floats (continuous, before binning)

    @property
    def prompt(self) -> str:
        return action_prompt(self.instruction, self.observation)

    def answer(self, bins: np.ndarray) -> str:
        return "".join(ACTION_TOKENS[b] for b in bins) + EOS


def to_bins(actions) -> np.ndarray:
    """(N, 7) -> (N*7,) bin indices (the same rule as runtime.text.actions.ActionTokenizer.encode)."""
    low, high = np.asarray(DEFAULT_LOW), np.asarray(DEFAULT_HIGH)
    a = np.clip(np.asarray(actions, dtype=np.float64), low, high)
    return np.clip(np.floor((a - low) / ((high - low) / 256)), 0, 255).astype(np.int64).reshape(-1)


def _program(task: str, p, g, goal, direction) -> Tuple[np.ndarray, float]:
    """The waypoint and gripper command for the current state (a pure function of the observation)."""
    q = np.asarray(goal)
    dxy = float(np.hypot(p[0] - q[0], p[1] - q[1]))
    if task == "pick":
        if g <= 0.5:
            return q + (0, 0, 0.15), 0.0  # holding: lift
        if dxy > 0.02:
            return q + (0, 0, 0.08), 1.0  # approach above the object
        return q, (0.0 if abs(p[2] - q[2]) < 0.015 else 1.0)  # descend, close when there
    if task == "place":
        if g > 0.5:
            return q + (0, 0, 0.15), 1.0  # released: retreat
        if dxy > 0.02:
            return q + (0, 0, 0.10), 0.0
        target = q + (0, 0, 0.02)
        return target, (1.0 if abs(p[2] - target[2]) < 0.015 else 0.0)
    if task == "push":
        return q + (0.12 * direction[0], 0.12 * direction[1], 0.02), 0.0
    if task == "reach":
        return q + (0, 0, 0.05), float(g > 0.5)
    return np.asarray(HOME), float(g > 0.5)


def _step(p, yaw, g, waypoint, grip_cmd, rng: np.random.Generator):
    d = np.clip(GAIN * (waypoint - p), -MAX_STEP * 0.9, MAX_STEP * 0.9) + rng.normal(0, 0.002, 3)
    rp = rng.normal(0, 0.01, 2)
    dyaw = float(np.clip(-0.3 * yaw, -0.18, 0.18) + rng.normal(0, 0.005))
    action = np.array([*d, *rp, dyaw, grip_cmd])
    p = p + d
    yaw = yaw + dyaw
    g = g + float(np.clip(grip_cmd - g, -0.5, 0.5))  # the gripper takes two steps to open or close
    return action, p, yaw, g


def generate_action_example(rng: random.Random) -> ActionExample:
    nrng = np.random.default_rng(rng.getrandbits(63))
    task = rng.choices(["pick", "place", "push", "reach", "home"], weights=[30, 30, 15, 17, 8])[0]
    noun = rng.choice(list(NOUNS))
    obj = f"{rng.choice(ATTRIBUTES)} {noun}" if rng.random() < 0.6 else noun
    direction = (0.0, 0.0)
    if task == "pick":
        instruction = rng.choice([f"pick up the {obj}", f"grasp the {obj}", f"lift the {obj}"])
        g = 1.0
    elif task == "place":
        surface = rng.choice(SURFACES)
        instruction = rng.choice([f"place the {obj} on the {surface}", f"put down the {obj} on the {surface}"])
        g = 0.0
    elif task == "push":
        dname = rng.choice(list(DIRECTIONS))
        direction = DIRECTIONS[dname]
        instruction = rng.choice([f"push the {obj} {dname}", f"slide the {obj} {dname}"])
        g = 0.0
    elif task == "reach":
        instruction = rng.choice([f"reach the {obj}", f"move to the {obj}", f"go to the {obj}"])
        g = float(rng.random() < 0.5)
    else:
        instruction = rng.choice(["go home", "return to the home pose", "move back to home"])
        g = float(rng.random() < 0.5)
    p = np.array([rng.uniform(0.2, 0.6), rng.uniform(-0.3, 0.3), rng.uniform(0.1, 0.5)])
    yaw = rng.uniform(-0.6, 0.6)
    goal = np.array([rng.uniform(0.25, 0.6), rng.uniform(-0.3, 0.3), rng.uniform(0.0, 0.15)])
    for _ in range(rng.randrange(0, 20)):  # roll forward to a random phase of the program
        wp, cmd = _program(task, p, g, goal, direction)
        _, p, yaw, g = _step(p, yaw, g, wp, cmd, nrng)
    # The chunk is computed from the observation as the model will see it (rounded to 2 decimals).
    obs = tuple(round(float(v), 2) for v in (*p, yaw, g, *goal))
    p, yaw, g, goal = np.array(obs[:3]), obs[3], obs[4], np.array(obs[5:])
    actions = []
    for _ in range(ACTION_CHUNK):
        wp, cmd = _program(task, p, g, goal, direction)
        a, p, yaw, g = _step(p, yaw, g, wp, cmd, nrng)
        actions.append(a)
    return ActionExample(instruction, obs, tuple(map(tuple, np.asarray(actions))))


def generate_action_examples(seed: int, n: int) -> List[ActionExample]:
    rng = random.Random(seed)
    return [generate_action_example(rng) for _ in range(n)]


def action_text(ex: ActionExample) -> str:
    return ex.prompt + ex.answer(to_bins(ex.actions))


def split_actions(seed: int, n_train: int, n_heldout: int):
    return generate_action_examples(seed * 1000 + 3, n_train), generate_action_examples(seed * 1000 + 4, n_heldout)


__all__ = ["ActionExample", "generate_action_example", "generate_action_examples", "action_text", "to_bins",
           "split_actions", "format_observation"]
