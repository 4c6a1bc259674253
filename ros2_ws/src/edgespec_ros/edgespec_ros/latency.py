"""Control-loop latency of running edgespec nodes: what a robot's loops feel, at p99.

    python -m edgespec_ros.latency --launch configs/ros/demo_launch.yaml      # starts both demo nodes
    python -m edgespec_ros.latency --spec /spec/edgespec --plain /plain/edgespec --duration 20 --json out.json

Each scenario calls one service at a fixed rate for a fixed duration, sending on schedule whether or not
the last answer is back (a control loop does not wait), with `deadline_s` = the period:

    actions@5Hz, actions@10Hz   ~/action_tokens, one 8x7 chunk (56 tokens), the observation moving each call
    plan@1Hz                    ~/plan, up to 128 tokens, the same task with a new observation each call
    probe@10Hz                  ~/plan with max_tokens 1: the ROS/node overhead of a 1-token request
    generate@2Hz                ~/generate, the demo's streamed greedy goal (64 tokens, feedback on): a
                                goal's fixed cost (send_goal, accept, feedback, get_result) on top of decoding

Per call, on the client's monotonic clock and from the response's stats:

    round trip  = receive - send
    queued      = stats.queue_s         (waiting in the node's queue)
    generation  = stats.wall_s          (engine.generate, end to end; TTFT = stats.ttft_s within it)
    overhead    = round trip - queued - generation   (ROS both ways, executor, message conversion,
                                                      tokenizing, the client's spin)

A deadline miss is a round trip over the period, or a request the node cut at its deadline. Nodes are
measured side by side: the rounds alternate which node goes first, each round runs every scenario on
every node for duration / rounds seconds. With both nodes, each scenario also gets a speedup line: the
plain node's median round trip over the speculative one's, against the same ratio of median generation
times, and their quotient (1.0: the robot feels all of the decoding speed-up; a goal's fixed cost lowers it).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

PERCENTILES = (50, 90, 99, 100)
METRICS = ("rtt_s", "gen_s", "overhead_s", "queue_s", "ttft_s")
PLAN_INSTRUCTION = "move the red cup from the kitchen to the sink in the garage"
ACTION_INSTRUCTION = "lift the metal apple"
ACTION_OBSERVATION = [0.30, -0.26, 0.11, -0.03, 0.0, 0.30, -0.26, 0.05]


@dataclass(frozen=True)
class Scenario:
    name: str
    service: str  # "action_tokens" or "plan"
    rate_hz: float
    max_tokens: int = 0  # plan only; 0 = the node's default

    @property
    def period_s(self) -> float:
        return 1.0 / self.rate_hz


SCENARIOS: Dict[str, Scenario] = {s.name: s for s in (
    Scenario("actions@5Hz", "action_tokens", 5.0),
    Scenario("actions@10Hz", "action_tokens", 10.0),
    Scenario("plan@1Hz", "plan", 1.0, max_tokens=128),
    Scenario("probe@10Hz", "plan", 10.0, max_tokens=1),
    Scenario("generate@2Hz", "generate", 2.0, max_tokens=64),
)}


@dataclass
class Call:
    node: str
    scenario: str
    index: int
    sent: float  # client time.monotonic()
    rtt_s: float = float("nan")
    gen_s: float = float("nan")
    queue_s: float = float("nan")
    ttft_s: float = float("nan")
    overhead_s: float = float("nan")
    tokens: int = 0
    finish_reason: str = ""
    success: bool = False
    message: str = ""
    missed: bool = False


def summarize(calls: Sequence[Call], period_s: float) -> Dict[str, object]:
    """Percentiles (p50, p90, p99, max) of each metric over the answered calls, and the deadline misses."""
    answered = [c for c in calls if c.success]
    out: Dict[str, object] = {"calls": len(calls), "answered": len(answered),
                              "failed": sum(1 for c in calls if not c.success),
                              "deadline_misses": sum(1 for c in calls if c.missed),
                              "deadline_s": period_s,
                              "tokens_mean": float(np.mean([c.tokens for c in answered])) if answered else 0.0}
    for m in METRICS:
        values = np.asarray([getattr(c, m) for c in answered], np.float64)
        values = values[np.isfinite(values)]
        out[m] = ({f"p{p}" if p < 100 else "max": float(np.percentile(values, p)) for p in PERCENTILES}
                  if values.size else {})
    return out


def observation(index: int) -> List[float]:
    """The robot moves between calls: the end effector drifts a few centimetres (a new observation each call,
    so an action request shares only its instruction with the last one, as in a real control loop)."""
    drift = [0.02 * math.sin(0.3 * index), 0.02 * math.cos(0.3 * index), 0.01 * math.sin(0.7 * index)]
    return [round(a + d, 3) for a, d in zip(ACTION_OBSERVATION, drift)] + ACTION_OBSERVATION[3:]


def _request(scenario: Scenario, index: int):
    from edgespec_interfaces.action import Generate
    from edgespec_interfaces.srv import ActionTokens, Plan

    if scenario.service == "generate":  # a raw prompt: the demo's planner prompt, streamed
        from edgespec_ros.demo_client import PROMPT

        return Generate.Goal(prompt=PROMPT, max_tokens=scenario.max_tokens, temperature=0.0, seed=index)

    # seed = the call's index: ignored by greedy decoding, it names the call in the node's log
    if scenario.service == "action_tokens":
        return ActionTokens.Request(instruction=ACTION_INSTRUCTION, observation=observation(index), num_actions=8,
                                    temperature=0.0, seed=index, deadline_s=scenario.period_s)
    # replanning the same task as the scene changes: the observation text follows the instruction
    return Plan.Request(instruction=PLAN_INSTRUCTION, observation=f"cup seen {0.5 + 0.01 * (index % 50):.2f} m ahead",
                        max_tokens=scenario.max_tokens, temperature=0.0, seed=index, deadline_s=scenario.period_s)


def run_scenario(executor, client, scenario: Scenario, duration_s: float, answer_timeout_s: float = 30.0) -> List[Call]:
    """Send on schedule for `duration_s`, then wait for the last answers."""
    service = {"action_tokens": client.actions_client, "plan": client.plan_client}.get(scenario.service)
    calls: List[Call] = []
    pending = 0

    def on_done(call: Call, resp) -> None:
        nonlocal pending
        received = time.monotonic()
        pending -= 1
        call.rtt_s = received - call.sent
        call.success, call.message, call.finish_reason = bool(resp.success), resp.message, resp.finish_reason
        s = resp.stats
        call.gen_s, call.queue_s, call.ttft_s, call.tokens = s.wall_s, s.queue_s, s.ttft_s, int(s.tokens)
        call.overhead_s = call.rtt_s - call.queue_s - call.gen_s
        call.missed = call.rtt_s > scenario.period_s or call.finish_reason == "deadline"

    n = max(1, int(round(duration_s * scenario.rate_hz)))
    start = time.monotonic() + 0.05
    for i in range(n):
        due = start + i * scenario.period_s
        while (left := due - time.monotonic()) > 0:
            executor.spin_once(timeout_sec=left)
        call = Call(client.path, scenario.name, i, time.monotonic())
        pending += 1
        if service is None:
            _send_goal(client, _request(scenario, i), lambda resp, c=call: on_done(c, resp))
        else:
            service.call_async(_request(scenario, i)).add_done_callback(lambda f, c=call: on_done(c, f.result()))
        calls.append(call)
    give_up = time.monotonic() + answer_timeout_s
    while pending and time.monotonic() < give_up:
        executor.spin_once(timeout_sec=0.05)
    for c in calls:
        if not np.isfinite(c.rtt_s):
            c.message, c.missed = f"no answer within {answer_timeout_s} s", True
    return calls


def _send_goal(client, goal, on_result) -> None:
    """Send a Generate goal with feedback on (the text streams, as a robot's UI would take it); `on_result`
    gets its Generate.Result (a failed one if the goal is rejected)."""
    from edgespec_interfaces.action import Generate

    def accepted(future) -> None:
        handle = future.result()
        if handle.accepted:
            handle.get_result_async().add_done_callback(lambda f: on_result(f.result().result))
        else:
            on_result(Generate.Result(success=False, message="goal rejected"))

    client.generate_client.send_goal_async(goal, feedback_callback=lambda _fb: None).add_done_callback(accepted)


def speedups(result: Dict[str, object]) -> List[Dict[str, object]]:
    """Per scenario with both nodes: plain / speculative median round trip, the same of median generation
    time, and round-trip speedup / generation speedup."""
    rows = {(r["node"], r["scenario"]): r for r in result["rows"]}
    nodes = list(dict.fromkeys(r["node"] for r in result["rows"]))
    out = []
    if len(nodes) < 2:
        return out
    spec, plain = nodes[0], nodes[1]
    for name in dict.fromkeys(r["scenario"] for r in result["rows"]):
        a, b = rows.get((spec, name)), rows.get((plain, name))
        if not a or not b or "p50" not in a["rtt_s"] or "p50" not in b["rtt_s"]:
            continue
        rtt = b["rtt_s"]["p50"] / a["rtt_s"]["p50"]
        gen = b["gen_s"]["p50"] / a["gen_s"]["p50"] if a["gen_s"].get("p50") else float("nan")
        out.append({"scenario": name, "rtt_speedup": rtt, "gen_speedup": gen, "ratio": rtt / gen})
    return out


def measure(executor, clients, scenarios: Sequence[Scenario], duration_s: float, rounds: int,
            warmup: int = 2) -> Dict[str, object]:
    """Every scenario on every node, `rounds` times, node order alternating per round."""
    calls: Dict[tuple, List[Call]] = {(c.path, s.name): [] for c in clients for s in scenarios}
    for client in clients:  # warm the path (first calls pay discovery and allocation): `warmup` calls each
        for s in scenarios:
            run_scenario(executor, client, Scenario(s.name, s.service, 5.0, s.max_tokens), warmup / 5.0)
    for r in range(rounds):
        order = clients if r % 2 == 0 else list(reversed(clients))
        for s in scenarios:
            for client in order:
                calls[(client.path, s.name)] += run_scenario(executor, client, s, duration_s / rounds)
                time.sleep(0.2)  # let the node's queue drain between runs
    rows = []
    for (path, name), got in calls.items():
        rows.append({"node": path, "scenario": name, **summarize(got, SCENARIOS[name].period_s)})
    result = {"duration_s": duration_s, "rounds": rounds, "rows": rows,
              "calls": [asdict(c) for got in calls.values() for c in got]}
    result["speedups"] = speedups(result)
    return result


def _ms(d: Dict[str, float], key: str) -> str:
    return f"{d[key] * 1e3:.1f}" if key in d else "-"


def table(result: Dict[str, object]) -> str:
    head = ("| node | scenario | calls | misses | round trip p50 / p90 / p99 / max | generation p50 / p99 | "
            "TTFT p50 / p99 | queued p50 / p99 | ROS/node overhead p50 / p90 / p99 / max |")
    lines = [head, "|" + " --- |" * 9]
    for r in result["rows"]:
        rtt, gen, ttft, q, ov = (r[m] for m in ("rtt_s", "gen_s", "ttft_s", "queue_s", "overhead_s"))
        lines.append(f"| {r['node']} | {r['scenario']} | {r['calls']} | {r['deadline_misses']} | "
                     f"{_ms(rtt, 'p50')} / {_ms(rtt, 'p90')} / {_ms(rtt, 'p99')} / {_ms(rtt, 'max')} | "
                     f"{_ms(gen, 'p50')} / {_ms(gen, 'p99')} | {_ms(ttft, 'p50')} / {_ms(ttft, 'p99')} | "
                     f"{_ms(q, 'p50')} / {_ms(q, 'p99')} | "
                     f"{_ms(ov, 'p50')} / {_ms(ov, 'p90')} / {_ms(ov, 'p99')} / {_ms(ov, 'max')} |")
    for sp in result.get("speedups", []):
        lines.append(f"{sp['scenario']}: round trip {sp['rtt_speedup']:.2f}x, generation {sp['gen_speedup']:.2f}x "
                     f"(plain / speculative, medians): round-trip speedup / generation speedup = {sp['ratio']:.2f}")
    return "\n".join(lines) + (f"\n(ms; misses: round trip over the period, or cut at deadline_s = the period; "
                               f"client executor: {result.get('client_executor', '?')})")


def plot(result: Dict[str, object], path: str) -> Optional[str]:
    """A PNG histogram of the round trips per scenario, one colour per node. Returns why not, if not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot needs matplotlib, which is not installed: `pip install matplotlib` (or `pip install edgespec[plot]`)"
    names = sorted({r["scenario"] for r in result["rows"]}, key=list(SCENARIOS).index)
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.6 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        for node in sorted({r["node"] for r in result["rows"]}):
            rtt = [c["rtt_s"] * 1e3 for c in result["calls"]
                   if c["scenario"] == name and c["node"] == node and c["success"]]
            if rtt:
                ax.hist(rtt, bins=40, alpha=0.6, label=node)
        ax.axvline(SCENARIOS[name].period_s * 1e3, color="red", linestyle="--", label="deadline")
        ax.set_title(name)
        ax.set_xlabel("round trip (ms)")
        ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp)
    os.replace(tmp, path)
    return None


