"""Prompt templates and special tokens of the embedded zoo: the one source used both to train and to run it.

A prompt ends with SEP; the model's answer follows it and ends with EOS.

    planner_prompt("bring me the red cup from the kitchen")
      -> '<|bos|><|plan|>bring me the red cup from the kitchen<|sep|>'
      answer: '[{"skill":"navigate","room":"kitchen"},{"skill":"pick","object":"red cup"},...]<|eos|>'
    planner_prompt(instr, context='failed {"skill":"pick","object":"red cup"}: not found')
      -> '<|bos|><|plan|>' + instr + '<|ctx|>failed {...}: not found<|sep|>'   (answer: the repaired rest of the plan)
    action_prompt("pick up the red cup", [0.1, -0.2, 0.3, 0.0, 1.0, 0.4, 0.1, 0.02])
      -> '<|bos|><|act|>pick up the red cup<|obs|>+0.10 -0.20 +0.30 +0.00 +1.00 +0.40 +0.10 +0.02<|sep|>'
      answer: ACTION_CHUNK x 7 action-bin tokens '<|a000|>'..'<|a255|>', then '<|eos|>'
    text_prompt("To be, or not") -> '<|bos|><|text|>To be, or not'   (free prose, no SEP)

These are one instance (ZOO_PROMPTS) of the general mechanism in runtime/text/templates.py: a bundle carries its
model's own format (chat template, task templates, EOS tokens), and `planner_prompt(..., fmt)` renders with
it. CHAT_PLANNER / CHAT_ACTION are the task templates `edgespec bundle` gives a model with a chat template.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Sequence, Union

from runtime.errors import RequestError
from runtime.text.templates import PromptFormat, RenderedPrompt, TaskTemplate

PAD = "<|pad|>"
BOS = "<|bos|>"
EOS = "<|eos|>"
PLAN = "<|plan|>"
ACT = "<|act|>"
OBS = "<|obs|>"
TEXT = "<|text|>"
SEP = "<|sep|>"
CTX = "<|ctx|>"

# Order fixes the token ids: PAD=0, BOS=1, EOS=2, ..., then the 256 action bins.
TASK_TOKENS: List[str] = [PAD, BOS, EOS, PLAN, ACT, OBS, TEXT, SEP, CTX]
ACTION_BINS = 256
ACTION_TOKENS: List[str] = [f"<|a{i:03d}|>" for i in range(ACTION_BINS)]
SPECIAL_TOKENS: List[str] = TASK_TOKENS + ACTION_TOKENS

ACTION_DIMS = 7  # dx dy dz droll dpitch dyaw gripper
ACTION_CHUNK = 8  # actions per answer
OBS_DIMS = 8  # ee x y z, ee yaw, gripper opening, goal x y z
OBS_LIMIT = 10.0  # |value| in metres / radians / gripper opening: beyond it a value is not a robot's reading

SKILLS: Dict[str, tuple] = {  # skill -> required argument names (other args are optional)
    "navigate": ("room",),
    "pick": ("object",),
    "place": ("object", "target"),
    "open": ("object",),
    "close": ("object",),
    "inspect": ("object",),
    "handover": ("object", "person"),
    "wait": ("seconds",),
}

ZOO_PROMPTS = PromptFormat(
    tasks={"planner": TaskTemplate(raw=f"{BOS}{PLAN}{{{{ instruction }}}}{{% if context %}}{CTX}{{{{ context }}}}"
                                       f"{{% endif %}}{SEP}"),
           "action": TaskTemplate(raw=f"{BOS}{ACT}{{{{ instruction }}}}{OBS}{{{{ observation }}}}{SEP}"),
           "text": TaskTemplate(raw=f"{BOS}{TEXT}{{{{ text }}}}")},
    special_tokens={"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, eos_tokens=(EOS,),
    source="the zoo's prompt format")

# For an instruction-tuned model (rendered by its chat template): the zoo's skills, told in words.
CHAT_PLANNER = TaskTemplate(
    system="You are the task planner of a home robot. Answer with the plan only: a JSON list of steps, each an "
           "object {\"skill\": NAME, ...arguments}. Skills and their required arguments: "
           + ", ".join(f"{k}({', '.join(v)})" for k, v in SKILLS.items())
           + '. Example: [{"skill":"navigate","room":"kitchen"},{"skill":"pick","object":"red cup"}]',
    user="{{ instruction }}{% if context %}\n\nWhat happened so far: {{ context }}\nPlan the rest.{% endif %}")
CHAT_ACTION = TaskTemplate(
    system=f"You control a robot arm. Answer with {ACTION_CHUNK} actions of {ACTION_DIMS} action tokens each.",
    user="{{ instruction }}\nObservation: {{ observation }}")


def zoo_tokens_in(tokenizer) -> bool:
    """Whether a tokenizer has the zoo's task tokens (a bundle without a `prompts` section then gets ZOO_PROMPTS)."""
    return all(tokenizer.token_to_id(t) is not None for t in (BOS, EOS, PLAN, ACT, TEXT, SEP, CTX, OBS))


