"""Planner domain: natural-language robot instructions -> a JSON plan of skill calls.

Deterministic from a seed. Variety: rooms, attributed objects, containers (an open/close precondition),
quantities, person handovers, inspections, waits, 1-3 chained goals, and replanning after a reported failure.
The grammar is regular on purpose, so that a ~9M model learns it in half an hour of CPU training.

    >>> ex = generate_planner_example(random.Random(0))
    >>> ex.instruction, ex.context, ex.plan   # plan: list of {"skill": ..., args}
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Tuple

from runtime.text.prompts import plan_to_json, planner_prompt, EOS

ROOMS = ["kitchen", "living room", "bedroom", "bathroom", "office", "garage", "hallway", "dining room",
         "lab", "laundry room", "workshop", "storage room"]
NOUNS = {  # singular -> plural
    "cup": "cups", "mug": "mugs", "bottle": "bottles", "apple": "apples", "orange": "oranges", "book": "books",
    "box": "boxes", "remote": "remotes", "towel": "towels", "plate": "plates", "bowl": "bowls", "phone": "phones",
    "screwdriver": "screwdrivers", "wrench": "wrenches", "sponge": "sponges", "notebook": "notebooks",
    "can": "cans", "jar": "jars", "toy": "toys", "pen": "pens", "charger": "chargers", "battery": "batteries",
    "banana": "bananas", "glass": "glasses", "spoon": "spoons", "hammer": "hammers", "tablet": "tablets",
}
ATTRIBUTES = ["red", "blue", "green", "yellow", "black", "white", "small", "large", "empty", "metal", "wooden",
              "plastic"]
CONTAINERS = ["fridge", "drawer", "cabinet", "cupboard", "oven", "closet", "microwave", "dishwasher", "locker",
              "toolbox"]
SURFACES = ["table", "counter", "shelf", "desk", "sink", "bed", "sofa", "tray", "bin", "workbench", "cart"]
PEOPLE = ["Alice", "Bob", "Carol", "Dan", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy"]
FIXTURES = ["stove", "window", "door", "light", "faucet", "heater", "printer", "plant", "floor", "socket"]
NUMBERS = {2: "two", 3: "three", 4: "four"}

# Failure reason -> the steps inserted before the failed step is retried.
FAILURES = {
    "navigate": [("door closed", lambda s: [{"skill": "open", "object": "door"}]),
                 ("path blocked", lambda s: [{"skill": "wait", "seconds": 5}])],
    "pick": [("not found", lambda s: [{"skill": "inspect", "object": s["object"]}]),
             ("grasp failed", lambda s: [{"skill": "wait", "seconds": 2}])],
    "place": [("target occupied", lambda s: [{"skill": "inspect", "object": s["target"]}])],
    "open": [("stuck", lambda s: [{"skill": "wait", "seconds": 3}])],
    "close": [("stuck", lambda s: [{"skill": "wait", "seconds": 3}])],
    "handover": [("person busy", lambda s: [{"skill": "wait", "seconds": 10}])],
    "inspect": [("view blocked", lambda s: [{"skill": "wait", "seconds": 2}])],
    "wait": [("interrupted", lambda s: [])],
}


@dataclass(frozen=True)
class PlannerExample:
    instruction: str
    context: str
    plan: tuple  # of dict steps

    @property
    def prompt(self) -> str:
        return planner_prompt(self.instruction, self.context)

    @property
    def answer(self) -> str:
        return plan_to_json(list(self.plan)) + EOS

    @property
    def text(self) -> str:
        return self.prompt + self.answer


def _obj(rng: random.Random) -> str:
    noun = rng.choice(list(NOUNS))
    return f"{rng.choice(ATTRIBUTES)} {noun}" if rng.random() < 0.7 else noun


class _Planner:
    """Builds one goal at a time, tracking the robot's room so that a repeated navigate is skipped."""

    def __init__(self):
        self.room = None
        self.steps: List[Dict] = []

    def go(self, room: str):
        if room != self.room:
            self.steps.append({"skill": "navigate", "room": room})
            self.room = room

    def add(self, step: Dict):
        self.steps.append(step)