def make_executor(kind: str):
    """The client's executor. Each wake-up of rclpy's Python executors rebuilds the wait set (about a
    millisecond here); the EventsExecutor (C++ event queue, rclpy >= Kilted) does not."""
    from rclpy.executors import SingleThreadedExecutor

    if kind == "events":
        try:
            from rclpy.experimental import EventsExecutor
        except ImportError:  # Humble, Jazzy
            return SingleThreadedExecutor()
        return EventsExecutor()
    return SingleThreadedExecutor()


def _write_json(path: str, data) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgespec_ros.latency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--launch", help="start the nodes of this launcher YAML first (and stop them at the end)")
    parser.add_argument("--spec", default="/spec/edgespec", help="speculative node (fully qualified name)")
    parser.add_argument("--plain", default="/plain/edgespec", help="plain-decoding node; '' to measure one node")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, from {', '.join(SCENARIOS)}")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per scenario and node, all rounds")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the node order")
    parser.add_argument("--short", action="store_true", help="a quick check: 1 s per scenario, one round")
    parser.add_argument("--json", metavar="PATH", help="write every call and the summary as JSON ('-' = stdout)")
    parser.add_argument("--plot", metavar="PNG", help="write a histogram of the round trips")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the nodes")
    parser.add_argument("--client-executor", choices=("events", "single"), default="events",
                        help="how this client spins: rclpy's EventsExecutor (rclpy.experimental, Kilted and later; "
                             "falls back to single where missing) or the SingleThreadedExecutor")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown or not names:
        parser.error(f"--scenarios: unknown {unknown or names}; choose from {', '.join(SCENARIOS)}")
    if args.duration <= 0 or args.rounds < 1:
        parser.error(f"--duration must be > 0 and --rounds >= 1 (got {args.duration}, {args.rounds})")
    duration, rounds = (1.0, 1) if args.short else (args.duration, args.rounds)
    if args.plot and not args.plot.endswith(".png"):
        parser.error(f"--plot: {args.plot!r} should name a .png file")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib, which is not installed: `pip install matplotlib` "
                     "(or `pip install edgespec[plot]`)")

    import rclpy

    from edgespec_ros.client import EdgespecClient

    launcher = None
    if args.launch:
        os.environ.setdefault("ROS_DOMAIN_ID", str(random.randint(1, 100)))
        os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
        print(f"starting nodes from {args.launch} (ROS_DOMAIN_ID={os.environ['ROS_DOMAIN_ID']})", file=sys.stderr,
              flush=True)
        launcher = subprocess.Popen([sys.executable, "-m", "edgespec_ros.launcher", args.launch])
    rclpy.init()
    node = rclpy.create_node("edgespec_latency", start_parameter_services=False)  # fewer entities to wait on
    executor = make_executor(args.client_executor)
    try:
        clients = [EdgespecClient(node, p) for p in (args.spec, args.plain) if p]
        for c in clients:
            print(f"waiting for {c.path} to be active ...", file=sys.stderr, flush=True)
            c.wait_for_services(args.timeout)
            c.wait_until_state("active", args.timeout)
        executor.add_node(node)  # after the waits: they spin the node in rclpy's global executor
        result = measure(executor, clients, [SCENARIOS[n] for n in names], duration, rounds,
                         warmup=2 if args.short else 5)
        result["client_executor"] = type(executor).__name__
        print(table(result) if args.json != "-" else json.dumps(result), flush=True)
        if args.json and args.json != "-":
            _write_json(args.json, result)
        if args.plot:
            why = plot(result, args.plot)
            if why:
                print(f"edgespec latency: {why}", file=sys.stderr)
                return 2
        return 0
    except TimeoutError as exc:
        print(f"edgespec latency: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
        if launcher is not None:
            launcher.send_signal(2)
            try:
                launcher.wait(timeout=15)
            except subprocess.TimeoutExpired:
                launcher.kill()


if __name__ == "__main__":
    sys.exit(main())