def planner_prompt(instruction: str, context: str = "", fmt: PromptFormat = ZOO_PROMPTS) -> str:
    """The planner prompt; `context` (optional) reports what went wrong so the model replans the rest."""
    return planner_request(instruction, context, fmt).text


def planner_request(instruction: str, context: str = "", fmt: PromptFormat = ZOO_PROMPTS,
                    context_field: str = "context") -> RenderedPrompt:
    """The planner prompt with the request's text marked (Tokenizer.encode_prompt keeps it text)."""
    instruction = instruction.strip()
    if not instruction:
        raise RequestError("instruction", "is empty; give the robot an instruction such as 'bring me the cup'")
    return fmt.render_parts("planner", {"context": context_field}, instruction=instruction,
                            context=context.strip() if context else "")


def format_observation(observation: Sequence[float]) -> str:
    return " ".join(f"{float(v):+.2f}" for v in observation)


def action_prompt(instruction: str, observation: Union[Sequence[float], str], fmt: PromptFormat = ZOO_PROMPTS) -> str:
    """The action prompt: instruction plus observation (OBS_DIMS floats, or an already formatted string)."""
    return action_request(instruction, observation, fmt).text


def action_request(instruction: str, observation: Union[Sequence[float], str],
                   fmt: PromptFormat = ZOO_PROMPTS) -> RenderedPrompt:
    """The action prompt with the request's text marked (an observation given as text is request text too)."""
    instruction = instruction.strip()
    if not instruction:
        raise RequestError("instruction", "is empty; give the arm an instruction such as 'pick up the red cup'")
    if isinstance(observation, str):
        obs = observation.strip()
    else:
        if len(observation) != OBS_DIMS:
            raise RequestError("observation", f"has {len(observation)} values, expected {OBS_DIMS} "
                                              "(ee x y z, ee yaw, gripper, goal x y z)")
        for i, v in enumerate(observation):
            if not -OBS_LIMIT <= float(v) <= OBS_LIMIT:  # NaN fails too
                raise RequestError("observation", f"observation[{i}] = {float(v):g} is outside [{-OBS_LIMIT:g}, "
                                                  f"{OBS_LIMIT:g}] (metres, radians, gripper 0..1): send the "
                                                  "robot's reading in these units")
        obs = format_observation(observation)
    fields = {"observation": "observation_text"} if isinstance(observation, str) else {}
    return fmt.render_parts("action", fields, instruction=instruction, observation=obs)


def text_prompt(text: str, fmt: PromptFormat = ZOO_PROMPTS) -> str:
    return fmt.render("text", text=text)


def plan_to_json(steps: List[Dict[str, Any]]) -> str:
    """The canonical compact JSON of a plan (the form the model is trained to write)."""
    return json.dumps(steps, separators=(",", ":"))


def parse_plan(text: str) -> List[Dict[str, Any]]:
    """Parse and validate a plan: a JSON list of {"skill": name, <required args>...}, each key once, and a
    `count` (if any) an integer >= 1.

    An EOS token (and anything after it) is stripped first. Raises RequestError(field="plan") naming the problem.
    """
    body = text.split(EOS, 1)[0].strip()
    try:
        steps = json.loads(body, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise RequestError("plan", f"is not valid JSON ({exc.msg} at char {exc.pos}): {body[:80]!r}") from None
    if not isinstance(steps, list) or not steps:
        raise RequestError("plan", "must be a non-empty JSON list of steps")
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or "skill" not in step:
            raise RequestError("plan", f"step {i} must be an object with a 'skill' key, got {step!r}")
        skill = step["skill"]
        if skill not in SKILLS:
            raise RequestError("plan", f"step {i} has unknown skill {skill!r}; known: {sorted(SKILLS)}")
        missing = [a for a in SKILLS[skill] if a not in step]
        if missing:
            raise RequestError("plan", f"step {i} ({skill}) lacks argument(s) {missing}")
        count = step.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise RequestError("plan", f"step {i} ({skill}) has count {count!r}; a count is an integer >= 1")
    return steps


def _no_duplicate_keys(pairs: List[tuple]) -> Dict[str, Any]:
    """A JSON object, refused when a key repeats: json.loads would keep the last value silently, so
    {"skill":"pick","object":"cup","object":"knife"} would pass as a plan to pick a knife."""
    keys = [k for k, _ in pairs]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup is not None:
        raise RequestError("plan", f"an object repeats the key {dup!r} ({dict(pairs)!r} is ambiguous)")
    return dict(pairs)


def plan_objects(steps: List[Dict[str, Any]]) -> set:
    """The objects a plan manipulates or inspects (its 'object' arguments)."""
    return {s["object"] for s in steps if "object" in s}