def _goal(rng: random.Random, p: _Planner) -> str:
    kind = rng.choices(["fetch", "move", "container_get", "container_put", "count", "inspect", "open", "give",
                        "wait"], weights=[16, 16, 10, 8, 10, 10, 6, 12, 4])[0]
    room, room2 = rng.sample(ROOMS, 2)
    obj = _obj(rng)
    surface = rng.choice(SURFACES)
    if kind == "fetch":
        p.go(room)
        p.add({"skill": "pick", "object": obj})
        p.go("start")
        p.add({"skill": "handover", "object": obj, "person": "user"})
        verb = rng.choice(["bring me", "fetch me", "get me", "grab me", "I need"])
        return rng.choice([f"{verb} the {obj} from the {room}", f"{verb} the {obj} in the {room}"])
    if kind == "move":
        same = rng.random() < 0.3
        dest = room if same else room2
        p.go(room)
        p.add({"skill": "pick", "object": obj})
        p.go(dest)
        p.add({"skill": "place", "object": obj, "target": surface})
        verb = rng.choice(["put", "move", "take", "carry", "place"])
        if same:
            return f"{verb} the {obj} in the {room} on the {surface}"
        return rng.choice([f"{verb} the {obj} from the {room} to the {surface} in the {dest}",
                           f"{verb} the {obj} in the {room} onto the {surface} in the {dest}"])
    if kind == "container_get":
        box = rng.choice(CONTAINERS)
        p.go(room)
        p.add({"skill": "open", "object": box})
        p.add({"skill": "pick", "object": obj})
        p.add({"skill": "close", "object": box})
        p.add({"skill": "place", "object": obj, "target": surface})
        return rng.choice([f"take the {obj} out of the {box} in the {room} and put it on the {surface}",
                           f"get the {obj} from the {box} in the {room} onto the {surface}"])
    if kind == "container_put":
        box = rng.choice(CONTAINERS)
        p.go(room)
        p.add({"skill": "pick", "object": obj})
        p.add({"skill": "open", "object": box})
        p.add({"skill": "place", "object": obj, "target": box})
        p.add({"skill": "close", "object": box})
        return rng.choice([f"put the {obj} in the {room} into the {box}",
                           f"store the {obj} from the {room} in the {box}"])
    if kind == "count":
        n = rng.choice(list(NUMBERS))
        noun = rng.choice(list(NOUNS))
        attr = rng.choice(ATTRIBUTES) + " " if rng.random() < 0.5 else ""
        obj = attr + noun
        p.go(room)
        p.add({"skill": "pick", "object": obj, "count": n})
        p.go(room2)
        p.add({"skill": "place", "object": obj, "target": surface, "count": n})
        return rng.choice([f"bring {NUMBERS[n]} {attr}{NOUNS[noun]} from the {room} to the {surface} in the {room2}",
                           f"move {NUMBERS[n]} {attr}{NOUNS[noun]} from the {room} onto the {surface} in the {room2}"])
    if kind == "inspect":
        thing = rng.choice(FIXTURES) if rng.random() < 0.5 else obj
        p.go(room)
        p.add({"skill": "inspect", "object": thing})
        return rng.choice([f"check the {thing} in the {room}", f"inspect the {thing} in the {room}",
                           f"look at the {thing} in the {room}", f"see if the {thing} in the {room} is ok"])
    if kind == "open":
        box = rng.choice(CONTAINERS)
        verb = rng.choice(["open", "close"])
        p.go(room)
        p.add({"skill": verb, "object": box})
        return f"{verb} the {box} in the {room}"
    if kind == "give":
        person = rng.choice(PEOPLE)
        p.go(room)
        p.add({"skill": "pick", "object": obj})
        p.go(room2)
        p.add({"skill": "handover", "object": obj, "person": person})
        return rng.choice([f"give the {obj} from the {room} to {person} in the {room2}",
                           f"hand the {obj} in the {room} to {person} in the {room2}",
                           f"take the {obj} from the {room} to {person} in the {room2}"])
    secs = rng.choice([2, 3, 5, 10, 15, 20, 30, 60])
    p.add({"skill": "wait", "seconds": secs})
    return rng.choice([f"wait {secs} seconds", f"pause for {secs} seconds"])


def generate_planner_example(rng: random.Random, replan_prob: float = 0.2) -> PlannerExample:
    n_goals = rng.choices([1, 2, 3], weights=[50, 35, 15])[0]
    while True:
        p = _Planner()
        phrases = [_goal(rng, p) for _ in range(n_goals)]
        if any(s["skill"] != "wait" for s in p.steps):  # a plan of waits only is not a task
            break
    joiners = [", then ", " and then ", ". after that, ", ", and "]
    instruction = phrases[0]
    for ph in phrases[1:]:
        instruction += rng.choice(joiners) + ph
    if rng.random() < 0.3:
        instruction = rng.choice(["please ", "robot, ", "could you "]) + instruction
    steps = p.steps
    if rng.random() < replan_prob:
        i = rng.randrange(len(steps))
        failed = steps[i]
        reason, fix = rng.choice(FAILURES[failed["skill"]])
        context = f"failed {plan_to_json([failed])[1:-1]}: {reason}"
        new = fix(failed) + steps[i:]
        return PlannerExample(instruction, context, tuple(new))
    return PlannerExample(instruction, "", tuple(steps))


def generate_planner_examples(seed: int, n: int, replan_prob: float = 0.2) -> List[PlannerExample]:
    rng = random.Random(seed)
    return [generate_planner_example(rng, replan_prob) for _ in range(n)]


def split_planner(seed: int, n_train: int, n_heldout: int) -> Tuple[List[PlannerExample], List[PlannerExample]]:
    """Train and held-out splits from disjoint seed streams; held-out instructions never occur in train."""
    train = generate_planner_examples(seed * 1000 + 1, n_train)
    seen = {(e.instruction, e.context) for e in train}
    held = [e for e in generate_planner_examples(seed * 1000 + 2, n_heldout * 2)
            if (e.instruction, e.context) not in seen][:n_heldout]
    return train, held
